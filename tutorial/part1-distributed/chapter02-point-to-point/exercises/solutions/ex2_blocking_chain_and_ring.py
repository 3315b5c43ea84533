"""Reference solution for ch02.2 — the chain's closed form, the chain, and a ring ordered by parity."""

from __future__ import annotations

import torch
import torch.distributed as dist


def chain_expected(start: float, rank: int) -> float:
    return start + rank * (rank + 1) / 2


def chain(start: float) -> float:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([start], dtype=torch.float64)
    if rank > 0:
        dist.recv(value, src=rank - 1)  # blocks until the previous rank has sent: the chain is sequential
    value += rank
    if rank < world_size - 1:
        dist.send(value, dst=rank + 1)
    return float(value.item())


def ordered_ring_shift(tensor: torch.Tensor) -> torch.Tensor:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    got = torch.empty_like(tensor)
    if rank % 2 == 0:  # with odd W, ranks 0 and W-1 both send first; rank 0's send completes once rank 1 receives
        dist.send(tensor, dst=right)
        dist.recv(got, src=left)
    else:
        dist.recv(got, src=left)
        dist.send(tensor, dst=right)
    return got
