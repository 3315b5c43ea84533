"""Check the lessons for three things a reader cannot see but the book depends on.

1. Hand-typed measurements: a number in a lesson's prose that looks machine-dependent (a time, a throughput, a
   bandwidth, a measured ratio such as 1.42x) must come from the run shown beside it through a
   `<!-- value: script path [format] -->` marker, not be typed. A line that legitimately quotes a fixed number
   (a spec-sheet figure with its link, a paper's result with its citation, a recorded GPU run kept as data)
   carries `<!-- typed: reason -->` on the same source line.
2. Orphan snippets: every `# --8<-- [start:name]` section in tutorial/ and mlsys/ is included by some page
   (`--8<-- "path:name"` in a lesson or in book/pages/); a section nobody includes is dead weight that drifts.
3. Collapsed blocks closed early: a line at column 0 that continues the indented paragraph of a `??? note` or
   `!!! note` block ends the block there, and the rest of its body renders as literal code (`broken_blocks`).

    python scripts/check_lessons.py              # every chapter; exit 1 if anything is listed
    python scripts/check_lessons.py chapter04    # the lessons whose folder contains "chapter04" (orphans: all)
    python scripts/check_lessons.py --terms      # warnings: glossary terms a lesson uses before defining them

Exit 0 clean, 1 problems listed (one per line, file:line: what), 2 bad usage. Runs in well under a second;
tests/test_book.py runs it, so `make test` fails on a hand-typed measurement or an orphan section.
"""
from __future__ import annotations

import argparse
import re
import sys
import unicodedata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FENCE_RE = re.compile(r"^\s*(```+|~~~+)")
COMMENT_RE = re.compile(r"<!--.*?-->", re.S)
INLINE_CODE_RE = re.compile(r"`[^`\n]*`")
MATH_RE = re.compile(r"\$[^$\n]+\$")
LINK_TARGET_RE = re.compile(r"\]\([^)]*\)")
TYPED_RE = re.compile(r"<!--\s*typed:\s*\S")
NUMBER = r"(?<![\w.])\d[\d,]*(?:\.\d+)?"
MEASURED = [  # a number with a unit that a run on some machine produced
    (re.compile(NUMBER + r"\s?(?:ns|µs|us|ms)\b"), "a time"),
    (re.compile(r"(?<![\w.])\d[\d,]*\.\d+\s?(?:s|seconds?)\b"), "a time"),
    (re.compile(NUMBER + r"\s?(?:[GMKT]i?B/s|[GM]bit/s|tok/s|tokens/s|req/s|it/s|steps/s|samples/s|"
                         r"[GT]FLOP/s|TFLOPS|GFLOPS)"), "a rate"),
    (re.compile(r"(?<![\w.])\d+\.\d+\s?[x×](?![\w])"), "a measured ratio"),
    (re.compile(r"(?<![\w.])\d[\d,]*\.\d+\s?(?:nanoseconds?|microseconds?|milliseconds?|seconds?|minutes?)\b"),
     "a time"),
    (re.compile(r"\b(?:about|around|roughly|nearly|almost|took|takes|taking|~)\s*" + NUMBER
                + r"\s?(?:s|sec|secs|min|mins|ms|seconds?|minutes?|milliseconds?)\b"), "a time"),
    (re.compile(NUMBER + r"\s?(?:[x×]|times)\s+(?:faster|slower|quicker|higher|lower|as fast|the speed)\b"),
     "a measured ratio"),
    (re.compile(r"\b(?:speed-?ups?|slow-?downs?)\s+(?:of\s+)?(?:about\s+|roughly\s+)?" + NUMBER), "a measured ratio"),
    (re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+\.\d+)\s?(?:[A-Za-z]+\s)?(?:per second|a second)\b"), "a rate"),
    (re.compile(NUMBER + r"\s?%\s+(?:faster|slower|of the (?:time|step|wall|run)|of its time|overhead|share|idle)"),
     "a measured share"),
    (re.compile(r"\b(?:share|overhead|utili[sz]ation|idle time|MFU|efficiency)\s+(?:of|was|is|at|reached)\s+"
                r"(?:about\s+|roughly\s+)?" + NUMBER + r"\s?%"), "a measured share"),
]
# a number with a unit inside a formula: $3.7\,\text{ms}$
LATEX_UNIT_RE = re.compile(NUMBER + r"\s*(?:\\[,;: !]|~)?\s*\\(?:text|mathrm|textrm|operatorname)\{\s*"
                           r"(?:ns|µs|us|ms|s|GB/s|GiB/s|MB/s|MiB/s|tok/s|tokens/s|req/s)\s*\}")
