"""A mistake for ch02.2: every rank sends first, so every blocking send waits for a recv nobody posts (deadlock)."""

import torch
import torch.distributed as dist


def chain_expected(start, rank):
    return start + rank * (rank + 1) / 2


def chain(start):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([start], dtype=torch.float64)
    if rank > 0:
        dist.recv(value, src=rank - 1)
    value += rank
    if rank < world_size - 1:
        dist.send(value, dst=rank + 1)
    return float(value.item())


def ordered_ring_shift(tensor):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(tensor)
    dist.send(tensor, dst=(rank + 1) % world_size)
    dist.recv(got, src=(rank - 1) % world_size)
    return got
