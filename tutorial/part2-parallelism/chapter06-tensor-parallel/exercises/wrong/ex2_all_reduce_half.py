"""A mistake for ch06.2: an all-reduce counted as (t-1)/t N like an all-gather, forgetting its factor 2."""

from __future__ import annotations


def block_comm_bytes(batch: int, seq: int, hidden: int, tp: int, dtype_bytes: int,
                     sequence_parallel: bool) -> tuple[float, float]:
    n = batch * seq * hidden * dtype_bytes
    half = (tp - 1) / tp * n  # one all-gather or one reduce-scatter; an all-reduce is two of these
    if sequence_parallel:
        return 2 * (half + half), 2 * (half + half + half)
    return 2 * half, 2 * half


def block_activation_bytes(batch: int, seq: int, hidden: int, heads: int, tp: int, dtype_bytes: int,
                           sequence_parallel: bool) -> float:
    sbh, sb = seq * batch * hidden, seq * batch
    if sequence_parallel:
        return dtype_bytes * (sbh * 16 / tp + 4 * sb / tp + heads * sb / tp)
    return dtype_bytes * (sbh * (4 + 12 / tp) + 4 * sb + heads * sb / tp)


def sp_saving(tp: int) -> float:
    return (tp + 3) / 4
