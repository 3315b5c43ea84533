"""Reference solution for ch01.2 — your first collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist


def global_mean(local: torch.Tensor) -> torch.Tensor:
    stats = torch.tensor([local.sum().item(), local.numel()], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)  # [global sum, global count] on every rank
    return (stats[0] / stats[1]).to(torch.float32)


def argmax_rank(value: float) -> int:
    best = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(best, op=dist.ReduceOp.MAX)
    # every rank that holds the maximum proposes itself; the others propose world_size (larger than any rank)
    mine = dist.get_rank() if value == best.item() else dist.get_world_size()
    candidate = torch.tensor([mine])
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN)
    return int(candidate.item())
