"""Every exercise checker, against its reference solution (must pass) and its untouched stub (must not)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

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
def test_an_untouched_stub_ends_by_naming_the_hints(capsys) -> None:
    """A TODO carries no hint line, so the checker's last line says where help is; a FAIL names its own, and a
    solution check needs none."""
    assert exercises.main(["ch01.1"]) == 1
    assert capsys.readouterr().out.splitlines()[-2:] == ["2 task(s) to go", "stuck? make hint EX=ch01.1"]
    wrong = exercises.find("ch01.1").checker.parent / "wrong" / "ex1_ceil_shards.py"
    assert exercises.main(["ch01.1", "--file", str(wrong)]) == 1
    assert "stuck?" not in capsys.readouterr().out
    assert exercises.main(["ch01.1", "--solution"]) == 0
    assert "stuck?" not in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_a_python_without_torch_is_blamed_not_the_attempt(tmp_path) -> None:
    """Run with a Python that lacks the project's packages (no `source .venv/bin/activate`), the attempt's process
    dies importing torch: the checker says to activate .venv, not that the attempt ended its process."""
    fake = tmp_path / "torch"  # first on the path: `import torch` fails as it does where torch is not installed
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(exercises.REPO_ROOT)])}
    run = subprocess.run([sys.executable, "-m", "mlsys.exercises", "ch01.1"], env=env, cwd=exercises.REPO_ROOT,
                         capture_output=True, text=True, timeout=100)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "ended the checker's process" not in run.stdout and "hint:" not in run.stdout, run.stdout
    assert run.stdout.count("not the attempt's fault") == 2, run.stdout
    assert "source .venv/bin/activate" in run.stdout
    assert exercises.missing_package("ModuleNotFoundError: No module named 'numpy.linalg'") == "numpy"
    assert exercises.missing_package("ModuleNotFoundError: No module named 'my_helpers'") is None


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
FORGE = (  # write bytes into every connection object of the attempt's process (found the way an attacker would)
    "import gc, json, os, pickle, socket, struct\n"
    "import multiprocessing.connection as mpc\n"
    "TITLE = 'shard_bounds gives every rank the same slice as numpy.array_split'\n"
    "def forge(data):\n"
    "    for o in gc.get_objects():\n"
    "        if isinstance(o, (mpc.Connection, socket.socket)):\n"
    "            try:\n"
    "                os.write(o.fileno(), data)\n"
    "            except (OSError, ValueError):\n"
    "                pass\n")
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
    "grows forever": ("def shard_bounds(n, r, w):\n    hoard = []\n    while True:\n"
                      "        hoard.append(bytearray(1 << 24))\n" + GOOD_SECOND,
                      ["FAIL", "PASS"], "ran out of the memory a task may use"),
    "fakes a pass": ("import mlsys.exercises as e\n"
                     "e._run_task = lambda fn, title, *a: e.Outcome(title, 'PASS')\n"
                     "def shard_bounds(n, r, w):\n    return 0, 0\n" + GOOD_SECOND, ["FAIL", "PASS"], "expected"),
    # the verdict is computed in the checker's process, which never imports the attempt: nothing below reaches it
    "rewrites the checker's code": (
        "import mlsys.exercises as e\n"
        "def passed(*args, **kwargs):\n"
        "    return Outcome(args[1], 'PASS')  # run with the globals of mlsys.exercises, where Outcome is defined\n"
        "for name in ('_run_task', '_run_linked', 'check', '_one_line'):\n"
        "    if hasattr(e, name):\n"
        "        getattr(e, name).__code__ = passed.__code__  # the function objects already bound see it too\n"
        "e._run_task = e.check = lambda *a, **k: e.Outcome(a[1], 'PASS')\n"
        "def shard_bounds(n, r, w):\n    return 0, 0\n" + GOOD_SECOND, ["FAIL", "PASS"], "expected"),
    "forges the old PASS record": (  # multiprocessing's framing and pickle, what the checker's pipe carried
        FORGE + "def shard_bounds(n, r, w):\n"
        "    record = pickle.dumps(('outcome', TITLE, 'PASS', ''))\n"
        "    forge(struct.pack('!i', len(record)) + record)\n"
        "    return 0, 0\n" + GOOD_SECOND, ["FAIL", "PASS"], "protocol"),
    "forges a PASS message": (  # the link's own framing, well formed, not asked for
        FORGE + "def shard_bounds(n, r, w):\n"
        "    message = json.dumps({'op': 'outcome', 'task': TITLE, 'status': 'PASS'}).encode()\n"
        "    forge(struct.pack('>Q', len(message)) + message)\n"
        "    return 0, 0\n" + GOOD_SECOND, ["FAIL", "PASS"], "protocol"),
    "returns what equals everything": (
        "class Anything:\n"
        "    def __eq__(self, other):\n        return True\n"
        "    def __ne__(self, other):\n        return False\n"
        "    __hash__ = object.__hash__\n"
        "    def __iter__(self):\n        return iter((self, self))\n"
        "class Zero(int):\n"
        "    def __eq__(self, other):\n        return True\n"
        "    __hash__ = int.__hash__\n"
        "def shard_bounds(n, r, w):\n    return Anything()\n"
        "def node_and_local_rank(rank, nproc):\n    return Zero(0), Zero(0)\n", ["FAIL", "FAIL"], "not plain data"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", HOSTILE)
def test_the_checker_survives_a_hostile_attempt(name, tmp_path) -> None:
    """Whatever the attempt does, the task it was in FAILs with one line, the next task still runs, and the
    command line exits 1: hangs (killed at the time limit), interpreter exits, signals, import errors, floods; and
    no PASS from cheating: rewriting the checker's code, forging messages, returning what equals everything."""
    source, statuses, words = HOSTILE[name]
    attempt = tmp_path / "ex1_rank_arithmetic.py"
    attempt.write_text(source)
    # a 512 MiB memory cap here (4 GiB by default): an endless append must fail long before the machine's RAM
    outcomes = exercises.check(exercises.find("ch01.1"), target=attempt, time_limit=3, memory_limit=512 << 20)
    assert [o.status for o in outcomes] == statuses, outcomes
    assert words in outcomes[0].detail and "\n" not in outcomes[0].detail, outcomes[0].detail


