"""Exercise ch05.2 — the two pieces of ZeRO that everything else rests on: where a rank's slice of the padded flat
buffer lies, and stage 2's gradient step (one reduce-scatter instead of an all-reduce). Runs on real ranks.

The process group is already initialised when `reduce_scatter_grad` is called: use torch.distributed directly.
Check your work:  make check EX=ch05.2
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """(padded, lo, hi) for a flat buffer of `numel` elements split over `world_size` ranks.

    padded: the smallest multiple of world_size that is >= numel (the buffer is zero-padded up to it).
    [lo, hi): the contiguous range rank `rank` owns; every rank owns padded // world_size elements, rank 0 first.
    Example: numel=10, world_size=4 -> padded 12; rank 3 owns [9, 12) (two real elements and two of padding).
    """
    raise NotImplementedError("TODO: round numel up to a multiple of world_size, then cut it into equal ranges")


def reduce_scatter_grad(grad: torch.Tensor) -> torch.Tensor:
    """ZeRO stage 2's gradient step. `grad` is this rank's full flat gradient, shape (numel,), numel the same on
    every rank and not necessarily divisible by the world size.

    Return this rank's slice [lo, hi) of the gradient AVERAGED over all ranks, shape (padded // W,), where the
    padding is zeros. Use exactly one reduce-scatter (dist.reduce_scatter_single; older torch calls it
    dist.reduce_scatter_tensor) on a zero-padded copy, then divide by W. No all_reduce: the point of stage 2 is
    that each rank receives only its own 1/W of the reduced gradient.
    """
    raise NotImplementedError("TODO: pad to a multiple of W, reduce-scatter into a (padded // W,) buffer, divide by W")
