"""A mistake for ch06.5: the new lse is the larger of the two, not log(exp(lse) + exp(block_lse))."""

from __future__ import annotations

import math

import torch


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    new_lse = torch.maximum(lse, block_lse)  # the larger side dominates
    shift = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)  # no (-inf) - (-inf) = NaN
    w_old = torch.exp(lse - shift).unsqueeze(-1)  # each side's share of the total exp-sum; 0 for a side of -inf
    w_new = torch.exp(block_lse - shift).unsqueeze(-1)
    return out * w_old + block_out * w_new, new_lse


def zigzag_chunks(seq: int, world_size: int, rank: int) -> list[tuple[int, int]]:
    c = seq // (2 * world_size)
    late = 2 * world_size - 1 - rank
    return [(rank * c, (rank + 1) * c), (late * c, (late + 1) * c)]


def attention_by_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    S, D = q.shape[-2], q.shape[-1]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    pos = torch.arange(S, device=q.device)
    for a in range(0, S, block):
        b = min(a + block, S)
        s = (q @ k[..., a:b, :].transpose(-1, -2)) / math.sqrt(D)  # (B, H, S, b - a)
        s = s.masked_fill(pos[:, None] < pos[None, a:b], float("-inf"))  # key after query: not seen
        block_lse = torch.logsumexp(s, dim=-1)
        seen = torch.isfinite(block_lse).unsqueeze(-1)  # rows before key a see nothing here: out 0, not NaN
        p = torch.where(seen, torch.exp(s - block_lse.unsqueeze(-1)), torch.zeros_like(s))
        out, lse = merge(out, lse, p @ v[..., a:b, :], block_lse)
    return out
