"""Mistake for ch13.2: normalises by the mean and std of the whole batch, not of each prompt's group."""

from __future__ import annotations

import torch


def group_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    groups = scores.view(1, -1)  # the whole batch as one group
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + eps)).view(-1)


def token_advantages(scores: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    return group_advantages(scores, group_size)[:, None] * mask
