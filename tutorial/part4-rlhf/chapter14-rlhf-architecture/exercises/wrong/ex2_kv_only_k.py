"""Mistake for ch14.2: the KV cache counts K only (forgot the factor 2 for K and V)."""

from __future__ import annotations


def trained_bytes(num_params: int, num_gpus: int) -> float:
    return num_params * (2 + 2 + 12) / num_gpus


def frozen_bytes(num_params: int, num_gpus: int) -> float:
    return num_params * 2 / num_gpus


def kv_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, num_seqs: float, seq_len: int) -> float:
    return num_layers * num_kv_heads * head_dim * 2 * num_seqs * seq_len


def generation_bytes_per_gpu(actor_params: int, critic_params: int, num_gpus: int, num_layers: int,
                             num_kv_heads: int, head_dim: int, num_seqs: int, seq_len: int) -> float:
    shards = (trained_bytes(actor_params, num_gpus) + trained_bytes(critic_params, num_gpus)
              + frozen_bytes(critic_params, num_gpus) + frozen_bytes(actor_params, num_gpus))
    engine = actor_params * 2
    kv = kv_cache_bytes(num_layers, num_kv_heads, head_dim, num_seqs / num_gpus, seq_len)
    return shards + engine + kv
