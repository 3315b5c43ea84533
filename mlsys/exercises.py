"""Workshop exercises: check a learner's attempt, one readable pass/fail line per task.

    make check EX=ch01.1              # checks tutorial/.../chapter01-*/exercises/ex1_*.py (your attempt)
    make check EX=ch01.1 SOLUTION=1   # the same checks against exercises/solutions/ex1_*.py
    python -m mlsys.exercises all --solution
    python -m mlsys.exercises ch01.2 --file ~/my_attempt.py   # an attempt kept somewhere else

Layout of a chapter's exercises/ folder:
    ex<K>_<name>.py             the stub you edit: real signatures, bodies that raise NotImplementedError("TODO ...")
    solutions/ex<K>_<name>.py   the reference solution
    check_ex<K>.py              the checker: functions decorated with @task, run in the order they are defined;
                                each gets the loaded attempt module and raises AssertionError to fail.

Distributed tasks run the attempt on real ranks with `run_ranks`; tasks marked `@task(..., gpu=True)` report
"needs a GPU" on machines without CUDA instead of failing.

The attempt runs in a child process, never in the checker's: an attempt that loops forever is stopped after
`--time-limit` seconds per task (its ranks with it), one that calls sys.exit or os._exit, kills itself, floods
the output or does not import is a FAIL with one line, and the next task still runs. The only way to PASS is to
pass the checks (the child binds the task runner before it imports the attempt). This guards against mistakes,
not against a determined adversary: the attempt is ordinary Python running with your permissions.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

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


def load_module(path: Path, name: str | None = None) -> ModuleType:
    """Import a file by path (chapter folders are not packages); registered in sys.modules under a unique name."""
    path = path.resolve()
    shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    name = name or "_ex_" + re.sub(r"\W", "_", str(shown).removesuffix(".py"))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


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

    The attempt never runs in this process: a child process (forked from a server that has torch imported, so it
    starts in milliseconds) loads it and runs the tasks in order, reporting each outcome through a pipe. Whatever
    the attempt does, the task it was in is a FAIL with one line: it hangs past `time_limit` seconds (the child's
    whole process group, distributed ranks included, is killed), it ends the interpreter (sys.exit, os._exit, a
    signal), it cannot be imported (a syntax error, an exception at import), or it prints more than
    OUTPUT_LIMIT bytes. After a child dies, a fresh one goes on with the next task. With `stop_at_fail`, the tasks
    after the first FAIL are not run (status "SKIPPED"): enough to know that an attempt fails.
    """
    target = (target or (exercise.solution if solution else exercise.attempt)).resolve()
    titles, gpu = _task_titles(exercise.checker)
    outcomes: list[Outcome] = []
    while len(outcomes) < len(titles):
        if stop_at_fail and any(o.status == "FAIL" for o in outcomes):
            outcomes += [Outcome(title, "SKIPPED", "not run: an earlier task failed") for title in
                         titles[len(outcomes):]]
            break
        outcomes += _run_child(exercise.checker, target, len(outcomes), titles, time_limit, stop_at_fail,
                               memory_limit)
    return [Outcome(o.task, "NEEDS GPU", "this task runs on CUDA; no GPU here") if g and o.status == "GPU" else o
            for o, g in zip(outcomes, gpu)]


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


_CONTEXT: Any = None


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        import multiprocessing as mp

        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed"])
    return _CONTEXT


