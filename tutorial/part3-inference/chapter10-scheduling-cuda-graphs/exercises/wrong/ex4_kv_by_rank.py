"""A plausible mistake in ch10.4: K/V heads split by rank as if there were always at least one per rank
(rank r keeps head r), which reads the wrong head once N exceeds the K/V heads."""

from __future__ import annotations

import torch


def kv_heads_of_rank(rank: int, size: int, num_heads: int, num_kv_heads: int) -> list[int]:
    per_rank = max(1, num_kv_heads // size)
    return [min(rank * per_rank + i, num_kv_heads - 1) for i in range(per_rank)]


def shard_attention(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, rank: int, size: int,
                    num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, ...]:
    D = wq.shape[0] // num_heads
    h = num_heads // size
    kv = kv_heads_of_rank(rank, size, num_heads, num_kv_heads)
    rows = slice(rank * h * D, (rank + 1) * h * D)
    kv_rows = slice(kv[0] * D, (kv[-1] + 1) * D)
    return wq[rows], wk[kv_rows], wv[kv_rows], wo[:, rows]


def all_reduce_bytes_per_step(num_layers: int, num_tokens: int, hidden: int, dtype_bytes: int) -> int:
    return 2 * num_layers * num_tokens * hidden * dtype_bytes
