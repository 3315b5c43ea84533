"""Exercise ch14.2 — RLHF memory arithmetic: what one GPU holds while the co-located system generates.

Four models share num_gpus GPUs, each sharded with ZeRO-3 (weights, gradients and optimizer state divided evenly):
  * actor and critic are trained: bf16 weights (2 B) + bf16 gradients (2 B) + fp32 master weights, Adam m and v
    (4 + 4 + 4 B) = 16 B per parameter;
  * reward model and reference are frozen: bf16 weights only, 2 B per parameter.
  The reward model has the critic's size, the reference the actor's.
While generating, each GPU also holds the inference engine's full bf16 copy of the actor (no tensor parallelism)
and the KV cache of its share of the rollout batch: 2 (K and V) * layers * kv_heads * head_dim * 2 B per token,
for num_seqs / num_gpus sequences of seq_len tokens. (Grouped-query attention: kv_heads, not query heads.)
Check your work:  make check EX=ch14.2
"""

from __future__ import annotations


def trained_bytes(num_params: int, num_gpus: int) -> float:
    """Bytes of a trained model's weights + gradients + Adam state on one of num_gpus GPUs."""
    raise NotImplementedError("TODO: 16 bytes per parameter, divided over the GPUs")


def frozen_bytes(num_params: int, num_gpus: int) -> float:
    """Bytes of a frozen model's bf16 weights on one of num_gpus GPUs."""
    raise NotImplementedError("TODO: 2 bytes per parameter, divided over the GPUs")


def kv_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, num_seqs: float, seq_len: int) -> float:
    """bf16 K and V of num_seqs sequences of seq_len tokens."""
    raise NotImplementedError("TODO: 2 * layers * kv_heads * head_dim * 2 B per token, times tokens")


def generation_bytes_per_gpu(actor_params: int, critic_params: int, num_gpus: int, num_layers: int,
                             num_kv_heads: int, head_dim: int, num_seqs: int, seq_len: int) -> float:
    """Per-GPU bytes during generation: the four models' shards + the engine's bf16 actor + this GPU's KV cache."""
    raise NotImplementedError("TODO: add up the four shards, the engine copy and the KV cache of num_seqs/num_gpus")