def _run_child(checker: Path, target: Path, first: int, titles: list[str], time_limit: float,
               stop_at_fail: bool = False, memory_limit: int = MEMORY_LIMIT) -> list[Outcome]:
    """Run tasks first.. in one child; stop at the first task the child does not survive (or overruns), or with
    `stop_at_fail` at the first FAIL."""
    import tempfile
    import time

    ctx = _context()
    ours, theirs = ctx.Pipe(duplex=False)
    with tempfile.NamedTemporaryFile(prefix="mlsys-attempt-", suffix=".log") as output:
        child = ctx.Process(target=_child_main, args=(str(checker), str(target), first, theirs, output.name,
                                                       memory_limit))
        child.start()
        theirs.close()
        outcomes: list[Outcome] = []
        deadline = time.monotonic() + time_limit
        current = first
        try:
            while current < len(titles):
                if ours.poll(max(0.0, min(0.2, deadline - time.monotonic()))):
                    try:
                        kind, *rest = ours.recv()
                    except (EOFError, OSError):
                        kind, rest = "died", []
                    if kind == "start":
                        current, deadline = rest[0], time.monotonic() + time_limit
                        continue
                    if kind == "outcome":
                        outcomes.append(Outcome(*rest))
                        current += 1
                        if stop_at_fail and outcomes[-1].status == "FAIL":
                            break  # the finally below stops the child
                        continue
                if not child.is_alive() or time.monotonic() > deadline:
                    timed_out = child.is_alive()
                    _kill_group(child)
                    tail = _tail(output)
                    why = (f"no result after {time_limit:g} s (an endless loop, or ranks waiting for each other?); "
                           "the attempt's processes were stopped" if timed_out else _how_it_died(child.exitcode))
                    outcomes.append(Outcome(titles[current], "FAIL", why + (f"; it printed: {tail}" if tail else "")))
                    break
        finally:
            if child.is_alive():
                _kill_group(child)
            child.join(5)
            ours.close()
    return outcomes


def _kill_group(child: Any) -> None:
    """SIGKILL the child's whole process group: the child and anything it started (ranks, a fork server)."""
    import os
    import signal

    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # killed before it made its group: kill the process itself
        child.kill()
    child.join(5)


def _how_it_died(exitcode: int | None) -> str:
    import signal

    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"the attempt killed the checker's process ({name})"
    return f"the attempt ended the checker's process (exit code {exitcode}, e.g. sys.exit or os._exit)"


def _tail(output: Any, limit: int = 300) -> str:
    """The last line the attempt printed, shortened: enough to recognise, never a flood."""
    import os

    try:
        size = os.fstat(output.fileno()).st_size
        output.seek(max(0, size - 4096))
        lines = output.read().decode("utf-8", "replace").strip().splitlines()
    except OSError:
        return ""
    return (lines[-1][:limit] + ("..." if len(lines[-1]) > limit else "")) if lines else ""


