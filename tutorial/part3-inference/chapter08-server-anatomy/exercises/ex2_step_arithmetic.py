"""Exercise ch08.2 — warm-up: the FLOPs and bytes of one engine step, and which one limits it.

One forward over S sequences: sequence s computes q_lens[s] new tokens that attend to kv_lens[s] positions (its
cache plus the new tokens themselves). For the book's GPT (n_layer layers of width C = n_embd, vocabulary V):

    linear FLOPs    = 2 * 12 * n_layer * C^2 per new token   (qkv 3C^2, attention output C^2, MLP 8C^2)
    attention FLOPs = 4 * C per (query, key) pair per layer, for the pairs the causal mask keeps
    head FLOPs      = 2 * C * V per row of logits
    bytes           = every weight read once + K and V (2 * n_layer * C values) read for all kv_lens positions
                      and written for the new tokens

A step is memory-bound when its arithmetic intensity (FLOPs per byte) is below the processor's ridge point
(peak FLOP/s divided by memory bandwidth). See "Prefill and decode are different workloads" in the lesson.
Check your work:  make check EX=ch08.2
"""

from __future__ import annotations


def attention_pairs(q: int, k: int) -> int:
    """(query, key) pairs the causal mask keeps when q new tokens are the last q of k positions.

    New token i (0-based) sees the k - q cached positions, the i new tokens before it and itself.
    A prefill (q = k = L) has L(L+1)/2 pairs; a decode step (q = 1) has k.
    """
    raise NotImplementedError("TODO: q * (cached positions) + the triangle among the q new tokens")


def step_flops(n_layer: int, n_embd: int, vocab_size: int, q_lens: list[int], kv_lens: list[int],
               num_logits: int) -> int:
    """Useful matmul FLOPs of one step: linear + attention (kept pairs only) + the head for num_logits rows."""
    raise NotImplementedError("TODO: 24 * n_layer * C^2 per token + 4 * n_layer * C per pair + 2 * C * V per row")


def step_bytes(num_params: int, n_layer: int, n_embd: int, q_lens: list[int], kv_lens: list[int],
               dtype_bytes: int = 4) -> int:
    """Bytes the step must move: weights once, K and V read for every kv position and written for every new token."""
    raise NotImplementedError("TODO: num_params * dtype_bytes + 2 * n_layer * C * dtype_bytes * (positions)")


def memory_bound(flops: float, nbytes: float, peak_flops: float, bandwidth: float) -> bool:
    """True when flops / nbytes lies below the ridge point peak_flops / bandwidth."""
    raise NotImplementedError("TODO: compare the step's intensity with the processor's ridge point")
