"""Reference solution for ch01.1 — rank arithmetic."""

from __future__ import annotations


def shard_bounds(num_items: int, rank: int, world_size: int) -> tuple[int, int]:
    base, extra = divmod(num_items, world_size)
    # ranks below `extra` own base + 1 items; each rank starts after all the items of the ranks before it
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return start, stop


def node_and_local_rank(rank: int, nproc_per_node: int) -> tuple[int, int]:
    return divmod(rank, nproc_per_node)
