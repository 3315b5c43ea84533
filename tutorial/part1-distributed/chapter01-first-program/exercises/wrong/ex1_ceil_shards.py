"""A classic mistake for ch01.1: shards of ceil(n / w) items, so the last ranks get too few (or none)."""

import math


def shard_bounds(num_items: int, rank: int, world_size: int) -> tuple[int, int]:
    size = math.ceil(num_items / world_size)
    return min(rank * size, num_items), min((rank + 1) * size, num_items)


def node_and_local_rank(rank: int, nproc_per_node: int) -> tuple[int, int]:
    return rank % nproc_per_node, rank // nproc_per_node  # swapped: local rank first
