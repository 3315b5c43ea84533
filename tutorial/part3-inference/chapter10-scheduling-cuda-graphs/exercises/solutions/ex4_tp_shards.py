"""Reference solution of ch10.4 (the shards of tensor-parallel serving)."""

from __future__ import annotations

import torch


def kv_heads_of_rank(rank: int, size: int, num_heads: int, num_kv_heads: int) -> list[int]:
    group = num_heads // num_kv_heads  # query heads per K/V head
    per_rank = num_heads // size
    return sorted({h // group for h in range(rank * per_rank, (rank + 1) * per_rank)})


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
