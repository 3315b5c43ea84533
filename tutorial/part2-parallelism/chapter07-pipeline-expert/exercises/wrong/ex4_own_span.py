"""A mistake for ch07.4: each rank's idle share over its OWN first-to-last span, which misses the ramp at its ends."""

from __future__ import annotations


def interleaved_bubble(num_ranks: int, num_micro: int, stages_per_rank: int) -> float:
    return (num_ranks - 1) / (stages_per_rank * num_micro + num_ranks - 1)


def idle_shares(orders: dict[int, list[tuple[str, int, int]]], num_stages: int,
                cost: dict[str, float]) -> list[float]:
    finished: dict[tuple[str, int, int], float] = {}
    free = dict.fromkeys(orders, 0.0)
    first = dict.fromkeys(orders, None)
    busy = dict.fromkeys(orders, 0.0)
    nxt = dict.fromkeys(orders, 0)
    while any(nxt[r] < len(orders[r]) for r in orders):
        for r in orders:
            if nxt[r] == len(orders[r]):
                continue
            kind, s, i = orders[r][nxt[r]]
            dep = (("F", s - 1, i) if s > 0 else None) if kind == "F" else \
                (("F", s, i) if s == num_stages - 1 else ("BI", s + 1, i)) if kind in "BI" else ("BI", s, i)
            if dep is not None and dep not in finished:
                continue
            start = max(free[r], finished[dep] if dep else 0.0)
            first[r] = start if first[r] is None else first[r]
            free[r] = start + cost[kind]
            busy[r] += cost[kind]
            finished[("BI" if kind in "BI" else kind, s, i)] = free[r]
            nxt[r] += 1
    return [1.0 - busy[r] / (free[r] - first[r]) for r in sorted(orders)]
