"""Workshop exercises: check a learner's attempt, one readable pass/fail line per task.

    make check EX=ch01.1              # checks tutorial/.../chapter01-*/exercises/ex1_*.py (your attempt)
    make check EX=ch01.1 SOLUTION=1   # the same checks against exercises/solutions/ex1_*.py
    python -m mlsys.exercises all --solution
    python -m mlsys.exercises ch01.2 --file ~/my_attempt.py   # an attempt kept somewhere else

Layout of a chapter's exercises/ folder:
    ex<K>_<name>.py             the stub you edit: real signatures, bodies that raise NotImplementedError("TODO ...")
    solutions/ex<K>_<name>.py   the reference solution
    check_ex<K>.py              the checker: functions decorated with @task, run in the order they are defined;
                                each gets `ex`, a handle on the attempt's module (which runs in its own process),
                                and raises AssertionError to fail.

Distributed tasks run the attempt on real ranks with `run_ranks`; tasks marked `@task(..., gpu=True)` report
"needs a GPU" on machines without CUDA instead of failing.

The attempt runs in a child process, never in the checker's: an attempt that loops forever is stopped after
`--time-limit` seconds per task (its ranks with it), one that calls sys.exit or os._exit, kills itself, floods
the output or does not import is a FAIL with one line, and the next task still runs.

The verdict is computed where the attempt cannot reach it. The checker's tasks run in this process, which never
imports the attempt: `ex` in a task is a handle on the attempt's module in the child (mlsys.attempt), and
`ex.f(x)` sends x to the child, which calls the attempt's f and sends back what it returned as plain data
(numbers, strings, lists, dicts, tensors and arrays as dtype, shape and bytes; an exception as its type and
text). The reference answers, the comparisons and PASS/FAIL are all computed here, so an attempt that rewrites the
checker's functions, patches torch.allclose, returns an object that equals everything or writes forged messages
into the connection cannot pass; it only changes what the child reports it observed. What a checker must know:
arguments are copies (only a torch.Generator's state comes back, so a shared generator advances as it would in
one process); loss.backward() on a returned tensor asks the child for the gradient; `source_of(ex.f)` replaces
inspect.getsource (the source as it was read before the attempt ran); a call costs a round trip between processes,
so a check that calls a function thousands of times batches them with `call_many(ex.f, [args, ...])`.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from mlsys import loader
from mlsys.loader import load_module

REPO_ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = REPO_ROOT / "tutorial"
DEFAULT_TIME_LIMIT = 120.0  # seconds one task may take (--time-limit); a distributed task starts ranks in ~3 s
OUTPUT_LIMIT = 16 << 20  # bytes an attempt may print (or write to any file) before its task fails
MEMORY_LIMIT = 4 << 30  # bytes of data an attempt's process may add to what it starts with (RLIMIT_DATA)


@dataclass
class Exercise:
    exercise_id: str  # "ch01.1"
    attempt: Path
    solution: Path
    checker: Path


@dataclass
class Outcome:
    task: str
    status: str  # "PASS", "FAIL", "TODO", "NEEDS GPU", or "SKIPPED" (check(stop_at_fail=True) only)
    detail: str = ""


def task(title: str, *, gpu: bool = False) -> Callable[[Callable], Callable]:
    """Mark a checker function as one task of an exercise."""

    def mark(fn: Callable) -> Callable:
        fn.__task__ = {"title": title, "gpu": gpu}  # type: ignore[attr-defined]
        return fn

    return mark


@contextlib.contextmanager
def reference_helpers(attempt: ModuleType, **helpers: Callable):
    """The attempt's module with these reference functions in place of its own, for the duration of one task:
    a task checks one function even when that function calls another the learner also writes."""
    saved = {name: getattr(attempt, name) for name in helpers}
    for name, fn in helpers.items():
        setattr(attempt, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(attempt, name, fn)


def all_exercises() -> list[Exercise]:
    found = []
    for checker in sorted(TUTORIAL.glob("part*/chapter*/exercises/check_ex*.py")):
        chapter = int(re.match(r"chapter(\d+)", checker.parent.parent.name).group(1))  # type: ignore[union-attr]
        number = int(checker.stem.removeprefix("check_ex"))
        attempts = sorted(checker.parent.glob(f"ex{number}_*.py"))
        if len(attempts) != 1:
            raise FileNotFoundError(f"{checker}: expected exactly one ex{number}_*.py beside it, found {len(attempts)}")
        solution = checker.parent / "solutions" / attempts[0].name
        found.append(Exercise(f"ch{chapter:02d}.{number}", attempts[0], solution, checker))
    return found


def find(exercise_id: str) -> Exercise:
    for exercise in all_exercises():
        if exercise.exercise_id == exercise_id:
            return exercise
    known = ", ".join(e.exercise_id for e in all_exercises())
    raise LookupError(f"no exercise {exercise_id!r}; known: {known}")


def check(exercise: Exercise, solution: bool = False, target: Path | None = None,
          time_limit: float = DEFAULT_TIME_LIMIT, stop_at_fail: bool = False,
          memory_limit: int = MEMORY_LIMIT) -> list[Outcome]:
    """Run every task of the exercise's checker against the attempt, the reference solution, or `target`.

    The tasks run here; the attempt runs in a child process (forked from a server that has torch imported, so it
    starts in milliseconds) that answers the tasks' requests with what the attempt's functions returned. Whatever
    the attempt does, the task it was in is a FAIL with one line: it hangs past `time_limit` seconds (the child's
    whole process group, distributed ranks included, is killed), it ends the interpreter (sys.exit, os._exit, a
    signal), it cannot be imported (a syntax error, an exception at import), it prints more than OUTPUT_LIMIT
    bytes, or its process sends what the protocol does not allow. After a child dies, a fresh one serves the next
    task. With `stop_at_fail`, the tasks after the first FAIL are not run (status "SKIPPED"): enough to know that
    an attempt fails.
    """
    from mlsys.attempt.link import Link

    target = (target or (exercise.solution if solution else exercise.attempt)).resolve()
    titles, gpu = _task_titles(exercise.checker)
    checker = load_module(exercise.checker)
    tasks = [fn for fn in vars(checker).values() if callable(fn) and hasattr(fn, "__task__")]
    assert [fn.__task__["title"] for fn in tasks] == titles, f"{exercise.checker}: tasks defined out of order"
    try:  # read before the attempt runs: source_of() shows this text, whatever the attempt does to its file
        source = target.read_text(encoding="utf-8", errors="replace")
    except OSError:
        source = ""
    outcomes: list[Outcome] = []
    link = None
    try:
        for fn, title, needs_gpu in zip(tasks, titles, gpu):
            if stop_at_fail and any(o.status == "FAIL" for o in outcomes):
                outcomes += [Outcome(t, "SKIPPED", "not run: an earlier task failed") for t in titles[len(outcomes):]]
                break
            if needs_gpu and not _has_cuda():
                outcomes.append(Outcome(title, "NEEDS GPU", "this task runs on CUDA; no GPU here"))
                continue
            if link is None or link.lost is not None:
                if link is not None:
                    link.close()
                link = Link(target, source, time_limit, memory_limit, OUTPUT_LIMIT)
            outcomes.append(_run_linked(link, fn, title, target))
    finally:
        if link is not None:
            link.close()
    return outcomes


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# import names of pyproject.toml's dependencies: the attempt's process imports torch before the attempt, and the
# checkers import numpy, so "No module named 'torch'" there means this Python lacks the project's packages
PROJECT_PACKAGES = frozenset({"torch", "numpy", "matplotlib", "seaborn", "gymnasium", "tqdm", "fastapi", "uvicorn",
                              "jsonschema"})


def missing_package(text: str) -> str | None:
    """The project's package that `text` (a ModuleNotFoundError's message, or what the attempt's process printed
    as it died) says cannot be imported; None if it names none of them."""
    found = re.search(r"No module named '([\w.]+)'", text)
    name = found.group(1).split(".")[0] if found else ""
    return name if name in PROJECT_PACKAGES else None


def setup_message(package: str) -> str:
    """What a FAIL or an error says when this interpreter lacks the project's packages: a set-up mistake, not the
    attempt's."""
    return (f"not the attempt's fault: this Python ({sys.executable}) cannot import {package}, one of the project's "
            "packages. Activate the project's environment (source .venv/bin/activate, after make setup) or use "
            "make check, then check again")


