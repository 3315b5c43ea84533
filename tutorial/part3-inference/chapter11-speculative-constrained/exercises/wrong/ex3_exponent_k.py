"""Mistake for ch11.3: the geometric sum stops at alpha^(k-1), one term short."""

from __future__ import annotations


def expected_tokens(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** k) / (1.0 - alpha)


def speedup(alpha: float, k: int, c_draft: float, c_verify: float) -> float:
    return expected_tokens(alpha, k) / (k * c_draft + c_verify)


def best_k(alpha: float, c_draft: float, c_verify: float, k_max: int) -> int:
    return max(range(1, k_max + 1), key=lambda k: (speedup(alpha, k, c_draft, c_verify), -k))
