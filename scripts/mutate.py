"""Mutation testing of the mechanism modules (`make mutate`): run mutmut, then report the kill rate per module.

mutmut (configured in pyproject.toml, [tool.mutmut]) copies mlsys/ into mutants/, makes small changes to the listed
modules one at a time (a `+` turned into `-`, a constant changed, an argument dropped) and runs the tests that reach
the changed function. A mutant the tests do not notice ("survived") is either a missing test or a change that does
not alter behaviour ("equivalent"); the equivalent ones are listed, each with its reason, in
tests/units/equivalent_mutants/<module>.toml (a table [equivalent] of name = "reason") and left out of the rate.
The tests written to kill survivors live in tests/units/. The goal (issue 29): at least 90% of the non-equivalent
mutants killed in every module.

    python scripts/mutate.py              # run mutmut (resumes where it stopped), then print the table
    python scripts/mutate.py --report     # only print the table from the last run
    python scripts/mutate.py --survivors mlsys/rl.py   # list one module's surviving mutants
    python scripts/mutate.py --recheck-timeouts       # re-run every timed-out mutant's tests in a fresh process

Timeouts. mutmut runs each mutant in a child forked from its own process; a test that starts threads or process
pools can then hang for reasons of the fork, not of the mutant (seen: SchemaCache tests under SchemaFSM.nbytes
mutants, each hanging until the limit while the same tests pass in 2 s in a fresh process). mutmut counts a timeout
as a kill, which would flatter the rate, so the table counts timeouts apart, and `--recheck-timeouts` runs each
timed-out mutant's tests again in a fresh pytest process (scripts/mutant_check.py's way, 120 s per test): a
failure is a kill, a pass a survivor. The verdicts go to mutants/rechecked.json and the table uses them.

Exit status: 0 if every module meets the goal, 1 if one does not, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
GOAL = 0.90
KILLED = {1, 3, 37, -11}  # mutmut's killed, type-check and segfault codes
TIMEOUT = {36, 24, -24, 152, 255, -9}  # timeouts and SIGKILLed hangs: a kill only once a fresh process confirms it
SURVIVED = {0}
NO_TESTS = {5, 33}


def modules() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    return list(config["only_mutate"])


def equivalents() -> dict[str, str]:
    """{mutant name: why it cannot change behaviour}, from tests/units/equivalent_mutants/*.toml ([equivalent])."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "tests" / "units" / "equivalent_mutants").glob("*.toml")):
        found.update(tomllib.loads(path.read_text()).get("equivalent", {}))
    return found


def statuses(module: str) -> dict[str, int | None]:
    """mutmut's exit code per mutant, with timeouts replaced by their fresh-process re-check where there is one."""
    meta = ROOT / "mutants" / (module + ".meta")
    if not meta.exists():
        return {}
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    rechecked = rechecks()
    return {k: (rechecked[k] if c in TIMEOUT and k in rechecked else c) for k, c in codes.items()}


RECHECKED = ROOT / "mutants" / "rechecked.json"


def rechecks() -> dict[str, int]:
    return json.loads(RECHECKED.read_text()) if RECHECKED.exists() else {}


def recheck_timeouts() -> None:
    """Each timed-out mutant's tests (mutmut's own mapping) in a fresh pytest process: 1 killed, 0 survived."""
    stats = json.loads((ROOT / "mutants" / "mutmut-stats.json").read_text())["tests_by_mangled_function_name"]
    done = rechecks()
    for module in modules():
        meta = ROOT / "mutants" / (module + ".meta")
        if not meta.exists():
            continue
        for key, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            if code not in TIMEOUT or key in done:
                continue
            tests = sorted(stats.get(key.rsplit("__mutmut_", 1)[0], []))
            env = dict(os.environ, PYTHONPATH=str(ROOT / "mutants"), MUTANT_UNDER_TEST=key, OMP_NUM_THREADS="1",
                       MLSYS_CACHE=os.environ.get("MLSYS_CACHE") or str(ROOT / ".cache"))
            cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "--timeout", "120",
                   "--rootdir", str(ROOT), *[str(ROOT / t) for t in tests]]
            try:
                rc = subprocess.run(cmd, cwd=ROOT / "mutants", env=env, capture_output=True,
                                    timeout=120 + 30 * len(tests)).returncode
            except subprocess.TimeoutExpired:
                rc = 1  # hung in a fresh process too: the mutant's own doing
            done[key] = 1 if rc != 0 else 0
            print(f"{key}: {'killed' if rc else 'survived'} in a fresh process", flush=True)
            RECHECKED.write_text(json.dumps(done, indent=1))


def report(show_survivors: str | None) -> int:
    known = equivalents()
    seen_keys: set[str] = set()
    worst = 1.0
    print(f"{'module':34} {'mutants':>7} {'killed':>6} {'survived':>8} {'no test':>7} {'timeout':>7} {'equiv':>5} "
          f"{'kill rate':>9} {'if timeouts kill':>16}")
    for module in modules():
        codes = statuses(module)
        seen_keys |= set(codes)
        count = Counter()
        for key, code in codes.items():
            if key in known:
                count["equivalent"] += 1
            elif code in KILLED:
                count["killed"] += 1
            elif code in TIMEOUT:
                count["timeout"] += 1
            elif code in SURVIVED:
                count["survived"] += 1
            elif code in NO_TESTS:
                count["no tests"] += 1
            else:
                count["not run"] += 1
        judged = count["killed"] + count["survived"] + count["no tests"] + count["timeout"]
        rate = count["killed"] / judged if judged else float("nan")  # a timeout not re-checked counts as a survivor
        upper = (count["killed"] + count["timeout"]) / judged if judged else float("nan")  # mutmut's own convention
        worst = min(worst, rate) if judged else 0.0
        note = "" if codes else "  (not run)"
        if count["not run"]:
            note += f"  ({count['not run']} not run)"
        print(f"{module:34} {len(codes):7d} {count['killed']:6d} {count['survived']:8d} {count['no tests']:7d} "
              f"{count['timeout']:7d} {count['equivalent']:5d} {rate:9.1%} {upper:16.1%}{note}")
        if show_survivors in (module, "all"):
            for key, code in sorted(codes.items()):
                if key not in known and (code in SURVIVED or code in NO_TESTS or code in TIMEOUT):
                    why = "survived" if code in SURVIVED else "timeout" if code in TIMEOUT else "no tests"
                    print(f"    {key}  ({why})")
    stale = sorted(set(known) - seen_keys)
    if stale and seen_keys:
        print(f"note: {len(stale)} listed equivalent mutants no longer exist (the code moved): {', '.join(stale[:5])}")
    print(f"goal: at least {GOAL:.0%} of the non-equivalent mutants killed in each module; worst module {worst:.1%} "
          "(timeouts not re-checked in a fresh process count as survivors; the last column counts them as kills)")
    return 0 if worst >= GOAL else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", action="store_true", help="only print the table from the last run")
    parser.add_argument("--survivors", nargs="?", const="all", default=None, metavar="MODULE",
                        help="list the surviving mutants (of MODULE, e.g. mlsys/rl.py, or of all modules)")
    parser.add_argument("--max-children", type=int, default=None, help="mutmut's parallel workers (default: CPUs)")
    parser.add_argument("--recheck-timeouts", action="store_true",
                        help="only re-run the timed-out mutants' tests in fresh processes, then print the table")
    args = parser.parse_args()
    if args.survivors not in (None, "all") and args.survivors not in modules():
        parser.error(f"--survivors takes one of {modules()} or nothing")
    if args.recheck_timeouts:
        recheck_timeouts()
    elif not args.report and args.survivors is None:  # listing survivors reads the last run, runs nothing
        # One OpenMP thread: mutmut forks each mutant's child from a process that has run tests, and a child forked
        # after torch's OpenMP pool started deadlocks in its first parallel op (seen: speculative.py's mutants
        # all "timed out" that way, and survived once run with one thread).
        env = dict(os.environ, MLSYS_CACHE=os.environ.get("MLSYS_CACHE") or str(ROOT / ".cache"), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "mutmut", "run"]
        if args.max_children:
            cmd += ["--max-children", str(args.max_children)]
        subprocess.run(cmd, cwd=ROOT, env=env, check=False)
        recheck_timeouts()
    return report(args.survivors)


if __name__ == "__main__":
    sys.exit(main())
