"""Every distributed script, at every world size from 1 to 8: its self-check passes or it refuses the size.

A self-check that fails at a world size the script accepts is a bug the reader finds by typing `-w 3`. One case
per group of up to three scripts of a chapter runs them at sizes 1..8 with --smoke from one parent process
(tests/fixtures/sweep.py: torch imported once, the launcher's fork server started once), so the sweep costs about
the work itself. A size may be refused with the contract's usage error (exit 2, one line naming the sizes
supported); any other exit code fails the case. Part II's equality checks (sharded == dense, within rounding) are
swept again at their default sizes, where rounding in small gradients matters most.

These cases carry the `sweep` marker: `make test` leaves them out to stay within its 10 minutes, `make sweep`
runs them (about 30 minutes on 2 cores with the other sweep-marked tests), and CI (.ci/run) runs both.

    make sweep                                       # all of it
    MLSYS_SWEEP_REPORT=sweep.jsonl make sweep        # and append every (script, size, exit code) to a file
    python -m pytest tests/test_sweep.py -m sweep -k chapter05
"""

from __future__ import annotations

import json
import os
from itertools import groupby

import pytest

from conftest import ROOT, chapter_scripts, run

DISTRIBUTED = [s for s in chapter_scripts() if "DistArgs" in s.read_text()]
BY_CHAPTER = {ch: list(scripts) for ch, scripts in groupby(DISTRIBUTED, key=lambda s: s.parent.parent.name)}
# At most three scripts per case, so the two pytest workers share a long chapter and no case nears its timeout; a
# script that starts Ray at every size (20-90 s each on 2 cores) gets a case of its own.
SOLO = {"ray_placement.py"}
CASES = {f"{ch}-{i // 3 + 1}": group[i:i + 3] for ch, scripts in BY_CHAPTER.items()
         for group in [[s for s in scripts if s.name not in SOLO]] for i in range(0, len(group), 3)}
CASES |= {f"{s.parent.parent.name}-{s.stem}": [s] for s in DISTRIBUTED if s.name in SOLO}
SIZES = list(range(1, 9))
SWEEP = ROOT / "tests" / "fixtures" / "sweep.py"


def sweep(scripts: list, sizes: list[int], *flags: str, timeout: float = 500) -> dict[tuple[str, int], int]:
    """{(script name, world size): exit code} for every pair; fails on any code other than 0 and 2."""
    proc = run([SWEEP, ",".join(map(str, sizes)), *scripts, "--", *flags], timeout=timeout)
    records = [json.loads(line[6:]) for line in proc.stdout.splitlines() if line.startswith("SWEEP ")]
    results = {(r["script"], r["world_size"]): r["exit_code"] for r in records}
    reports = "".join(f"\n--- {r['script']} -w {r['world_size']} (exit {r['exit_code']}):\n{r['stderr']}"
                      for r in records if "stderr" in r)
    wanted = [(s.name, w) for s in scripts for w in sizes]
    assert sorted(results) == sorted(wanted), f"the sweep stopped early:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    if os.environ.get("MLSYS_SWEEP_REPORT"):  # a file to append the exit codes to, for the record
        with open(os.environ["MLSYS_SWEEP_REPORT"], "a", encoding="utf-8") as report:
            report.write(json.dumps({"flags": list(flags), "codes": [[s, w, c] for (s, w), c in results.items()]})
                         + "\n")
    failed = {key: code for key, code in results.items() if code not in (0, 2)}
    assert not failed, f"(script, world size): exit code {failed}{reports}\n{proc.stderr[-3000:]}"
    for script in scripts:
        assert any(results[(script.name, w)] == 0 for w in sizes), f"{script.name} refused every world size"
    return results


def test_every_distributed_script_is_swept() -> None:
    assert sum(map(len, CASES.values())) == len(DISTRIBUTED) >= 20


@pytest.mark.sweep
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", sorted(CASES))
def test_self_checks_hold_at_every_world_size(case: str) -> None:
    sweep(CASES[case], SIZES, "--smoke", timeout=880)


# Part II scripts whose self-check is an equality (sharded result == single-process result): default sizes.
EQUALITY = [s for s in DISTRIBUTED if s.parent.parent.parent.name.startswith("part2")
            and s.name not in ("bench_ddp.py", "bubble.py")]


# The equality at the default sizes, with a script's measurement part cut short where it dominates: context
# parallelism measures peak memory at 1k to 8k tokens (the book's run has all four lengths), one length here.
DEFAULT_FLAGS = {"context_parallel.py": ["--lengths", "1024"]}


@pytest.mark.sweep
@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", EQUALITY, ids=lambda s: s.name)
def test_part2_equality_checks_hold_at_default_sizes(script) -> None:
    sweep([script], SIZES, *DEFAULT_FLAGS.get(script.name, []), timeout=880)
