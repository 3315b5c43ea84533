"""Checker for ch11.3 — the expected tokens against mlsys.speculative and a simulation of the acceptance
process, the speed-up against hand values, the best k against a brute-force scan."""

from __future__ import annotations

import math
import random

from mlsys import speculative
from mlsys.exercises import reference_helpers, task


@task("expected_tokens: equals mlsys.speculative's formula, k + 1 at alpha = 1, 1 at alpha = 0")
def check_formula(ex) -> None:
    for alpha in (0.0, 0.3, 0.6, 0.9, 0.99, 1.0):
        for k in (0, 1, 2, 4, 8):
            got, want = ex.expected_tokens(alpha, k), speculative.expected_tokens_per_step(alpha, k)
            assert math.isclose(got, want, rel_tol=1e-12), f"expected_tokens({alpha}, {k}) = {got}, want {want}"


@task("expected_tokens: matches 40,000 simulated steps (accept each draft with probability alpha, stop at a miss)")
def check_simulation(ex) -> None:
    rng = random.Random(0)
    for alpha, k in ((0.7, 4), (0.5, 2), (0.9, 6)):
        total = 0
        for _ in range(40_000):
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            total += accepted + 1  # the target's correction or bonus token
        sim = total / 40_000
        got = ex.expected_tokens(alpha, k)
        assert abs(got - sim) < 0.03, f"alpha {alpha}, k {k}: formula {got:.3f}, simulation {sim:.3f}"


@task("speedup: hand values (free verification, a costly draft)")
def check_speedup(ex) -> None:
    with reference_helpers(ex, expected_tokens=speculative.expected_tokens_per_step):  # yours has its own tasks
        got = ex.speedup(0.8, 4, 0.05, 1.0)
        want = (1 - 0.8**5) / 0.2 / 1.2
        assert math.isclose(got, want, rel_tol=1e-12), f"speedup(0.8, 4, 0.05, 1.0) = {got}, want {want:.6f}"
        assert math.isclose(ex.speedup(1.0, 3, 0.5, 1.0), 4 / 2.5), "alpha = 1, k = 3: 4 tokens for 2.5 steps of cost"


@task("best_k: equals a brute-force scan of k = 1 .. k_max")
def check_best_k(ex) -> None:
    # best_k may call your speedup / expected_tokens: this task puts mlsys.speculative's formula in their place, so
    # it checks the scan alone and a wrong speedup fails only its own task
    def speedup(alpha: float, k: int, c_draft: float, c_verify: float) -> float:
        return speculative.expected_tokens_per_step(alpha, k) / (k * c_draft + c_verify)

    with reference_helpers(ex, speedup=speedup, expected_tokens=speculative.expected_tokens_per_step):
        for alpha in (0.5, 0.7, 0.8, 0.9, 0.95):
            for c_draft in (0.02, 0.1, 0.3):
                cost = [(1 - alpha ** (k + 1)) / (1 - alpha) / (k * c_draft + 1.1) for k in range(1, 13)]
                want = 1 + cost.index(max(cost))
                got = ex.best_k(alpha, c_draft, 1.1, 12)
                assert got == want, \
                    f"best_k(alpha {alpha}, c_draft {c_draft}, c_verify 1.1, k_max 12) = {got}, want {want}"
