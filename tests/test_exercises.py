"""Every exercise checker, against its reference solution (must pass) and its untouched stub (must not)."""

from __future__ import annotations

import json
import re

import pytest

from mlsys import exercises

EXERCISES = exercises.all_exercises()


def test_exercises_exist() -> None:
    assert EXERCISES, "no exercises found"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.exercise_id)
def test_reference_solution_passes(exercise: exercises.Exercise) -> None:
    assert exercise.solution.exists(), f"{exercise.exercise_id} has no reference solution"
    outcomes = exercises.check(exercise, solution=True)
    assert outcomes, "the checker defines no @task"
    bad = [o for o in outcomes if o.status not in ("PASS", "NEEDS GPU")]
    assert not bad, bad


@pytest.mark.timeout(300)
@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.exercise_id)
def test_untouched_stub_is_reported_as_todo(exercise: exercises.Exercise) -> None:
    outcomes = exercises.check(exercise, solution=False)
    assert all(o.status in ("TODO", "NEEDS GPU") for o in outcomes), outcomes


@pytest.mark.timeout(120)
def test_command_line_exit_codes(capsys) -> None:
    assert exercises.main(["ch01.1", "--solution"]) == 0
    assert "PASS      shard_bounds" in capsys.readouterr().out
    assert exercises.main(["ch01.1"]) == 1
    assert exercises.main(["ch99.9"]) == 2


@pytest.mark.timeout(120)
def test_a_wrong_attempt_fails_with_a_useful_message(tmp_path) -> None:
    """Checkers must catch wrong answers, not only missing ones: ceil-sized shards are a classic mistake."""
    wrong = tmp_path / "ex1_rank_arithmetic.py"
    wrong.write_text(
        "import math\n"
        "def shard_bounds(n, rank, w):\n"
        "    size = math.ceil(n / w)\n"
        "    return min(rank * size, n), min((rank + 1) * size, n)\n"
        "def node_and_local_rank(rank, nproc):\n"
        "    return divmod(rank, nproc)\n")
    outcomes = exercises.check(exercises.find("ch01.1"), target=wrong)
    assert [o.status for o in outcomes] == ["FAIL", "PASS"]
    assert "expected" in outcomes[0].detail


@pytest.mark.timeout(120)
def test_a_crashing_distributed_attempt_fails_instead_of_hanging(tmp_path) -> None:
    wrong = tmp_path / "ex2_first_collectives.py"
    wrong.write_text(
        "import torch.distributed as dist\n"
        "def global_mean(local):\n"
        "    if dist.get_rank() == 1:\n"
        "        raise ValueError('rank 1 gives up')\n"
        "    dist.all_reduce(local)\n"
        "    return local.mean()\n"
        "def argmax_rank(value):\n"
        "    return 0\n")
    outcomes = exercises.check(exercises.find("ch01.2"), target=wrong)
    assert outcomes[0].status == "FAIL" and "rank 1 gives up" in outcomes[0].detail
    assert outcomes[1].status == "FAIL"  # always answering 0 is wrong for [0.5, 2.0, -1.0]


