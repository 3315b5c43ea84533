"""Exercise ch09.2 — warm-up: how big is the KV cache, how many requests fit, and what paging saves.

    bytes per token = 2 (K and V) * layers * kv_heads * head_dim * bytes per element

With grouped-query attention kv_heads is the number of K/V heads, not of query heads (Llama-3-8B: 8, not 32).
On a GPU of gpu_bytes, keep reserve_fraction back for activations and the CUDA context, subtract the weights,
and cut what remains into whole blocks of block_size tokens; a sequence of seq_len tokens needs
ceil(seq_len / block_size) whole blocks. Your numbers must equal mlsys.kv_memory's.
Check your work:  make check EX=ch09.2
"""

from __future__ import annotations


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float) -> float:
    """Bytes of K and V one token holds across all layers."""
    raise NotImplementedError("TODO: 2 * layers * kv_heads * head_dim * dtype_bytes")


def max_sequences(gpu_bytes: float, weight_bytes: float, bytes_per_token: float, reserve_fraction: float,
                  seq_len: int, block_size: int) -> int:
    """How many sequences of seq_len tokens fit in the KV budget, counted in whole blocks (0 if none)."""
    raise NotImplementedError("TODO: budget -> whole blocks -> blocks per sequence -> sequences")


def waste(seq_lens: list[int], block_size: int) -> tuple[float, float]:
    """(paged, reserved): the share of held token slots that hold nothing, 1 - used / held.

    paged: each sequence holds ceil(len / block_size) blocks; reserved: each sequence holds max(seq_lens) slots
    from the start, the way a contiguous per-request cache must.
    """
    raise NotImplementedError("TODO: used = sum of lengths; held paged vs held reserved")