SECTION_RE = re.compile(r"--8<--\s*\[start:([\w.-]+)\]")
INCLUDE_RE = re.compile(r'--8<--\s*"([^":]+):([\w.-]+)"')


def prose_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, prose with code/comments/math removed, the raw line) for every line outside fences."""
    out, fence = [], None
    stripped = COMMENT_RE.sub(lambda m: "\n" * m.group().count("\n"), text)  # multi-line comments keep line numbers
    for number, (line, raw) in enumerate(zip(stripped.split("\n"), text.split("\n")), 1):
        m = FENCE_RE.match(line)
        if m:
            fence = None if fence and m.group(1).startswith(fence) else (fence or m.group(1))
            continue
        if fence:
            continue
        line = LINK_TARGET_RE.sub("]()", MATH_RE.sub("", INLINE_CODE_RE.sub("", line)))
        out.append((number, line, raw))
    return out


def typed_numbers(line: str, raw: str) -> list[tuple[str, str]]:
    """(what, text) of every machine-dependent-looking number in one prose line. A `<!-- typed: reason -->`
    marker exempts only what comes before it on the line: a number written after the marker is still checked."""
    mark = TYPED_RE.search(raw)
    if mark:
        after = COMMENT_RE.sub("", raw[mark.start():])
        line = LINK_TARGET_RE.sub("]()", MATH_RE.sub("", INLINE_CODE_RE.sub("", after)))
    found, taken = [], []
    for pattern, what in MEASURED:        # overlapping matches of two patterns are one finding
        for m in pattern.finditer(line):
            if not any(m.start() < end and start < m.end() for start, end in taken):
                taken.append(m.span())
                found.append((what, m.group().strip()))
    for formula in MATH_RE.findall(INLINE_CODE_RE.sub("", raw if not mark else raw[mark.start():])):
        found += [("a time or rate in a formula", m.group().strip()) for m in LATEX_UNIT_RE.finditer(formula)]
    return found


def hand_typed(path: Path, text: str | None = None, offset: int = 0) -> list[str]:
    """Hand-typed measurements in a markdown file (or in `text`, a docstring starting at line `offset` + 1)."""
    problems = []
    for number, line, raw in prose_lines(path.read_text(encoding="utf-8") if text is None else text):
        for what, found in typed_numbers(line, raw):
            problems.append(f"{path.relative_to(REPO)}:{number + offset}: hand-typed {what} `{found}`: "
                            "take it from the run with <!-- value: ... --> (or mark <!-- typed: reason --> after it)")
    return problems


def docstring_typed(script: Path) -> list[str]:
    """The same check over a script's docstring (shown on its page), but for its `Runtime ...` line, an
    approximate budget the book build compares with the captured run."""
    import ast

    tree = ast.parse(script.read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree, clean=False)
    if not doc:
        return []
    first = tree.body[0].lineno - 1
    kept, in_runtime = [], False
    for line in doc.split("\n"):
        in_runtime = in_runtime and bool(line.strip())          # the Runtime paragraph ends at a blank line
        if "Runtime" in line:
            kept.append(line[: line.index("Runtime")])
            in_runtime = True
        else:
            kept.append("" if in_runtime else line)
    kept = "\n".join(kept)
    return hand_typed(script, "```text\n```\n" + kept, first - 2)


# ----------------------------------------------------------------------------------------------- terms (warnings)
GLOSSARY_TERM_RE = re.compile(r"^### +(.+?)\s*$", re.M)
BOLD_RE = re.compile(r"\*\*([^*]+)\*\*")
GLOSSARY_LINK_RE = re.compile(r"\[([^\]]+)\]\([^)]*glossary\.md[^)]*\)")


def glossary_terms(root: Path) -> dict[str, list[str]]:
    """Glossary heading -> the spellings a lesson may use: "Data parallelism (DP)" -> data parallelism, DP;
    "TTFT / ITL" -> TTFT, ITL."""
    file = root / "book/pages/glossary.md"
    terms = {}
    for head in GLOSSARY_TERM_RE.findall(file.read_text(encoding="utf-8")) if file.is_file() else []:
        names = [n.strip() for part in re.split(r"\s/\s", re.sub(r"\)", "", head)) for n in part.split("(")]
        terms[head] = [n for n in names if len(n) > 1]
    return terms


def _term_re(name: str) -> re.Pattern:
    flags = 0 if name.isupper() or any(c.isupper() for c in name[1:]) else re.I  # acronyms match as written
    return re.compile(r"(?<![\w-])" + re.escape(name) + r"(?:e?s)?(?![\w-])", flags)


def term_warnings(root: Path, lessons: list[Path]) -> list[str]:
    """Glossary terms a lesson uses before it introduces them. A term is introduced by writing it in **bold** or
    linking it to the glossary; a term introduced by an earlier chapter may be used freely. Headings are not uses.
    Warnings only: a heuristic over the prose, meant to point a writer at the sentence to look at."""
    terms = glossary_terms(root)
    introduced: set[str] = set()
    warnings = []
    for lesson in sorted(lessons, key=lambda q: q.parent.name.split("-")[0]):
        lines = prose_lines(lesson.read_text(encoding="utf-8"))  # (number, prose, raw line: links intact)
        here: set[str] = set()
        for head, names in terms.items():
            patterns = [_term_re(n) for n in names]
            first_use = intro = None
            for number, line, raw in lines:
                intro_spans = [m.group(1) for m in (*BOLD_RE.finditer(line), *GLOSSARY_LINK_RE.finditer(raw))]
                if intro is None and any(p.search(span) for p in patterns for span in intro_spans):
                    intro = number
                if first_use is None and not line.lstrip().startswith("#") and any(p.search(line) for p in patterns):
                    first_use = number
            if intro is not None:
                here.add(head)
            if first_use is not None and head not in introduced and (intro is None or first_use < intro):
                where = f"introduced on line {intro}" if intro else "never introduced in this or an earlier lesson"
                warnings.append(f"{lesson.relative_to(root)}:{first_use}: term `{head}` used before it is "
                                f"defined ({where}): bold it where it is explained, or link it to the glossary")
        introduced |= here
    return warnings


HEADING_RE = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
NOT_TEACHING = {"exercises", "try-next", "recap", "further-reading"}


def heading_anchor(title: str) -> str:
    """The id mkdocs (Python-Markdown's toc) gives a heading: its text without markup, lower case, hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link keeps its text
    text = re.sub(r"[`*_]", "", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def term_introductions(root: Path, lessons: list[Path]) -> dict[str, dict[str, tuple[Path, str]]]:
    """Glossary heading -> {"explained": (the first lesson, in chapter order, that writes the term in bold, the id
    of the heading above that line), "mentioned": the same for its first bold or glossary link}; either may be
    missing. Exercises, recaps and reading lists name terms without teaching them and are skipped. A glossary entry
    can then point at the section that teaches the term."""
    bold, any_intro = _first_spans(root, lessons, bold_only=True), _first_spans(root, lessons, bold_only=False)
    out: dict[str, dict[str, tuple[Path, str]]] = {}
    for head in glossary_terms(root):
        found = {k: v[head] for k, v in (("explained", bold), ("mentioned", any_intro)) if head in v}
        if found:
            out[head] = found
    return out


def _first_spans(root: Path, lessons: list[Path], bold_only: bool) -> dict[str, tuple[Path, str]]:
    terms = glossary_terms(root)
    found: dict[str, tuple[Path, str]] = {}
    for lesson in sorted(lessons, key=lambda q: q.parent.name.split("-")[0]):
        text = lesson.read_text(encoding="utf-8")
        raw_lines = text.splitlines()
        headings, fence = {}, None  # line number -> anchor of the last heading at or above it
        current = ""
        for number, line in enumerate(raw_lines, 1):
            stripped = line.strip()
            if stripped.startswith(("```", "~~~")):
                fence = None if fence and stripped.startswith(fence) else (fence or stripped[:3])
            m = HEADING_RE.match(line) if fence is None else None
            if m and len(m.group(1)) >= 2:
                current = heading_anchor(m.group(2))
            headings[number] = current
        lines = prose_lines(text)
        for head, names in terms.items():
            if head in found:
                continue
            patterns = [_term_re(n) for n in names]
            for number, line, raw in lines:
                links = () if bold_only else GLOSSARY_LINK_RE.finditer(raw)
                spans = [m.group(1) for m in (*BOLD_RE.finditer(line), *links)]
                if headings.get(number, "") in NOT_TEACHING:  # a recap or an exercise names a term, not teaches it
                    continue
                if not line.lstrip().startswith("#") and any(p.search(span) for p in patterns for span in spans):
                    found[head] = (lesson, headings.get(number, ""))
                    break
    return found


def broken_blocks(path: Path) -> list[str]:
    """Lines that end a collapsed (`??? note`) or admonition (`!!! note`) block early: a line at column 0 that
    continues the block's indented paragraph (no blank line between). Markdown closes the block there, and the
    rest of its body renders as one literal code block, fences and comments in plain view."""
    problems, inside, fence, previous = [], False, None, ""
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        m = FENCE_RE.match(line)
        if m:
            fence = None if fence and m.group(1).startswith(fence) else (fence or m.group(1))
        elif fence:
            pass
        elif re.match(r"(\?\?\?\+?|!!!) ", line):
            inside = True
        elif inside and line.strip() and not line[:1].isspace():
            if previous.startswith("    ") and previous.strip():
                problems.append(f"{path.relative_to(REPO)}:{number}: this line at column 0 ends the collapsed "
                                "block above it early (the rest renders as code): indent it like the block")
            inside = False
        previous = line
    return problems


def orphan_sections(root: Path) -> list[str]:
    sections = {}
    for src in sorted([*root.glob("tutorial/**/*.py"), *root.glob("mlsys/**/*.py")]):
        for number, line in enumerate(src.read_text(encoding="utf-8").splitlines(), 1):
            for name in SECTION_RE.findall(line):
                sections[(src.relative_to(root).as_posix(), name)] = number
    pages = [*root.glob("tutorial/part*/chapter*/README.md"), *root.glob("book/pages/*.md")]
    included = {m for page in pages for m in INCLUDE_RE.findall(page.read_text(encoding="utf-8"))}
    return [f"{path}:{line}: snippet section `{name}` is included by no page: include it or delete the marker"
            for (path, name), line in sorted(sections.items()) if (path, name) not in included]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="check_lessons.py", description=__doc__.split("\n")[0])
    p.add_argument("only", nargs="?", default="", help="check only lessons whose folder contains this text")
    p.add_argument("--terms", action="store_true",
                   help="instead, list glossary terms used before they are defined (warnings; exit 0)")
    a = p.parse_args(argv)
    every = sorted(REPO.glob("tutorial/part*/chapter*/README.md"))
    lessons = [q for q in every if a.only in q.parent.name]
    if not lessons:
        p.error(f"no lesson folder contains {a.only!r}")
    if a.terms:  # earlier chapters count as introductions, so the whole book is read and the selection shown
        found = [w for w in term_warnings(REPO, every) if any(w.startswith(str(q.relative_to(REPO))) for q in lessons)]
        print("\n".join(found) if found else f"{len(lessons)} lessons: every glossary term defined before use")
        return 0
    pages = sorted(REPO.glob("book/pages/*.md")) if not a.only else []
    scripts = sorted(s for q in lessons for s in (q.parent / "scripts").glob("*.py"))
    problems = ([line for lesson in [*lessons, *pages] for line in hand_typed(lesson) + broken_blocks(lesson)]
                + [line for script in scripts for line in docstring_typed(script)] + orphan_sections(REPO))
    print("\n".join(problems) if problems else f"{len(lessons)} lessons: no hand-typed measurement, no orphan")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
