"""Every exercise checker, against its reference solution (must pass) and its untouched stub (must not)."""

from __future__ import annotations

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
