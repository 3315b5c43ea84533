"""Exercise ch01.1 — rank arithmetic. Pure functions: no processes yet.

Check your work:  make check EX=ch01.1
"""

from __future__ import annotations


def shard_bounds(num_items: int, rank: int, world_size: int) -> tuple[int, int]:
    """The [start, stop) slice of `num_items` items that `rank` owns.

    Split into `world_size` contiguous pieces whose sizes differ by at most one, the larger pieces first
    (so ranks 0..r-1 get one extra item when num_items % world_size == r). Every item is owned by exactly one rank;
    a rank may own nothing when there are fewer items than ranks.
    Example: 10 items over 4 ranks -> (0, 3), (3, 6), (6, 8), (8, 10).
    """
    raise NotImplementedError("TODO: compute the base size, the remainder, then this rank's start")


def node_and_local_rank(rank: int, nproc_per_node: int) -> tuple[int, int]:
    """Where global `rank` runs when torchrun starts `nproc_per_node` processes on each node: (node, local_rank).

    torchrun numbers ranks node by node: node 0 holds ranks 0..nproc_per_node-1, node 1 the next ones, and so on.
    Example: rank 5 with 4 processes per node -> (1, 1).
    """
    raise NotImplementedError("TODO: one integer division and one remainder")