@pytest.mark.timeout(120)
def test_patching_torch_comparisons_does_not_pass(tmp_path) -> None:
    """An attempt that makes torch.allclose, torch.equal, numpy.allclose and math.isclose answer True (and returns
    zeros) FAILs: the comparisons run in the checker's process, which never ran the attempt's import."""
    attempt = tmp_path / "ex1_acceptance_rule.py"
    attempt.write_text(
        "import math, numpy, torch\n"
        "torch.allclose = torch.equal = numpy.allclose = math.isclose = lambda *a, **k: True\n"
        "torch.Tensor.__eq__ = lambda self, other: True\n"
        "def residual(p, q):\n    return torch.zeros_like(p)\n"
        "def verify_sampled(p, q, drafts, generator):\n    return 0, 0\n")
    outcomes = exercises.check(exercises.find("ch11.1"), target=attempt, stop_at_fail=True)
    assert [o.status for o in outcomes] == ["FAIL", "SKIPPED", "SKIPPED"], outcomes
    assert "want [0.6" in outcomes[0].detail, outcomes[0].detail


@pytest.mark.timeout(120)
def test_a_returned_loss_cut_from_its_inputs_fails_the_gradient_task(tmp_path) -> None:
    """loss.backward() in a task reaches the attempt's autograd graph in its process: the right value with no graph
    behind it passes the value tasks and FAILs the gradient task (the reference solution passes all of them)."""
    attempt = tmp_path / "ex2_clipped_loss.py"
    attempt.write_text(
        "import torch\n"
        "def clipped_loss(logp_new, logp_old, adv, eps):\n"
        "    ratio = (logp_new - logp_old).exp()\n"
        "    loss = -torch.min(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv).mean()\n"
        "    return torch.tensor(loss.item())  # the value alone\n"
        "def clip_fraction(logp_new, logp_old, eps):\n    raise NotImplementedError('TODO')\n"
        "def approx_kl(logp_new, logp_old):\n    raise NotImplementedError('TODO')\n")
    outcomes = exercises.check(exercises.find("ch12.2"), target=attempt)
    assert [o.status for o in outcomes] == ["PASS", "FAIL", "PASS", "TODO", "TODO"], outcomes
    assert "does not require grad" in outcomes[1].detail, outcomes[1].detail  # as in one process


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
def test_a_stored_wrong_attempt_fails_and_is_pointed_at_hints_about_its_bug(wrong) -> None:
    """exercises/wrong/ex<K>_<mistake>.py holds a plausible mistake (off by one, wrong reduction, forgot to divide
    by the world size...): the checker must FAIL it, with no task before the failure left TODO (a wrong attempt is
    a whole attempt). The tasks after the first FAIL are not run: the suite only needs to know that it fails.
    And the first FAIL names FOR=<a function that task checks>, and tagged hints about that function exist: the
    learner is sent to the hints about the function that failed, not to the whole list. (One checker run serves
    both: the checker runs the attempt's ranks, seconds each.)"""
    exercise = _exercise_of(wrong)
    outcomes = exercises.check(exercise, target=wrong, time_limit=60, stop_at_fail=True)
    statuses = [o.status for o in outcomes]
    assert "FAIL" in statuses and "TODO" not in statuses, outcomes
    first = statuses.index("FAIL")
    functions = exercises.task_functions(exercise.checker)[first]
    pointer = exercises._hint_pointer(exercise, functions)
    assert "FOR=" in pointer, pointer
    name = pointer.split("FOR=")[1]
    assert name in functions, (name, functions)
    assert any(name in tags for tags, _ in exercises.tagged_hints(exercise)), f"no hint is tagged 'for: {name}'"


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


