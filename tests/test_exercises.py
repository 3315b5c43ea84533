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
def test_command_line_exit_codes(capsys) -> None:  # noqa: ANN001
    assert exercises.main(["ch01.1", "--solution"]) == 0
    assert "PASS      shard_bounds" in capsys.readouterr().out
    assert exercises.main(["ch01.1"]) == 1
    assert exercises.main(["ch99.9"]) == 2
