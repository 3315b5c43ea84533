"""A mistake for ch04.2: assumes every parent has two children, K = 2 per level, and the crossover's sign flipped
(n* = alpha (a_tree - a_ring) / ...), which is negative."""

import math


def tree_fan_sum(world_size):
    return 2 * (world_size.bit_length() - 1)


def _terms(algorithm, p):
    if algorithm == "ring":
        return 2 * (p - 1), 2 * (p - 1) / p
    if algorithm == "tree":
        return 2 * (p.bit_length() - 1), 2 * tree_fan_sum(p)
    if algorithm == "halving-doubling":
        if p & (p - 1):
            raise ValueError(p)
        return 2 * math.log2(p), 2 * (p - 1) / p
    raise ValueError(algorithm)


def all_reduce_time(algorithm, num_bytes, world_size, alpha, beta):
    steps, factor = _terms(algorithm, world_size)
    return steps * alpha + factor * num_bytes * beta


def crossover_bytes(world_size, alpha, beta):
    (a_ring, b_ring), (a_tree, b_tree) = _terms("ring", world_size), _terms("tree", world_size)
    if a_ring <= a_tree or b_tree <= b_ring or beta <= 0:
        return None
    return alpha * (a_tree - a_ring) / (beta * (b_tree - b_ring))
