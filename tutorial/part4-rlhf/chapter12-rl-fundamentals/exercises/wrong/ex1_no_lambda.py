"""Mistake for ch12.1: the recursion discounts by gamma only, forgetting lambda."""

from __future__ import annotations

import torch
from torch import Tensor


def td_errors(rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor, gamma: float) -> Tensor:
    """The one-step TD errors delta_t, shape (T, N)."""
    next_values = torch.cat([values[1:], last_value[None]], dim=0)  # (T, N): V(s_{t+1})
    return rewards + gamma * next_values * (1.0 - dones) - values


def compute_gae(rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor,
                gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Return (advantages, returns), both (T, N), with returns = advantages + values."""
    deltas = td_errors(rewards, values, dones, last_value, gamma)
    advantages = torch.zeros_like(values)
    carry = torch.zeros_like(last_value)  # (N,): A_{t+1}
    for t in reversed(range(rewards.shape[0])):
        carry = deltas[t] + gamma * (1.0 - dones[t]) * carry
        advantages[t] = carry
    return advantages, advantages + values
