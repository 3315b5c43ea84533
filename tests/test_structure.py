"""The code's shape: no import cycle inside mlsys, and chapter helper modules that cannot shadow each other.

An import inside a function still makes a cycle at run time (engine.py imported tp.py lazily while tp.py imported
engine.py for an exception class), so the graph below counts every import statement except those under
`if TYPE_CHECKING:`, which never run.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from conftest import ROOT, TUTORIAL

MLSYS = ROOT / "mlsys"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The mlsys modules `path` imports anywhere in its body, leaving out `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found - {module_name(path)}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def mlsys_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in MLSYS.rglob("*.py")}
    # a package's __init__ imports its submodules by design; an edge into a package means its __init__ only
    return {name: {m for m in imports_of(path, set(files)) if not (name.endswith(("mlsys", "engine", "attempt"))
                                                                    and m.startswith(name + "."))}
            for name, path in files.items()}


def test_mlsys_has_no_import_cycle_even_through_imports_inside_functions() -> None:
    graph = mlsys_graph()
    assert "mlsys.engine.engine" in graph and len(graph) > 40
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = mlsys_graph()
    graph["mlsys.engine.request"] = graph["mlsys.engine.request"] | {"mlsys.engine.engine"}
    cycle = find_cycle(graph)
    assert cycle and cycle[0] == cycle[-1] and "mlsys.engine.request" in cycle


def test_chapter_helper_modules_have_unique_names() -> None:
    """A script finds its chapter's `_helper.py` through its own folder on sys.path; the tests import many chapters'
    scripts into one process (conftest.load_script), so two chapters with a `_common.py` would shadow each other."""
    names = Counter(p.name for p in TUTORIAL.glob("part*/chapter*/scripts/_*.py"))
    assert names and not [n for n, c in names.items() if c > 1]
