"""Mistake for ch11.2: the mask forgets the character itself costs one: dist[next] <= remaining."""

from __future__ import annotations

from collections import deque

INF = 1 << 30


def min_tokens_to_close(trans: list[dict[str, int]], accepting: set[int]) -> list[int]:
    rev: list[list[int]] = [[] for _ in trans]
    for s, edges in enumerate(trans):
        for dst in edges.values():
            rev[dst].append(s)
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
    out = {c for c, nxt in trans[state].items() if dist[nxt] <= remaining}
    return out | {"<eos>"} if state in accepting else out
