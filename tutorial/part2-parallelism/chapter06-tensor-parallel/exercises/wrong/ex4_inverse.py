"""A mistake for ch06.4: the inverse permutation (where each row goes, not which row comes here). weight[order]
needs the second; argsort of it gives the first."""

from __future__ import annotations

import torch


def head_order(C, tp):
    per = C // tp
    right = torch.cat([torch.arange(part * C + r * per, part * C + (r + 1) * per)
                       for r in range(tp) for part in range(3)])
    return torch.argsort(right)
