"""Reference solution for ch02.1 — ring shift and a ring all-gather from point-to-point calls."""

from __future__ import annotations

import torch
import torch.distributed as dist


def ring_shift(tensor: torch.Tensor) -> torch.Tensor:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(tensor)
    # both calls are posted before either is waited on, so no rank blocks with its recv unposted
    requests = [dist.isend(tensor, dst=(rank + 1) % world_size), dist.irecv(got, src=(rank - 1) % world_size)]
    for request in requests:
        request.wait()
    return got


def ring_allgather(tensor: torch.Tensor) -> torch.Tensor:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = torch.empty(world_size, *tensor.shape, dtype=tensor.dtype)
    out[rank] = tensor
    current = tensor
    for k in range(1, world_size):
        current = ring_shift(current)  # now holds the tensor of rank (rank - k) % W
        out[(rank - k) % world_size] = current
    return out
