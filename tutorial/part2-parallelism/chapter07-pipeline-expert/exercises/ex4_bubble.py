"""Exercise ch07.4 (extend) — the bubble of any schedule, read off its action order.

A schedule is, for every rank, the order of its compute actions: ("F", stage, micro-batch) forward, ("B", stage, mb)
full backward, and for zero-bubble schedules ("I", stage, mb) input gradient and ("W", stage, mb) weight gradient.
`orders[rank]` lists them in the order the rank runs them; stages are numbered 0..n-1 along the model, and the
last stage (n - 1) is the one that computes the loss. Plain Python, no ranks.
Check your work:  make check EX=ch07.4
"""

from __future__ import annotations


def interleaved_bubble(num_ranks: int, num_micro: int, stages_per_rank: int) -> float:
    """The idle fraction of every rank under interleaved 1F1B with p ranks, m micro-batches and v stages per rank
    (equal stages, messages free). v = 1 is plain 1F1B: (p - 1) / (m + p - 1). Example: p=4, m=8, v=2 -> 3/19."""
    raise NotImplementedError("TODO: the ramp is still p - 1 stage-times, but a stage is 1/v of a rank's layers")


def idle_shares(orders: dict[int, list[tuple[str, int, int]]], num_stages: int,
                cost: dict[str, float]) -> list[float]:
    """Each rank's idle fraction of the ideal timeline of `orders`, in rank order.

    Every rank runs its actions one after the other, in its order, each as soon as the rank is free AND the action's
    input exists: F(s, i) needs F(s-1, i) finished (stage 0 needs nothing); B(s, i) and I(s, i) need B or I of
    (s+1, i) finished, and on the last stage its own F(s, i); W(s, i) needs I(s, i). An action of kind k takes
    cost[k]; messages take no time. The step runs from the first start on any rank (time 0) to the last end on any
    rank; a rank's idle fraction is 1 - (its busy time) / (that span).
    Example: orders {0: [F0.0, F0.1, B0.0, B0.1], 1: [F1.0, F1.1, B1.0, B1.1]} (GPipe, p = 2, m = 2) with
    cost F 1, B 2: rank 0 idles from 2 to 5, rank 1 from 0 to 1 and 7 to 9: [1/3, 1/3].
    """
    raise NotImplementedError("TODO: loop until every rank is done; run the next action of any rank whose input is "
                              "ready, at max(rank free, input finished)")