def _run_linked(link: Any, fn: Callable, title: str, target: Path) -> Outcome:
    """One task, its `ex` the child's attempt; a child that cannot answer any more FAILs the task."""
    from mlsys.attempt.link import Lost

    try:
        link.start_task()
    except Lost as lost:
        package = missing_package(lost.detail)
        return Outcome(title, "FAIL", setup_message(package) if package else lost.detail)
    if link.load_error:
        package = missing_package(link.load_error)
        return Outcome(title, "FAIL", setup_message(package) if package
                       else "cannot import the attempt: " + link.load_error)
    outcome = _run_task(fn, title, link.module, target)
    try:
        link.end_task()
    except Lost:
        pass  # the task's outcome stands; the next task starts a fresh child
    return outcome


def call_many(fn: Callable, calls: list[tuple]) -> list:
    """[fn(*args) for args in calls]: for a check that calls the attempt's function thousands of times, one request
    to the attempt's process instead of one per call. A generator passed in several calls is one generator there,
    advancing through them in order as in one process (and this process's advances to where it stopped); the
    results come back as plain data, without autograd graphs."""
    from mlsys.attempt.link import RemoteRef

    if isinstance(fn, RemoteRef):
        return fn._link.map(fn, calls)
    return [fn(*args) for args in calls]


