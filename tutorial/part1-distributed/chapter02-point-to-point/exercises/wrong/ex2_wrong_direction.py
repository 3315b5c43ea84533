"""A mistake for ch02.2: the ring turns the wrong way (sends left, receives from the right), and the chain adds
its rank before receiving, so the received value overwrites it."""

import torch
import torch.distributed as dist


def chain_expected(start, rank):
    return start + rank * (rank + 1) / 2


def chain(start):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([start], dtype=torch.float64)
    value += rank
    if rank > 0:
        dist.recv(value, src=rank - 1)
    if rank < world_size - 1:
        dist.send(value, dst=rank + 1)
    return float(value.item())


def ordered_ring_shift(tensor):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(tensor)
    if rank % 2 == 0:
        dist.send(tensor, dst=(rank - 1) % world_size)
        dist.recv(got, src=(rank + 1) % world_size)
    else:
        dist.recv(got, src=(rank + 1) % world_size)
        dist.send(tensor, dst=(rank - 1) % world_size)
    return got
