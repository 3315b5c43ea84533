"""A mistake for ch04.2: the tree's depth rounded up, ceil(log2 p) levels instead of floor(log2 p)."""

import math


def tree_fan_sum(world_size):
    total, level = 0, [0]
    while level:
        children = [[c for c in (2 * r + 1, 2 * r + 2) if c < world_size] for r in level]
        total += max(len(c) for c in children)
        level = [c for cs in children for c in cs]
    return total


def _terms(algorithm, p):
    if algorithm == "ring":
        return 2 * (p - 1), 2 * (p - 1) / p
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(p)), 2 * tree_fan_sum(p)
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
    return alpha * (a_ring - a_tree) / (beta * (b_tree - b_ring))
