"""Reference solution for ch09.3 — prefix caching with an eviction policy (see ../ex3_prefix_cache.py)."""

from __future__ import annotations


def block_keys(tokens: list[int], block_size: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[: (j + 1) * block_size]) for j in range(len(tokens) // block_size)]


def cache_hits(prompts: list[list[int]], block_size: int, capacity_blocks: int | None = None,
               policy: str = "lru") -> list[int]:
    cache: dict[tuple[int, ...], int] = {}  # key -> time it was last used (lru) or first stored (fifo)
    hits = []
    for now, prompt in enumerate(prompts):
        keys = block_keys(prompt, block_size)
        usable, n = (len(prompt) - 1) // block_size, 0
        while n < usable and keys[n] in cache:
            n += 1
        hits.append(n * block_size)
        for key in keys:
            if policy == "lru" or key not in cache:
                cache[key] = now
        while capacity_blocks is not None and len(cache) > capacity_blocks:
            victim = min(cache, key=lambda k: (cache[k], -len(k)))  # oldest first, deepest first on a tie
            del cache[victim]
    return hits
