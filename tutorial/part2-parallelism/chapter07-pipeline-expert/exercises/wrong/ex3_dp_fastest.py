"""A mistake for ch07.3: the mesh with the data-parallel index changing fastest, and GPipe's peak as p."""

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
        return num_stages
    if schedule == "1f1b":
        return min(num_stages - stage, num_micro)
    raise ValueError(f"unknown schedule {schedule!r}")


def mesh_coords(rank: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
    rest, dp_index = divmod(rank, dp)
    pp_index, tp_index = divmod(rest, tp)
    return pp_index, dp_index, tp_index
