"""Reference solution for ch13.3 — k2, exact bias and variance, the adaptive beta (see ../ex3_kl_k2_controller.py)."""

from __future__ import annotations

import torch


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (ref_logp - logp) ** 2


def estimator_stats(p: torch.Tensor, p_ref: torch.Tensor) -> dict[str, tuple[float, float]]:
    logp, ref = p.log(), p_ref.log()
    log_r = ref - logp
    kl = float((p * (logp - ref)).sum())
    values = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": torch.expm1(log_r) - log_r}
    out = {}
    for name, k in values.items():
        mean = (p * k).sum()
        out[name] = (float(mean) - kl, float((p * (k - mean) ** 2).sum()))
    return out


def update_beta(beta: float, kl: float, target: float, k_beta: float = 0.1) -> float:
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return beta * (1.0 + k_beta * error)
