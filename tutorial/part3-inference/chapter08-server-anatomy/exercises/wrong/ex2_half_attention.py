"""Mistake for ch08.2: attention charged 2 * C FLOPs per pair (only q.k, forgetting p.v) and the ridge inverted."""

from __future__ import annotations


def attention_pairs(q: int, k: int) -> int:
    return q * (k - q) + q * (q + 1) // 2


def step_flops(n_layer: int, n_embd: int, vocab_size: int, q_lens: list[int], kv_lens: list[int],
               num_logits: int) -> int:
    C = n_embd
    linear = 2 * 12 * n_layer * C * C * sum(q_lens)
    attention = 2 * n_layer * C * sum(attention_pairs(q, k) for q, k in zip(q_lens, kv_lens))
    return linear + attention + 2 * C * vocab_size * num_logits


def step_bytes(num_params: int, n_layer: int, n_embd: int, q_lens: list[int], kv_lens: list[int],
               dtype_bytes: int = 4) -> int:
    per_position = 2 * n_layer * n_embd * dtype_bytes  # K and V of one position, every layer
    return num_params * dtype_bytes + per_position * (sum(kv_lens) + sum(q_lens))


def memory_bound(flops: float, nbytes: float, peak_flops: float, bandwidth: float) -> bool:
    return flops / nbytes > peak_flops / bandwidth
