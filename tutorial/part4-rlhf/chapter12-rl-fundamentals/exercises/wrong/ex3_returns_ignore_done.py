"""Mistake for ch12.3: returns carried across episode ends."""

from __future__ import annotations

import torch
from torch import Tensor


def discounted_returns(rewards: Tensor, dones: Tensor, last_value: Tensor, gamma: float) -> Tensor:
    out = torch.zeros_like(rewards)
    carry = last_value.clone()
    for t in reversed(range(rewards.shape[0])):
        carry = rewards[t] + gamma * carry
        out[t] = carry
    return out


def n_step_advantages(rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor, gamma: float,
                      n: int) -> Tensor:
    T = rewards.shape[0]
    next_values = torch.cat([values[1:], last_value[None]], dim=0)  # V(s_{t+1})
    adv = torch.zeros_like(rewards)
    for t in range(T):
        total = torch.zeros_like(last_value)
        alive = torch.ones_like(last_value)  # 1 while no episode end has been crossed
        for i in range(min(n, T - t)):
            total = total + alive * gamma**i * rewards[t + i]
            alive = alive * (1.0 - dones[t + i])
            if i == min(n, T - t) - 1:  # the last term: bootstrap from the state after it, if still alive
                total = total + alive * gamma ** (i + 1) * next_values[t + i]
        adv[t] = total - values[t]
    return adv