def source_of(obj: Any) -> str:
    """inspect.getsource for a checker: the attempt's module (`ex`) or one of its functions or classes (`ex.f`),
    read from the file as it was before the attempt ran; an object of this process (a reference), by inspect."""
    import inspect

    from mlsys.attempt.link import RemoteRef

    if isinstance(obj, RemoteRef):
        return obj._link.source(obj)
    return inspect.getsource(obj)


def task_functions(checker: Path) -> list[list[str]]:
    """For each task of a checker, in order, the attempt's functions it calls (`ex.<name>` in its body, or a name
    passed to run_ranks), in order of first use: what a FAIL is about, and which hints to point at."""
    import ast

    found = []
    for node in ast.parse(checker.read_text(encoding="utf-8")).body:
        if not any(isinstance(d, ast.Call) and getattr(d.func, "id", "") == "task"
                   for d in getattr(node, "decorator_list", [])):
            continue
        arg = node.args.args[0].arg if node.args.args else ""
        uses = []
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == arg:
                uses.append((n.lineno, n.col_offset, n.attr))
            elif (isinstance(n, ast.Call) and getattr(n.func, "id", "") == "run_ranks" and len(n.args) > 1
                  and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)):
                uses.append((n.lineno, n.col_offset, n.args[1].value))
        found.append(list(dict.fromkeys(name for *_, name in sorted(uses) if not name.startswith("_"))))
    return found


def _task_titles(checker: Path) -> tuple[list[str], list[bool]]:
    """The checker's tasks, read without importing it: @task("title", gpu=...) decorators, in file order."""
    import ast

    titles, gpu = [], []
    for node in ast.parse(checker.read_text(encoding="utf-8")).body:
        for dec in getattr(node, "decorator_list", []):
            if isinstance(dec, ast.Call) and getattr(dec.func, "id", "") == "task" and dec.args:
                titles.append(ast.literal_eval(dec.args[0]))
                gpu.append(any(k.arg == "gpu" and ast.literal_eval(k.value) for k in dec.keywords))
    return titles, gpu


def _one_line(err: BaseException, target: str) -> str:
    info = getattr(err, "attempt_info", None)  # raised by the attempt in its process: its type, text and line
    if info is not None:
        return f"{info['type']}: {info['message']}".splitlines()[0][:300] + info["where"]
    if isinstance(err, SyntaxError):
        return f"SyntaxError: {err.msg} (line {err.lineno} of {Path(target).name})"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == target]
    where = f" (line {frames[-1].lineno} of {Path(target).name})" if frames else ""
    return f"{type(err).__name__}: {err}{where}".splitlines()[0][:300]


def _run_task(fn: Callable, title: str, attempt: Any, target: Path) -> Outcome:
    """Run one task of the checker (here, in the checker's process) and turn how it ended into an Outcome."""
    from mlsys.attempt.link import Lost
    from mlsys.attempt.wire import AttemptExit

    try:
        fn(attempt)
    except Lost as lost:  # the attempt's process hung, died or broke the protocol
        return Outcome(title, "FAIL", lost.detail)
    except AttemptExit as err:  # sys.exit, KeyboardInterrupt... raised by the attempt
        return Outcome(title, "FAIL", str(err))
    except NotImplementedError as err:
        return Outcome(title, "TODO", str(err) or "not implemented yet")
    except AssertionError as err:
        return Outcome(title, "FAIL", (str(err) or "assertion failed")[:500])
    except MemoryError:
        return Outcome(title, "FAIL", "the attempt ran out of the memory a task may use (an endless append or a "
                                      "tensor far larger than the task needs?)")
    except Exception as err:
        if "NotImplementedError" in str(err):
            return Outcome(title, "TODO", "not implemented yet (raised on a rank)")
        if isinstance(err, OSError) and err.errno == 27:  # EFBIG: the output cap
            return Outcome(title, "FAIL", f"the attempt printed more than {OUTPUT_LIMIT} bytes")
        return Outcome(title, "FAIL", _one_line(err, str(target)))
    return Outcome(title, "PASS")


