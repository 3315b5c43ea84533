"""A mistake for ch01.1: the leftover items go to the LAST ranks instead of the first ones."""


def shard_bounds(num_items: int, rank: int, world_size: int) -> tuple[int, int]:
    base, extra = divmod(num_items, world_size)
    first_big = world_size - extra  # ranks from here on get one extra item
    start = rank * base + max(0, rank - first_big)
    stop = start + base + (1 if rank >= first_big else 0)
    return start, stop


def node_and_local_rank(rank: int, nproc_per_node: int) -> tuple[int, int]:
    return divmod(rank, nproc_per_node)
