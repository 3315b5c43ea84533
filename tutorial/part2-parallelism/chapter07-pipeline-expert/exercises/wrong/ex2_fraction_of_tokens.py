"""A mistake for ch07.2: f_i divided by the N tokens instead of the N*k assignments."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    probs = logits.softmax(dim=-1)  # (N, E)
    weights, experts = probs.topk(top_k, dim=-1)  # (N, k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights, experts


def keep_mask(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    N, k = experts.shape
    one_hot = F.one_hot(experts.t().reshape(-1), num_experts)  # (k*N, E), first choices first
    slot = ((one_hot.cumsum(dim=0) - 1) * one_hot).sum(dim=-1).view(k, N).t()  # (N, k)
    return slot < capacity


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    E = probs.size(-1)
    f = torch.bincount(experts.reshape(-1), minlength=E).to(probs.dtype) / experts.shape[0]
    return E * (f * probs.mean(dim=0)).sum()