# ----------------------------------------------------------------------------------------------- distributed tasks
def run_ranks(module: ModuleType, fn_name: str, per_rank_args: list[tuple], backend: str = "gloo",
              timeout: float = 60.0) -> list[Any]:
    """Call `module.fn_name(*per_rank_args[r])` on rank r of a real job; return every rank's result, in rank order.

    Raises the failing rank's report (as RuntimeError) if the attempt crashes or hangs past `timeout`.
    """
    from mlsys.attempt.link import RemoteRef

    if isinstance(module, RemoteRef):  # a checker's task: the ranks start in the attempt's process, results come back
        return module._link.ranks(fn_name, per_rank_args, backend, timeout)
    return loader.run_ranks_here(module, fn_name, per_rank_args, backend, timeout)


def tagged_hints(exercise: Exercise) -> list[tuple[set[str], str]]:
    """(functions, text) of every hint, in order. A hint whose first line is `for: name[, name]` is about those
    functions of the attempt (the checker points a FAIL of a task checking `name` at them); an untagged hint
    is about the whole exercise."""
    file = exercise.checker.parent / "hints" / f"ex{exercise.exercise_id.split('.')[1]}.md"
    if not file.is_file():
        return []
    found = []
    for h in file.read_text(encoding="utf-8").split("\n---\n"):
        first, _, rest = h.strip().partition("\n")
        if first.startswith("for:"):
            found.append(({n.strip() for n in first[4:].split(",") if n.strip()}, rest.strip()))
        elif h.strip():
            found.append((set(), h.strip()))
    return [(tags, text) for tags, text in found if text]


def _hint_pointer(exercise: Exercise, functions: list[str]) -> str:
    """The line under a FAIL naming the hint to read: the hints written for the function this task checks."""
    for name in functions:
        if any(name in tags for tags, _ in tagged_hints(exercise)):
            return f"            hint: make hint EX={exercise.exercise_id} FOR={name}"
    if tagged_hints(exercise):
        return f"            hint: make hint EX={exercise.exercise_id}"
    return "            (no hints for this exercise: its stub's docstring names the lesson section to reread)"


# ----------------------------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlsys.exercises", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exercise", help="an id such as ch01.1, or 'all'")
    parser.add_argument("--solution", action="store_true", help="check the reference solution instead")
    parser.add_argument("--file", type=Path, help="check this file instead of the exercise's stub")
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                        help=f"seconds one task may run before it fails (default {DEFAULT_TIME_LIMIT:g})")
    args = parser.parse_args(argv)
    if not args.time_limit > 0:
        parser.error("--time-limit must be positive")
    try:
        chosen = all_exercises() if args.exercise == "all" else [find(args.exercise)]
    except LookupError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    failed, stuck = 0, None  # stuck: the first exercise with a task still TODO, whose hints the last line names
    for exercise in chosen:
        which = "reference solution" if args.solution else "your attempt"
        target = (args.file or (exercise.solution if args.solution else exercise.attempt)).resolve()
        shown = target.relative_to(REPO_ROOT) if target.is_relative_to(REPO_ROOT) else target
        print(f"{exercise.exercise_id}: checking {which}, {shown}")
        about = task_functions(exercise.checker)
        try:
            outcomes = check(exercise, args.solution, target, args.time_limit)
        except ModuleNotFoundError as err:  # the checker itself imports numpy or torch
            if missing_package(str(err)) is None:
                raise
            print(f"error: {setup_message(missing_package(str(err)))}", file=sys.stderr)
            return 2
        for i, outcome in enumerate(outcomes):
            detail = f"\n            {outcome.detail}" if outcome.detail else ""
            print(f"  {outcome.status:<9} {outcome.task}{detail}")
            failed += outcome.status in ("FAIL", "TODO")
            if outcome.status == "TODO" and stuck is None and not args.solution and tagged_hints(exercise):
                stuck = exercise.exercise_id
            if outcome.status == "FAIL" and not args.solution and not outcome.detail.startswith("not the attempt"):
                print(_hint_pointer(exercise, about[i] if i < len(about) else []))
    print("all tasks pass" if not failed else f"{failed} task(s) to go")
    if stuck:  # a TODO carries no hint line of its own, unlike a FAIL
        print(f"stuck? make hint EX={stuck}")
    return 1 if failed else 0


if __name__ == "__main__":
    from mlsys import exercises  # the module by its real name (the attempt's process imports it by that name)

    sys.exit(exercises.main())
