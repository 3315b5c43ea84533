"""Mistake for ch11.1: when every draft is accepted the bonus token is drawn from p[k-1], the last draft's position."""

from __future__ import annotations

import torch


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp_min(0.0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


def verify_sampled(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                   generator: torch.Generator | None = None) -> tuple[int, int]:
    k = drafts.numel()
    for i in range(k):
        d = int(drafts[i])
        u = float(torch.rand((), generator=generator))
        if u >= min(1.0, float(p[i, d] / q[i, d])):  # rejected: redraw from what p has and q lacks
            return i, int(torch.multinomial(residual(p[i], q[i]), 1, generator=generator))
    return k, int(torch.multinomial(p[k - 1], 1, generator=generator))  # all accepted: the bonus token
