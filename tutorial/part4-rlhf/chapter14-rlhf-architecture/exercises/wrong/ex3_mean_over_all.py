"""Mistake for ch14.3: the gap averages over every position, padding included."""

from __future__ import annotations

import torch


def off_policy_gap(behaviour_logp: torch.Tensor, current_logp: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((behaviour_logp - current_logp) * mask).mean())


def importance_weights(behaviour_logp: torch.Tensor, current_logp: torch.Tensor, mask: torch.Tensor,
                       cap: float) -> torch.Tensor:
    return torch.exp(current_logp - behaviour_logp).clamp(max=cap) * mask


def corrected_mean(f: torch.Tensor, behaviour_logp: torch.Tensor, current_logp: torch.Tensor, mask: torch.Tensor,
                   cap: float = float("inf")) -> float:
    w = importance_weights(behaviour_logp, current_logp, mask, cap)
    return float((w * f).sum() / mask.sum())
