"""A mistake for ch04.1: all-reduce's busbw factor without the 2, (n-1)/n, as for all-gather."""

import torch  # noqa: F401
import torch.distributed as dist


def busbw(collective, size_bytes, time_s, world_size):
    n = world_size
    factors = {"all_reduce": (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
               "all_to_all": (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}
    if collective not in factors:
        raise ValueError(collective)
    return size_bytes / time_s / 1e9 * factors[collective]


def tree_parent(rank):
    return None if rank == 0 else (rank - 1) // 2


def tree_children(rank, world_size):
    return [c for c in (2 * rank + 1, 2 * rank + 2) if c < world_size]


def tree_broadcast(tensor):
    rank = dist.get_rank()
    parent = tree_parent(rank)
    if parent is not None:
        dist.recv(tensor, parent)
    for work in [dist.isend(tensor, child) for child in tree_children(rank, dist.get_world_size())]:
        work.wait()
    return tensor



