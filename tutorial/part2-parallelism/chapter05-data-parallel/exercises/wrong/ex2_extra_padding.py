"""A mistake for ch05.2: pads by W - numel % W, a whole extra row of W when W already divides numel."""

from __future__ import annotations

import torch
import torch.distributed as dist

REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int, int]:
    padded = numel + world_size - numel % world_size
    size = padded // world_size
    return padded, rank * size, (rank + 1) * size


def reduce_scatter_grad(grad: torch.Tensor) -> torch.Tensor:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    padded, lo, hi = shard_bounds(grad.numel(), world_size, rank)
    flat = torch.zeros(padded, dtype=grad.dtype)
    flat[:grad.numel()] = grad.flatten()
    mine = torch.empty(hi - lo, dtype=grad.dtype)
    REDUCE_SCATTER(mine, flat)  # sum over ranks of flat[lo:hi], delivered to this rank only
    return mine / world_size
