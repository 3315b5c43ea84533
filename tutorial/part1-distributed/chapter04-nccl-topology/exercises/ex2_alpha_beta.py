"""Exercise ch04.2 (warm-up) — the alpha-beta model of the lesson: what an all-reduce of n bytes costs with each of
the three algorithms, and the size where the ring starts to beat the tree. Pure arithmetic.

Check your work:  make check EX=ch04.2
"""

from __future__ import annotations


def tree_fan_sum(world_size: int) -> int:
    """K: over the levels of the heap-ordered binary tree (children of r are 2r+1, 2r+2 when < world_size),
    the sum of the most children any one parent at that level has. The busiest parent's link carries K * n bytes
    on the way up. Examples: K = 3 for 4 ranks (2 at the root, 1 below), 4 for 5 ranks, 0 for 1 rank."""
    raise NotImplementedError("TODO: walk the levels; per level, the largest number of children of its ranks")


def all_reduce_time(algorithm: str, num_bytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Model time a * alpha + b * num_bytes * beta of one all-reduce of `num_bytes` on p = world_size ranks:

        "ring":              a = 2(p - 1),          b = 2(p - 1) / p
        "tree":              a = 2 floor(log2 p),   b = 2 K   (K = tree_fan_sum(p))
        "halving-doubling":  a = 2 log2 p,          b = 2(p - 1) / p   (p must be a power of two, else ValueError)

    An unknown algorithm raises ValueError. One rank costs nothing: 0.0 for every algorithm.
    """
    raise NotImplementedError("TODO: the (steps, bytes factor) of each algorithm, then a * alpha + b * n * beta")


def crossover_bytes(world_size: int, alpha: float, beta: float) -> float | None:
    """The message size n* where the ring and the tree take the same model time (the tree is faster below it).

    n* = alpha (a_ring - a_tree) / (beta (b_tree - b_ring)). None when there is no crossover: the ring has no
    more steps than the tree (p <= 2), or the tree moves no more bytes than the ring, or beta <= 0.
    """
    raise NotImplementedError("TODO: solve a_ring alpha + b_ring n beta = a_tree alpha + b_tree n beta for n")