# ----------------------------------------------------------------------------------------------- hostile attempts
GOOD_SECOND = "def node_and_local_rank(rank, nproc):\n    return divmod(rank, nproc)\n"
HOSTILE = {  # first function of ch01.1 misbehaving -> (status of each task, words in the first task's detail)
    "hangs": ("def shard_bounds(n, r, w):\n    while True:\n        pass\n" + GOOD_SECOND,
              ["FAIL", "PASS"], "no result after"),
    "sys.exit(0)": ("import sys\ndef shard_bounds(n, r, w):\n    sys.exit(0)\n" + GOOD_SECOND,
                    ["FAIL", "PASS"], "sys.exit(0)"),
    "os._exit(0)": ("import os\ndef shard_bounds(n, r, w):\n    os._exit(0)\n" + GOOD_SECOND,
                    ["FAIL", "PASS"], "exit code 0"),
    "SIGKILL": ("import os, signal\ndef shard_bounds(n, r, w):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                + GOOD_SECOND, ["FAIL", "PASS"], "SIGKILL"),
    "syntax error": ("def shard_bounds(n, r, w)\n    return 0, n\n" + GOOD_SECOND,
                     ["FAIL", "FAIL"], "SyntaxError"),
    "raises at import": ("x = 1\nraise RuntimeError('at import')\n" + GOOD_SECOND,
                         ["FAIL", "FAIL"], "RuntimeError: at import (line 2"),
    "sys.exit at import": ("import sys\nsys.exit(0)\n" + GOOD_SECOND, ["FAIL", "FAIL"], "SystemExit"),
    "prints a flood": ("def shard_bounds(n, r, w):\n    while True:\n        print('x' * 65536)\n" + GOOD_SECOND,
                       ["FAIL", "PASS"], "printed more than"),
    "fakes a pass": ("import mlsys.exercises as e\n"
                     "e._run_task = lambda fn, title, *a: e.Outcome(title, 'PASS')\n"
                     "def shard_bounds(n, r, w):\n    return 0, 0\n" + GOOD_SECOND, ["FAIL", "PASS"], "expected"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", HOSTILE)
def test_the_checker_survives_a_hostile_attempt(name, tmp_path) -> None:
    """Whatever the attempt does, the task it was in FAILs with one line, the next task still runs, and the
    command line exits 1: hangs (killed at the time limit), interpreter exits, signals, import errors, floods."""
    source, statuses, words = HOSTILE[name]
    attempt = tmp_path / "ex1_rank_arithmetic.py"
    attempt.write_text(source)
    outcomes = exercises.check(exercises.find("ch01.1"), target=attempt, time_limit=3)
    assert [o.status for o in outcomes] == statuses, outcomes
    assert words in outcomes[0].detail and "\n" not in outcomes[0].detail, outcomes[0].detail


@pytest.mark.timeout(120)
def test_a_hanging_distributed_attempt_is_stopped_with_all_its_ranks(tmp_path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    attempt = tmp_path / "ex2_first_collectives.py"
    attempt.write_text(
        "import os, torch, torch.distributed as dist\n"
        f"PIDS = {str(pids)!r}\n"
        "def global_mean(local):\n"
        "    if dist.get_world_size() == 1:\n"
        "        return local.mean()\n"
        "    open(os.path.join(PIDS, str(os.getpid())), 'w').close()\n"
        "    dist.recv(torch.empty(1), src=(dist.get_rank() + 1) % dist.get_world_size())  # nobody sends\n"
        "def argmax_rank(value):\n"
        "    return 0\n")
    outcomes = exercises.check(exercises.find("ch01.2"), target=attempt, time_limit=5)
    assert outcomes[0].status == "FAIL" and "no result after 5 s" in outcomes[0].detail, outcomes
    started = [int(p.name) for p in pids.iterdir()]
    assert started  # the ranks did run
    import os
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in started):
        time.sleep(0.1)
    assert not any(_alive(p) for p in started), "a rank outlived the checker's time limit"
    assert exercises.main(["ch01.2", "--file", str(attempt), "--time-limit", "5"]) == 1
    del os


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, only not yet reaped
        return f.read().split(") ")[-1][0] != "Z"


# ----------------------------------------------------------------------------------------------- wrong attempts
WRONG = sorted(exercises.TUTORIAL.glob("part*/chapter*/exercises/wrong/ex*.py"))


def _exercise_of(wrong) -> exercises.Exercise:
    chapter = int(wrong.parent.parent.parent.name[len("chapter"):].split("-")[0])
    number = int(wrong.name[2:].split("_")[0])
    return exercises.find(f"ch{chapter:02d}.{number}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wrong", WRONG, ids=lambda p: f"{p.parents[2].name[:9]}/{p.stem}")
def test_a_stored_wrong_attempt_fails(wrong) -> None:
    """exercises/wrong/ex<K>_<mistake>.py holds a plausible mistake (off by one, wrong reduction, forgot to divide
    by the world size...): the checker must FAIL it, with no task before the failure left TODO (a wrong attempt is
    a whole attempt). The tasks after the first FAIL are not run: the suite only needs to know that it fails."""
    outcomes = exercises.check(_exercise_of(wrong), target=wrong, time_limit=60, stop_at_fail=True)
    statuses = [o.status for o in outcomes]
    assert "FAIL" in statuses and "TODO" not in statuses, outcomes


def test_every_exercise_is_listed_in_its_lesson() -> None:
    """A reader finds the exercises in the lesson: each id appears in its chapter's README with its check command."""
    for e in EXERCISES:
        lesson = (e.checker.parent.parent / "README.md").read_text(encoding="utf-8")
        listed = re.search(rf"\*\*{re.escape(e.exercise_id)} ", lesson)
        checked = re.search(rf"make check EX={re.escape(e.exercise_id)}(?!\d)", lesson)
        assert listed and checked, (
            f"{e.exercise_id} ({e.attempt.name}) is not listed in the Exercises section of its lesson")


def test_hint_files_belong_to_exercises() -> None:
    known = {(e.checker.parent, e.exercise_id.split(".")[1]) for e in EXERCISES}
    for hint in exercises.TUTORIAL.glob("part*/chapter*/exercises/hints/ex*.md"):
        assert (hint.parent.parent, hint.stem[2:]) in known, f"{hint} names no exercise"


def test_progress_and_hints(tmp_path, monkeypatch, capsys) -> None:
    from mlsys import workshop

    monkeypatch.setattr(workshop, "STATE", tmp_path)
    one = [exercises.find("ch01.1")]
    monkeypatch.setattr(exercises, "all_exercises", lambda: one)
    assert workshop.main(["progress", "--solution"]) == 0
    assert "ch01.1  PASS      2/2 tasks" in capsys.readouterr().out
    cached = json.loads((tmp_path / "progress.json").read_text())
    monkeypatch.setattr(exercises, "check", lambda *a, **k: pytest.fail("an unchanged attempt was run again"))
    assert workshop.main(["progress", "--solution"]) == 0 and len(cached) == 1
    hints = workshop.hints_of(one[0])
    assert len(hints) >= 2
    for i in range(1, len(hints) + 2):  # one more call than hints: it stays on the last
        assert workshop.main(["hint", "ch01.1"]) == 0
        assert f"hint {min(i, len(hints))} of {len(hints)}" in capsys.readouterr().out
    assert workshop.main(["hint", "ch99.9"]) == 2


def test_a_fail_names_the_hint_about_the_function_it_checked(tmp_path, monkeypatch, capsys) -> None:
    """ch13.1's wrong k3 (sign flipped) fails only the k3 task, beside a correct k1 and shaping, and the line
    under the FAIL points at the hints about kl_k3; those hints say nothing about shape_rewards."""
    from mlsys import workshop

    ex = exercises.find("ch13.1")
    wrong = ex.checker.parent / "wrong" / "ex1_k3_sign.py"
    assert exercises.main(["ch13.1", "--file", str(wrong)]) == 1
    out = capsys.readouterr().out
    failed = [line.split(None, 1)[1] for line in out.splitlines() if line.startswith("  FAIL")]
    assert len(failed) == 1 and failed[0].startswith("kl_k3"), out
    assert out.count("  PASS") == 2 and "hint: make hint EX=ch13.1 FOR=kl_k3" in out, out
    monkeypatch.setattr(workshop, "STATE", tmp_path)
    about_k3 = workshop.hints_of(ex, "kl_k3")
    assert about_k3 and all("shape_rewards" not in h for h in about_k3)
    assert len(about_k3) < len(workshop.hints_of(ex))
    assert workshop.main(["hint", "ch13.1", "--for", "kl_k3"]) == 0
    assert "hint 1 of" in capsys.readouterr().out
    assert workshop.main(["hint", "ch13.1", "--for", "no_such_function"]) == 2


def test_task_functions_reads_what_each_task_calls() -> None:
    checker = exercises.find("ch13.1").checker
    assert exercises.task_functions(checker) == [["kl_k1"], ["kl_k3"], ["shape_rewards"]]
