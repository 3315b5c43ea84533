"""Reference solution for ch07.4 — the interleaved bubble, and idle shares from any schedule's action order."""

from __future__ import annotations


def interleaved_bubble(num_ranks: int, num_micro: int, stages_per_rank: int) -> float:
    # idle (p - 1) stage-times of (T_F + T_B) / v against m (T_F + T_B) of work: (p - 1) / (v m + p - 1)
    return (num_ranks - 1) / (stages_per_rank * num_micro + num_ranks - 1)


def idle_shares(orders: dict[int, list[tuple[str, int, int]]], num_stages: int,
                cost: dict[str, float]) -> list[float]:
    finished: dict[tuple[str, int, int], float] = {}  # ("F" | "BI" | "W", stage, mb) -> end time
    free = dict.fromkeys(orders, 0.0)
    busy = dict.fromkeys(orders, 0.0)
    nxt = dict.fromkeys(orders, 0)
    while any(nxt[r] < len(orders[r]) for r in orders):
        progressed = False
        for r in orders:
            if nxt[r] == len(orders[r]):
                continue
            kind, s, i = orders[r][nxt[r]]
            if kind == "F":
                dep = ("F", s - 1, i) if s > 0 else None
            elif kind in "BI":
                dep = ("F", s, i) if s == num_stages - 1 else ("BI", s + 1, i)
            else:
                dep = ("BI", s, i)
            if dep is not None and dep not in finished:
                continue  # its input is not there yet: try the other ranks first
            start = max(free[r], finished[dep] if dep else 0.0)
            free[r] = start + cost[kind]
            busy[r] += cost[kind]
            finished[("BI" if kind in "BI" else kind, s, i)] = free[r]
            nxt[r] += 1
            progressed = True
        if not progressed:
            raise ValueError("the orders deadlock")
    span = max(free.values())
    return [1.0 - busy[r] / span for r in sorted(orders)]
