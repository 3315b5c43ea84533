"""Reference solution for ch06.4 — the row order that gives each tensor-parallel rank its own heads' q, k, v."""

from __future__ import annotations

import torch


def head_order(C: int, tp: int) -> torch.Tensor:
    per = C // tp  # features of one rank's heads
    return torch.cat([torch.arange(part * C + r * per, part * C + (r + 1) * per)  # part 0, 1, 2: q, k, v
                      for r in range(tp) for part in range(3)])