def test_progress_cache_key_covers_the_library_the_checkers_use(tmp_path, monkeypatch) -> None:
    """A checker compares against mlsys (ch12.1 against mlsys.rl's GAE): changing a library file must change the
    cached verdict's key, or a stale PASS survives the change. The package is a copy in tmp_path, one file edited."""
    from mlsys import workshop

    pkg = tmp_path / "mlsys"
    (pkg / "attempt").mkdir(parents=True)
    for name in ("exercises.py", "rl.py", "attempt/link.py"):
        (pkg / name).write_text(f"# {name}\n")
    monkeypatch.setattr(exercises, "__file__", str(pkg / "exercises.py"))
    ex = exercises.find("ch12.1")
    before = workshop.digest(ex, ex.solution)
    assert workshop.digest(ex, ex.solution) == before  # nothing changed: the same key
    (pkg / "rl.py").write_text("# rl.py, a changed reference\n")
    assert workshop.digest(ex, ex.solution) != before


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


# ----------------------------------------------------------------------------------------------- one task, one function
def _written_by_learner(stub) -> set[str]:
    """The stub's top-level functions and classes that raise NotImplementedError: what the learner writes. The given
    wrappers the ranks call (run_and_count, probe, run_train...) are not: they only carry the learner's function."""
    import ast

    return {node.name for node in ast.parse(stub.read_text(encoding="utf-8")).body
            if isinstance(node, ast.FunctionDef | ast.ClassDef)
            and any(isinstance(n, ast.Raise) and "NotImplementedError" in ast.unparse(n) for n in ast.walk(node))}


SEVERAL_FUNCTIONS = {  # (exercise, task index): why that task calls more than one function the learner writes
    ("ch04.1", 3): "tree_broadcast runs on real ranks, which load the attempt's own tree_parent/tree_children (no "
                   "reference can be put in their place there): the task checks them on paper first and says "
                   "'fix tree_children first' rather than hanging on a wrong tree",
    ("ch14.1", 4): "sync_bucketed runs on real ranks with the attempt's own assign_buckets/pack/unpack: the task "
                   "checks those first and names the one to fix rather than reporting a wrong broadcast",
}


def test_every_task_checks_one_function() -> None:
    """A task calls exactly one function the learner writes (so a correct function is never FAIL beside a wrong one),
    that function comes first, and a FAIL of the task points at the hints about it."""
    for e in EXERCISES:
        mine = _written_by_learner(e.attempt)
        for i, functions in enumerate(exercises.task_functions(e.checker)):
            written = [f for f in functions if f in mine]
            where = f"{e.exercise_id} task {i + 1} ({e.checker.name})"
            if (e.exercise_id, i) in SEVERAL_FUNCTIONS:
                assert len(written) > 1, f"{where} calls {written} only: drop it from SEVERAL_FUNCTIONS"
            else:
                assert len(written) == 1, f"{where} checks {written or 'none'} of the learner's functions, want one"
            pointer = exercises._hint_pointer(e, functions)
            assert pointer.endswith(f"FOR={written[0]}"), f"{where} checks {written[0]}, its FAIL says: {pointer}"


