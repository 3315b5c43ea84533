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
"""

from __future__ import annotations

import argparse
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


@dataclass
class Exercise:
    exercise_id: str  # "ch01.1"
    attempt: Path
    solution: Path
    checker: Path


@dataclass
class Outcome:
    task: str
    status: str  # "PASS", "FAIL", "TODO" or "NEEDS GPU"
    detail: str = ""


def task(title: str, *, gpu: bool = False) -> Callable[[Callable], Callable]:
    """Mark a checker function as one task of an exercise."""

    def mark(fn: Callable) -> Callable:
        fn.__task__ = {"title": title, "gpu": gpu}  # type: ignore[attr-defined]
        return fn

    return mark


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


def check(exercise: Exercise, solution: bool = False, target: Path | None = None) -> list[Outcome]:
    """Run every task of the exercise's checker against the attempt, the reference solution, or `target`."""
    import torch

    target = target or (exercise.solution if solution else exercise.attempt)
    attempt = load_module(target)
    checker = load_module(exercise.checker)
    tasks = [fn for fn in vars(checker).values() if callable(fn) and hasattr(fn, "__task__")]
    outcomes = []
    for fn in tasks:
        title = fn.__task__["title"]
        if fn.__task__["gpu"] and not torch.cuda.is_available():
            outcomes.append(Outcome(title, "NEEDS GPU", "this task runs on CUDA; no GPU here"))
            continue
        outcomes.append(_run_task(fn, title, attempt, target))
    return outcomes


def _run_task(fn: Callable, title: str, attempt: ModuleType, target: Path) -> Outcome:
    try:
        fn(attempt)
    except NotImplementedError as err:
        return Outcome(title, "TODO", str(err) or "not implemented yet")
    except AssertionError as err:
        return Outcome(title, "FAIL", str(err) or "assertion failed")
    except Exception as err:
        if "NotImplementedError" in str(err):
            return Outcome(title, "TODO", "not implemented yet (raised on a rank)")
        frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == str(target)]
        where = f" (line {frames[-1].lineno} of {target.name})" if frames else ""
        return Outcome(title, "FAIL", f"{type(err).__name__}: {err}{where}".splitlines()[0])
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


# ----------------------------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlsys.exercises", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exercise", help="an id such as ch01.1, or 'all'")
    parser.add_argument("--solution", action="store_true", help="check the reference solution instead")
    parser.add_argument("--file", type=Path, help="check this file instead of the exercise's stub")
    args = parser.parse_args(argv)
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
        for outcome in check(exercise, args.solution, target):
            detail = f"\n            {outcome.detail}" if outcome.detail else ""
            print(f"  {outcome.status:<9} {outcome.task}{detail}")
            failed += outcome.status in ("FAIL", "TODO")
    print("all tasks pass" if not failed else f"{failed} task(s) to go")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
