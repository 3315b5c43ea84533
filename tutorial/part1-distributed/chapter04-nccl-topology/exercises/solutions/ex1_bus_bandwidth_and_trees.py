"""Reference solution for ch04.1 — bus bandwidth, and a broadcast down a binary tree."""

from __future__ import annotations

import torch
import torch.distributed as dist


def busbw(collective: str, size_bytes: float, time_s: float, world_size: int) -> float:
    n = world_size
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
               "all_to_all": (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}
    if collective not in factors:
        raise ValueError(f"unknown collective {collective!r}")
    return size_bytes / time_s / 1e9 * factors[collective]


def tree_parent(rank: int) -> int | None:
    return None if rank == 0 else (rank - 1) // 2


def tree_children(rank: int, world_size: int) -> list[int]:
    return [c for c in (2 * rank + 1, 2 * rank + 2) if c < world_size]


def tree_broadcast(tensor: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    parent = tree_parent(rank)
    if parent is not None:
        dist.recv(tensor, parent)  # rank 0's data, one level above us
    for work in [dist.isend(tensor, child) for child in tree_children(rank, dist.get_world_size())]:
        work.wait()  # both children at once
    return tensor
