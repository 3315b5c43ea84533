"""Checker for ch07.3 — the bubble against mlsys.pipeline's simulated timelines, micro-batch counts by search,
activations in flight by walking mlsys.pipeline's schedules, and mesh coordinates against numpy."""

from __future__ import annotations

import numpy as np

from mlsys.exercises import task
from mlsys.pipeline import measured_bubble, schedule_actions, simulate


@task("bubble_fraction equals the idle fraction of a simulated 1F1B timeline, p = 1-5, m = 1-8")
def check_bubble(ex) -> None:
    for p in range(1, 6):
        for m in range(1, 9):
            want = measured_bubble(simulate("1f1b", p, m, t_fwd=1.0, t_bwd=1.0))["per_stage"][0]
            got = ex.bubble_fraction(p, m)
            assert abs(got - want) < 1e-9, f"bubble_fraction({p}, {m}) = {got}, the simulated timeline gives {want}"


@task("micro_batches_for: the smallest m whose bubble is at most the target")
def check_micro(ex) -> None:
    for p in (1, 2, 4, 8):
        for target in (0.5, 0.25, 0.1, 0.05, 0.3333):
            m = 1
            while (p - 1) / (m + p - 1) > target:
                m += 1
            got = ex.micro_batches_for(p, target)
            assert got == m, f"micro_batches_for({p}, {target}) = {got}, expected {m}"


def walk(schedule: str, stage: int, p: int, m: int) -> int:
    held = peak = 0
    for kind, _ in schedule_actions(schedule, stage, p, m):
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


@task("peak_in_flight: GPipe and 1F1B, every stage of p = 1-5, m = 1-8, counted along mlsys.pipeline's orders")
def check_in_flight(ex) -> None:
    for schedule in ("gpipe", "1f1b"):
        for p in range(1, 6):
            for m in range(1, 9):
                for s in range(p):
                    got, want = ex.peak_in_flight(schedule, s, p, m), walk(schedule, s, p, m)
                    assert got == want, f"peak_in_flight({schedule!r}, stage {s}, p={p}, m={m}) = {got}, want {want}"
    try:
        ex.peak_in_flight("zigzag", 0, 2, 2)
    except ValueError:
        return
    raise AssertionError("peak_in_flight('zigzag', ...) should raise ValueError")


@task("mesh_coords equals numpy.arange(W).reshape(pp, dp, tp), for several mesh shapes")
def check_mesh(ex) -> None:
    for dp, tp, pp in [(2, 2, 2), (1, 4, 2), (3, 2, 1), (2, 1, 3), (4, 2, 2)]:
        grid = np.arange(dp * tp * pp).reshape(pp, dp, tp)
        for coords in np.ndindex(grid.shape):
            rank = int(grid[coords])
            got = tuple(ex.mesh_coords(rank, dp, tp, pp))
            assert got == coords, f"dp={dp} tp={tp} pp={pp}: mesh_coords({rank}) = {got}, expected {coords}"
