"""Schedule arithmetic shared by interleaved_zero_bubble.py, its tests and exercise ch07.4.

A schedule's plan is, for every rank, the order of its compute actions: ("F", stage, micro-batch) forward,
("B", stage, mb) full backward, or, for zero-bubble schedules, ("I", stage, mb) the input-gradient half of the
backward and ("W", stage, mb) the weight-gradient half (torch's letters; the zero-bubble paper calls I "B").

    placement(name, p, v)          which rank holds each stage
    planned_orders(name, p, v, m)  torch's own plan, read from the schedule object without starting any rank
    replay(orders, placement, ...) the ideal timeline of those orders: every action takes its cost, messages are free
    idle_shares(events)            each rank's idle fraction of the step
    formula(name, p, v, m)         the bubble the literature gives
    peak_held(order, chunks)       most micro-batch activations a rank holds at once
    p2p_messages(name, p, v, m)    point-to-point messages one step sends
"""

from __future__ import annotations

import math
import types
from collections.abc import Sequence
from fractions import Fraction

# name -> (torch.distributed.pipelining class, placement of stages on ranks)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "single"),
    "1f1b": ("Schedule1F1B", "single"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
}
COST = {"F": Fraction(1), "I": Fraction(1), "W": Fraction(1), "B": Fraction(2)}  # T_F = T_I = T_W, B = I + W


def chunks_per_rank(name: str, v: int) -> int:
    """Stages each rank holds: 1 for GPipe and 1F1B, v for the interleaved schedules, always 2 for ZB-V."""
    placement = SCHEDULES[name][1]
    return 1 if placement == "single" else 2 if placement == "v" else v


def placement(name: str, p: int, v: int) -> list[int]:
    """rank of each stage 0..n-1. loop: stage s on rank s mod p; V: down the ranks and back up (0 1 .. p-1 p-1 .. 0)."""
    n = p * chunks_per_rank(name, v)
    if SCHEDULES[name][1] == "v":
        return [s if s < p else n - 1 - s for s in range(n)]
    return [s % p for s in range(n)]


def blocks_per_rank(p: int, v: int) -> int:
    """Layers per rank so that every schedule can cut the same model evenly: lcm(v, 2) (ZB-V needs 2 per rank)."""
    return math.lcm(v, 2)


