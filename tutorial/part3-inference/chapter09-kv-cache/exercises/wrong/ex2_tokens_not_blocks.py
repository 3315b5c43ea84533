"""Mistake for ch09.2: divides the budget by seq_len tokens, ignoring that sequences take whole blocks."""

from __future__ import annotations


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float) -> float:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def max_sequences(gpu_bytes: float, weight_bytes: float, bytes_per_token: float, reserve_fraction: float,
                  seq_len: int, block_size: int) -> int:
    budget = max(0.0, gpu_bytes * (1 - reserve_fraction) - weight_bytes)
    return int(budget // (bytes_per_token * seq_len))


def waste(seq_lens: list[int], block_size: int) -> tuple[float, float]:
    used = sum(seq_lens)
    paged = sum(-(-n // block_size) for n in seq_lens) * block_size
    reserved = len(seq_lens) * max(seq_lens)
    return 1 - used / paged, 1 - used / reserved
