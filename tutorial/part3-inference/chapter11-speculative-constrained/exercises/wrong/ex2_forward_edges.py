"""Mistake for ch11.2: searches along the edges forward instead of reversing them."""

from __future__ import annotations

from collections import deque

INF = 1 << 30


def min_tokens_to_close(trans: list[dict[str, int]], accepting: set[int]) -> list[int]:
    rev: list[list[int]] = [[] for _ in trans]
    for s, edges in enumerate(trans):
        for dst in edges.values():
            rev[s].append(dst)
    dist = [INF] * len(trans)
    for s in accepting:
        dist[s] = 0
    queue = deque(accepting)
    while queue:  # every edge costs one character, so breadth-first order is shortest-first
        s = queue.popleft()
        for prev in rev[s]:
            if dist[prev] == INF:
                dist[prev] = dist[s] + 1
                queue.append(prev)
    return dist


def allowed(trans: list[dict[str, int]], dist: list[int], accepting: set[int], state: int,
            remaining: int) -> set[str]:
    out = {c for c, nxt in trans[state].items() if 1 + dist[nxt] <= remaining}
    return out | {"<eos>"} if state in accepting else out
