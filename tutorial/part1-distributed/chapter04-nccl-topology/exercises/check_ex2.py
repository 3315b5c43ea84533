"""Checker for ch04.2 — the model's times against step and byte counts taken from a walk of the tree and from the
lesson's formulas, and the crossover against the times themselves (equal at n*, tree faster below, ring above)."""

from __future__ import annotations

import math

from mlsys.exercises import task


def busiest_fan(p: int) -> int:
    """Sum over the tree's levels of the most children of one parent, by listing each level's ranks."""
    total, depth = 0, 0
    while 2 ** depth - 1 < p:
        ranks = range(2 ** depth - 1, min(2 ** (depth + 1) - 1, p))
        fans = [sum(1 for c in (2 * r + 1, 2 * r + 2) if c < p) for r in ranks]
        total += max(fans) if max(fans) else 0
        depth += 1
    return total


@task("tree_fan_sum: K = 3 for 4 ranks, 4 for 5, and a level-by-level count for 1 to 40 ranks")
def check_fan(ex) -> None:
    assert ex.tree_fan_sum(4) == 3 and ex.tree_fan_sum(5) == 4, \
        f"the lesson's values: K(4) = 3, K(5) = 4; got {ex.tree_fan_sum(4)}, {ex.tree_fan_sum(5)}"
    for p in range(1, 41):
        got, want = ex.tree_fan_sum(p), busiest_fan(p)
        assert got == want, f"tree_fan_sum({p}) = {got}, expected {want}"


@task("all_reduce_time: ring, tree and halving-doubling against their (steps, bytes) counts")
def check_times(ex) -> None:
    alpha, beta = 5e-6, 1e-9
    for p in (1, 2, 3, 4, 5, 8, 13, 16):
        for n in (0.0, 1e3, 1e6, 3e8):
            wants = {"ring": 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta,
                     "tree": 2 * math.floor(math.log2(p)) * alpha + 2 * busiest_fan(p) * n * beta}
            if p & (p - 1) == 0:
                wants["halving-doubling"] = 2 * math.log2(p) * alpha + 2 * (p - 1) / p * n * beta
            for algorithm, want in wants.items():
                got = ex.all_reduce_time(algorithm, n, p, alpha, beta)
                assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15), \
                    f"all_reduce_time({algorithm!r}, {n:g}, {p}, ...) = {got}, expected {want}"
    for bad in [("halving-doubling", 6), ("all_shuffle", 4)]:
        try:
            ex.all_reduce_time(bad[0], 1e6, bad[1], alpha, beta)
        except ValueError:
            continue
        raise AssertionError(f"all_reduce_time({bad[0]!r}, ..., world_size={bad[1]}) should raise ValueError")


@task("crossover_bytes: None for 2 ranks; otherwise ring and tree cost the same there, tree below, ring above")
def check_crossover(ex) -> None:
    alpha, beta = 20e-6, 1 / 10e9
    assert ex.crossover_bytes(2, alpha, beta) is None, "2 ranks: ring and tree take the same 2 steps, no crossover"
    assert ex.crossover_bytes(1, alpha, beta) is None, "1 rank: nothing to cross"
    for p in (3, 4, 5, 8, 16):
        n = ex.crossover_bytes(p, alpha, beta)
        assert n is not None and n > 0, f"p={p}: expected a positive crossover, got {n}"
        ring = 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta
        tree = 2 * math.floor(math.log2(p)) * alpha + 2 * busiest_fan(p) * n * beta
        assert math.isclose(ring, tree, rel_tol=1e-9), f"p={p}: at n*={n:g} the ring takes {ring:g} s, tree {tree:g} s"
        for m, faster in ((n / 2, "tree"), (2 * n, "ring")):
            r = 2 * (p - 1) * alpha + 2 * (p - 1) / p * m * beta
            t = 2 * math.floor(math.log2(p)) * alpha + 2 * busiest_fan(p) * m * beta
            assert (t < r) == (faster == "tree"), f"p={p}: at {m:g} bytes the {faster} should be faster"
