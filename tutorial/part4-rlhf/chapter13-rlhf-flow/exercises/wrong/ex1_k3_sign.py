"""Mistake for ch13.1: k3 built from log w = log pi - log pi_ref, the ratio upside down (biased, wrong expectation)."""

from __future__ import annotations

import torch


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    log_r = logp - ref_logp
    return torch.expm1(log_r) - log_r  # expm1: no cancellation when r is close to 1


def shape_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    rewards = -beta * kl * mask  # (B, L)
    last = mask.long().sum(1) - 1  # (B,) each row's final real token
    rows = torch.arange(kl.size(0))
    rewards[rows, last] += scores.to(rewards.dtype)
    return rewards
