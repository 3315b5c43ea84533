"""Mistake for ch12.2: approx_kl as the mean of -log ratio (k1), which can be negative on a sample."""

from __future__ import annotations

import torch
from torch import Tensor


def clipped_loss(logp_new: Tensor, logp_old: Tensor, advantages: Tensor, clip_eps: float) -> Tensor:
    """The scalar PPO policy loss (differentiable in logp_new); all inputs the same shape."""
    ratio = torch.exp(logp_new - logp_old)
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_eps, 1 + clip_eps)).mean()


def clip_fraction(logp_new: Tensor, logp_old: Tensor, clip_eps: float) -> float:
    """Share of samples whose ratio lies outside [1 - eps, 1 + eps]."""
    ratio = torch.exp(logp_new - logp_old)
    return ((ratio - 1).abs() > clip_eps).float().mean().item()


def approx_kl(logp_new: Tensor, logp_old: Tensor) -> float:
    """The k3 estimate of KL(old || new) from samples of the old policy: mean((ratio - 1) - log ratio), >= 0."""
    log_ratio = (logp_new - logp_old).detach()
    return (-log_ratio).mean().item()