def _child_main(checker: str, target: str, first: int, conn: Any, output_path: str,
                memory_limit: int = MEMORY_LIMIT) -> None:
    """In the child: own process group, capped output, load checker and attempt, run tasks first.., report each."""
    import os
    import resource
    import signal

    os.setsid()  # a group of our own: the parent can kill us and everything we start in one call
    output_fd = os.open(output_path, os.O_WRONLY | os.O_APPEND)
    for fd in (1, 2):
        os.dup2(output_fd, fd)  # the attempt's prints go to a file the parent reads the end of
    os.close(output_fd)
    run_task, send = _run_task, conn.send  # bound before the attempt is imported: it cannot swap them
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the cap a write fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (OUTPUT_LIMIT, OUTPUT_LIMIT))
    # memory: an attempt that grows without end gets MemoryError (its task FAILs) long before the machine's RAM
    # runs out; the cap is on data added beyond what this process (torch imported) already holds
    held = next((int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmData")), 0)
    resource.setrlimit(resource.RLIMIT_DATA, (held + memory_limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    import torch

    titles, gpu = _task_titles(Path(checker))
    try:
        checker_module = load_module(Path(checker))
        tasks = [fn for fn in vars(checker_module).values() if callable(fn) and hasattr(fn, "__task__")]
        attempt = load_module(Path(target))
        load_error = None
    except BaseException as err:  # a syntax error, an exception or sys.exit at import: every task fails with it
        load_error, tasks = err, []
    for i in range(first, len(titles)):
        send(("start", i))
        if load_error is not None:
            send(("outcome", titles[i], "FAIL", "cannot import the attempt: " + _one_line(load_error, target)))
            continue
        if gpu[i] and not torch.cuda.is_available():
            send(("outcome", titles[i], "GPU", ""))
            continue
        outcome = run_task(tasks[i], titles[i], attempt, Path(target))
        send(("outcome", outcome.task, outcome.status, outcome.detail))
    sys.stdout.flush()
    conn.close()


def _one_line(err: BaseException, target: str) -> str:
    if isinstance(err, SyntaxError):
        return f"SyntaxError: {err.msg} (line {err.lineno} of {Path(target).name})"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == target]
    where = f" (line {frames[-1].lineno} of {Path(target).name})" if frames else ""
    return f"{type(err).__name__}: {err}{where}".splitlines()[0][:300]


def _run_task(fn: Callable, title: str, attempt: ModuleType, target: Path) -> Outcome:
    try:
        fn(attempt)
    except NotImplementedError as err:
        return Outcome(title, "TODO", str(err) or "not implemented yet")
    except AssertionError as err:
        return Outcome(title, "FAIL", (str(err) or "assertion failed")[:500])
    except SystemExit as err:
        return Outcome(title, "FAIL", f"the attempt called sys.exit({err.code!r}); a check cannot pass that way")
    except MemoryError:
        return Outcome(title, "FAIL", "the attempt ran out of the memory a task may use (an endless append or a "
                                      "tensor far larger than the task needs?)")
    except Exception as err:
        if "NotImplementedError" in str(err):
            return Outcome(title, "TODO", "not implemented yet (raised on a rank)")
        if isinstance(err, OSError) and err.errno == 27:  # EFBIG: the output cap
            return Outcome(title, "FAIL", f"the attempt printed more than {OUTPUT_LIMIT} bytes")
        return Outcome(title, "FAIL", _one_line(err, str(target)))
    except BaseException as err:  # KeyboardInterrupt raised by the attempt, GeneratorExit...
        return Outcome(title, "FAIL", f"{type(err).__name__} raised by the attempt")
    return Outcome(title, "PASS")


# ----------------------------------------------------------------------------------------------- distributed tasks
def _call_on_rank(ctx: Any, path: str, fn_name: str, per_rank_args: list[tuple]) -> list[Any]:
    """Worker: load the attempt in this rank, call fn(*args for this rank), gather every rank's result."""
    import torch.distributed as dist

    fn = getattr(load_module(Path(path)), fn_name)
    result = fn(*per_rank_args[ctx.rank])
    results: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(results, result.tolist() if hasattr(result, "tolist") else result)
    return results


def run_ranks(module: ModuleType, fn_name: str, per_rank_args: list[tuple], backend: str = "gloo",
              timeout: float = 60.0) -> list[Any]:
    """Call `module.fn_name(*per_rank_args[r])` on rank r of a real job; return every rank's result, in rank order.

    Raises the failing rank's report (as RuntimeError) if the attempt crashes or hangs past `timeout`.
    """
    from mlsys.launch import JobFailed, launch

    try:
        return launch(_call_on_rank, module.__file__, fn_name, per_rank_args, world_size=len(per_rank_args),
                      backend=backend, timeout=timeout)
    except JobFailed as err:
        last = str(err).strip().splitlines()
        raise RuntimeError(last[-2] if len(last) > 1 else last[0]) from None


def _hint_pointer(exercise: Exercise, functions: list[str]) -> str:
    """The line under a FAIL naming the hint to read: the hints written for the function this task checks."""
    from mlsys import workshop

    for name in functions:
        if any(name in tags for tags, _ in workshop.tagged_hints(exercise)):
            return f"            hint: make hint EX={exercise.exercise_id} FOR={name}"
    if workshop.tagged_hints(exercise):
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
    failed = 0
    for exercise in chosen:
        which = "reference solution" if args.solution else "your attempt"
        target = (args.file or (exercise.solution if args.solution else exercise.attempt)).resolve()
        shown = target.relative_to(REPO_ROOT) if target.is_relative_to(REPO_ROOT) else target
        print(f"{exercise.exercise_id}: checking {which}, {shown}")
        about = task_functions(exercise.checker)
        for i, outcome in enumerate(check(exercise, args.solution, target, args.time_limit)):
            detail = f"\n            {outcome.detail}" if outcome.detail else ""
            print(f"  {outcome.status:<9} {outcome.task}{detail}")
            failed += outcome.status in ("FAIL", "TODO")
            if outcome.status == "FAIL" and not args.solution:
                print(_hint_pointer(exercise, about[i] if i < len(about) else []))
    print("all tasks pass" if not failed else f"{failed} task(s) to go")
    return 1 if failed else 0


if __name__ == "__main__":
    from mlsys import exercises  # the module by its real name, so the checker's child can find _child_main

    sys.exit(exercises.main())
