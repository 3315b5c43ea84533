"""Checker for ch07.1 — your 1F1B order against mlsys.pipeline, your bubble against the formula, then a real run."""

from __future__ import annotations

import random

from mlsys.exercises import run_ranks, task
from mlsys.pipeline import bubble_fraction, measured_bubble, schedule_actions, simulate


def _show(order: list) -> str:
    return " ".join(f"{k}{i}" for k, i in order)


@task("one_f_one_b_order: every stage of p = 1..5 stages, m = 1..8 micro-batches")
def check_order(ex) -> None:
    for p in range(1, 6):
        for m in range(1, 9):
            for s in range(p):
                got = [tuple(a) for a in ex.one_f_one_b_order(s, p, m)]
                want = schedule_actions("1f1b", s, p, m)
                assert got == want, f"p={p}, m={m}, stage {s}: got {_show(got)}, want {_show(want)}"


@task("bubble_from_timeline: ideal timelines give (p-1)/(m+p-1); uneven ones match a reference")
def check_bubble(ex) -> None:
    for schedule in ("gpipe", "1f1b"):
        for p, m in [(2, 1), (2, 4), (3, 3), (4, 8)]:
            got = ex.bubble_from_timeline(simulate(schedule, p, m, t_fwd=1.0, t_bwd=2.0))
            want = bubble_fraction(p, m)
            assert len(got) == p, f"{schedule} p={p}: want one fraction per stage, got {len(got)}"
            assert all(abs(b - want) < 1e-9 for b in got), f"{schedule} p={p} m={m}: got {got}, want {want:.4f} each"
    rng = random.Random(0)
    events = [[{"start": t, "end": t + rng.uniform(0.5, 2.0)} for t in sorted(rng.uniform(0, 20) for _ in range(5))]
              for _ in range(3)]
    got, want = ex.bubble_from_timeline(events), measured_bubble(events)["per_stage"]
    assert all(abs(a - b) < 1e-9 for a, b in zip(got, want)), f"uneven timeline: got {got}, want {want}"


@task("your order runs for real on 3 ranks: gradients equal one process, stage s holds <= 3 - s micro-batches")
def check_real_run(ex) -> None:
    for s in range(3):  # a wrong order could hang the job: run it only once it is right on paper
        got = [tuple(a) for a in ex.one_f_one_b_order(s, 3, 4)]
        assert got == schedule_actions("1f1b", s, 3, 4), "fix one_f_one_b_order first (task 1)"
    results = run_ranks(ex, "pipelined_gradients", [(0, 4)] * 3)
    for s, r in enumerate(results):
        assert r["max_grad_diff"] < 1e-5, f"stage {s}: gradients differ from one process by {r['max_grad_diff']:.3g}"
        assert r["peak_in_flight"] == 3 - s, f"stage {s} held {r['peak_in_flight']} micro-batches, want {3 - s}"
