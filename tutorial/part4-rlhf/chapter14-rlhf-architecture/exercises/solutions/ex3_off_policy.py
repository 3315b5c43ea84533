"""Reference solution for ch14.3 — the off-policy gap and its correction (see ../ex3_off_policy.py)."""

from __future__ import annotations

import torch


def off_policy_gap(behaviour_logp: torch.Tensor, current_logp: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((behaviour_logp - current_logp) * mask).sum() / mask.sum())


def importance_weights(behaviour_logp: torch.Tensor, current_logp: torch.Tensor, mask: torch.Tensor,
                       cap: float) -> torch.Tensor:
    return torch.exp(current_logp - behaviour_logp).clamp(max=cap) * mask


def corrected_mean(f: torch.Tensor, behaviour_logp: torch.Tensor, current_logp: torch.Tensor, mask: torch.Tensor,
                   cap: float = float("inf")) -> float:
    w = importance_weights(behaviour_logp, current_logp, mask, cap)
    return float((w * f).sum() / mask.sum())
