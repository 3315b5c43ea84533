"""Mistake for ch13.2: token advantages forget the mask, so padding gets the row's advantage too."""

from __future__ import annotations

import torch


def group_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    groups = scores.view(-1, group_size)  # (B/G, G)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + eps)).view(-1)


def token_advantages(scores: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    return group_advantages(scores, group_size)[:, None].expand_as(mask).clone()
