"""A mistake for ch02.1: after k shifts the received tensor goes to row (rank + k) % W instead of (rank - k) % W."""

import torch
import torch.distributed as dist


def ring_shift(tensor):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(tensor)
    requests = [dist.isend(tensor, dst=(rank + 1) % world_size), dist.irecv(got, src=(rank - 1) % world_size)]
    for request in requests:
        request.wait()
    return got


def ring_allgather(tensor):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = torch.empty(world_size, *tensor.shape, dtype=tensor.dtype)
    out[rank] = tensor
    current = tensor
    for k in range(1, world_size):
        current = ring_shift(current)
        out[(rank + k) % world_size] = current
    return out
