"""Exercise ch10.4 — the shards of tensor-parallel serving: which heads, which rows, how many bytes.

With tensor_parallel_size N, rank r holds the query heads r*H/N .. (r+1)*H/N - 1, the rows of q_proj that compute
them (head h is rows h*D .. (h+1)*D - 1), and the K/V heads those query heads read: with grouped-query attention
query head h reads K/V head h // (H / H_kv). When N divides H_kv each rank keeps H_kv / N K/V heads; when N is a
multiple of H_kv each keeps the one its query heads share (replicated on N / H_kv ranks), as vLLM does.
o_proj is split the other way, by its input columns. Each decoder layer ends its attention and its MLP with an
all-reduce of the (tokens, hidden) partial sums.
Check your work:  make check EX=ch10.4
"""

from __future__ import annotations

import torch


def kv_heads_of_rank(rank: int, size: int, num_heads: int, num_kv_heads: int) -> list[int]:
    """The K/V heads rank `rank` of `size` keeps (their global indices, in order)."""
    raise NotImplementedError("TODO: the K/V heads that this rank's query heads read (h // group for each)")


def shard_attention(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, rank: int, size: int,
                    num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, ...]:
    """Dense q_proj (H*D, C), k_proj and v_proj (H_kv*D, C), o_proj (C, H*D) -> this rank's four slices."""
    raise NotImplementedError("TODO: rows of q/k/v for this rank's heads, the matching input columns of o_proj")


def all_reduce_bytes_per_step(num_layers: int, num_tokens: int, hidden: int, dtype_bytes: int) -> int:
    """Bytes given to all-reduce in one step of `num_tokens` tokens (the buffer size of each call, summed)."""
    raise NotImplementedError("TODO: two all-reduces per layer, each of (tokens, hidden) elements")
