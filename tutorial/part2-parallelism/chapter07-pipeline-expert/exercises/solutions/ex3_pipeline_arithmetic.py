"""Reference solution for ch07.3 — bubble, micro-batches, activations in flight, mesh coordinates."""

from __future__ import annotations

import math


def bubble_fraction(num_stages: int, num_micro: int) -> float:
    return (num_stages - 1) / (num_micro + num_stages - 1)


def micro_batches_for(num_stages: int, max_bubble: float) -> int:
    # (p - 1) / (m + p - 1) <= b  <=>  m >= (p - 1)(1 - b) / b
    m = max(1, math.ceil((num_stages - 1) * (1 - max_bubble) / max_bubble - 1e-9))
    while bubble_fraction(num_stages, m) > max_bubble:  # guard against rounding
        m += 1
    return m


def peak_in_flight(schedule: str, stage: int, num_stages: int, num_micro: int) -> int:
    if schedule == "gpipe":
        return num_micro
    if schedule == "1f1b":
        return min(num_stages - stage, num_micro)
    raise ValueError(f"unknown schedule {schedule!r}")


def mesh_coords(rank: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
    rest, tp_index = divmod(rank, tp)
    pp_index, dp_index = divmod(rest, dp)
    return pp_index, dp_index, tp_index