def planned_orders(name: str, p: int, v: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """The plan of every rank, without a process group.

    Multi-stage schedules compute their plan (`pipeline_order`) in __init__ from the numbers of stages, ranks and
    micro-batches only, so stand-in stages that carry those numbers are enough; the runtime executes exactly
    that plan. GPipe and 1F1B run their own loop instead (torch 2.13's Schedule1F1B.pipeline_order even differs
    from what it runs), so theirs is the book's order, mlsys.pipeline.schedule_actions, which is what they run.
    The script checks both against the actions it logs.
    """
    from torch import nn
    from torch.distributed.pipelining import schedules

    from mlsys.pipeline import schedule_actions

    if SCHEDULES[name][1] == "single":
        return {r: [(k, r, i) for k, i in schedule_actions(name, r, p, m)] for r in range(p)}
    cls = getattr(schedules, SCHEDULES[name][0])
    n = p * chunks_per_rank(name, v)
    stand_ins = [types.SimpleNamespace(num_stages=n, group_size=p, group_rank=0, stage_index=i, submod=nn.Module())
                 for i in range(chunks_per_rank(name, v))]
    schedule = cls(stand_ins, n_microbatches=m)
    return {rank: [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in acts
                   if a is not None and a.computation_type.value in "FBIW"]
            for rank, acts in sorted(schedule.pipeline_order.items())}


# --8<-- [start:replay]
def replay(orders: dict[int, Sequence[tuple[str, int, int]]], where: Sequence[int],
           chunks: int, cost: dict[str, Fraction] = COST) -> dict[int, list[dict]]:
    """The ideal timeline of per-rank action orders: each rank runs its actions in order, each as soon as the rank
    is free and its input exists. F(s, i) needs F(s-1, i); B or I (s, i) needs B or I (s+1, i), the last stage its
    own F(s, i); W(s, i) needs I(s, i). An action on a stage costs cost[kind] / chunks (a rank's layers are cut into
    `chunks` stages), messages take no time. Returns events[rank] = [{kind, stage, mb, start, end}].
    """
    last = len(where) - 1
    done: dict[tuple[str, int, int], Fraction] = {}  # ("F" | "BI" | "W", stage, mb) -> end time
    free = dict.fromkeys(orders, Fraction(0))
    nxt = dict.fromkeys(orders, 0)
    events: dict[int, list[dict]] = {rank: [] for rank in orders}
    while any(nxt[r] < len(orders[r]) for r in orders):
        progressed = False
        for r in orders:
            if nxt[r] == len(orders[r]):
                continue
            kind, s, i = orders[r][nxt[r]]
            if kind == "F":
                dep = ("F", s - 1, i) if s > 0 else None
            elif kind in "BI":
                dep = ("F", s, i) if s == last else ("BI", s + 1, i)
            else:
                dep = ("BI", s, i)
            if dep is not None and dep not in done:
                continue  # wait for a message (or for this rank's own earlier half)
            start = max(free[r], done[dep] if dep else Fraction(0))
            free[r] = start + cost[kind] / chunks
            done[("BI" if kind in "BI" else kind, s, i)] = free[r]
            events[r].append({"kind": kind, "stage": s, "mb": i, "start": start, "end": free[r]})
            nxt[r] += 1
            progressed = True
        if not progressed:
            raise ValueError("the orders deadlock: every rank waits for another")
    return events
# --8<-- [end:replay]


def idle_shares(events: dict[int, list[dict]]) -> list[float]:
    """Each rank's idle fraction of the step: 1 - busy / span, the span from the first start to the last end."""
    start = min(e["start"] for evs in events.values() for e in evs)
    end = max(e["end"] for evs in events.values() for e in evs)
    return [float(1 - sum(e["end"] - e["start"] for e in events[r]) / (end - start)) for r in sorted(events)]


# --8<-- [start:formula]
def formula(name: str, p: int, v: int, m: int) -> float:
    """The bubble (idle fraction) in the literature, for equal stages and T_F = T_I = T_W.

    GPipe, 1F1B:       (p - 1) / (m + p - 1)             idle (p - 1)(T_F + T_B) per rank
    interleaved 1F1B:  (p - 1) / (v m + p - 1)           the same idle cut into v-times-smaller pieces
    zero bubble:       (p - 1) / (3 v m + p - 1)         idle (p - 1)(T_F + T_I - T_W) / v: ZB-H1's, with T_I = T_W
                                                         only the forwards' ramp-up is left
    """
    chunks = chunks_per_rank(name, v)
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved-1f1b":
        return (p - 1) / (chunks * m + p - 1)
    return (p - 1) / (3 * chunks * m + p - 1)
# --8<-- [end:formula]


def formula_holds(name: str, p: int, v: int, m: int) -> bool:
    """Where torch's plan is known to reach the formula: ZB-V plans max(m, 2p - 1) micro-batches and leaves holes."""
    return name != "zbv" or m >= 2 * p - 1


def peak_held(order: Sequence[tuple[str, int, int]], chunks: int) -> float:
    """Most micro-batch activations a rank holds at once, in micro-batches of all its layers: a stage's
    activations are held from its F until its last backward action (B, or W when the backward is split; torch
    keeps the autograd graph for W), and one stage holds 1/chunks of the rank's layers."""
    live = peak = 0
    for kind, _, _ in order:
        live += 1 if kind == "F" else -1 if kind in "BW" else 0
        peak = max(peak, live)
    return peak / chunks


def p2p_messages(name: str, p: int, v: int, m: int) -> int:
    """Messages one step sends between ranks: an activation forward and a gradient back per micro-batch and per
    stage boundary whose two stages sit on different ranks (ZB-V's turn at the last rank stays local)."""
    where = placement(name, p, v)
    crossings = sum(a != b for a, b in zip(where, where[1:]))
    return 2 * m * crossings


# --------------------------------------------------------------------------------------- pictures of a plan
KIND_NAMES = {"F": "F forward", "B": "B backward", "I": "I input grad", "W": "W weight grad"}


def ideal_boxes(orders: dict[int, Sequence[tuple[str, int, int]]], where: Sequence[int], chunks: int,
                cost: dict[str, Fraction] = COST) -> list[dict]:
    """The boxes of the ideal timeline of `orders` (see `replay`): [{rank, kind, stage, mb, start, end}], times
    as floats in units of one micro-batch's forward on a rank. These are what `draw_ideal` draws."""
    events = replay(orders, where, chunks, cost)
    return [{"rank": r, "kind": e["kind"], "stage": e["stage"], "mb": e["mb"],
             "start": float(e["start"]), "end": float(e["end"])} for r in sorted(events) for e in events[r]]


def draw_ideal(ax, boxes: list[dict], title: str, until: float | None = None, legend: bool = True,
               labels: bool = True, lane: str = "rank") -> None:
    """One row per rank, one box per action labelled with its micro-batch; white is idle time. With `until`,
    only what has started by then, cut at `until` (a frame of the filling and draining animation). `lane` names
    the rows ("stage" where each rank runs one stage)."""
    from mlsys import plot

    ranks = sorted({b["rank"] for b in boxes})
    lanes = [f"{lane} {r}" for r in ranks]
    palette = dict(zip(KIND_NAMES.values(), plot.colours(["F", "B", "I", "W"]).values()))
    spans = [plot.Span(f"{lane} {b['rank']}", b["start"], b["end"] if until is None else min(b["end"], until),
                       str(b["mb"]) if labels else "", KIND_NAMES[b["kind"]])
             for b in boxes if until is None or b["start"] < until]
    plot.timeline(ax, spans, lanes, palette=palette, legend=legend, fontsize=7)
    end = max(b["end"] for b in boxes)
    ax.set_xlim(0, end)
    ax.set_xticks(range(0, int(end) + 1, 3 if end > 12 else 1))
    if until is not None:
        ax.axvline(until, color="black", lw=1.2)
    ax.set_title(title, fontsize=9, loc="left")


def idle_ticks(boxes: list[dict]) -> list[float]:
    """Each rank's idle time on the drawn picture: the step's span minus the widths of the rank's boxes."""
    span = max(b["end"] for b in boxes) - min(b["start"] for b in boxes)
    ranks = sorted({b["rank"] for b in boxes})
    return [span - sum(b["end"] - b["start"] for b in boxes if b["rank"] == r) for r in ranks]
