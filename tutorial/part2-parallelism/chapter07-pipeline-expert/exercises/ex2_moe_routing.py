"""Exercise ch07.2 — mixture-of-experts routing: top-k gates, expert capacity with dropped tokens, and the
Switch Transformers load-balancing loss. Pure tensor code, one process.

Check your work:  make check EX=ch07.2
"""

from __future__ import annotations

import math  # noqa: F401  (you may need it)

import torch
import torch.nn.functional as F  # noqa: F401  (you may need it)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (N, E) -> (probs (N, E), weights (N, k), experts (N, k)).

    probs is the softmax over the E experts. experts holds the ids of the k most probable experts of each token,
    most probable first, and weights their probabilities; with renormalize=True the k weights of a token are
    divided by their sum so they add up to 1.
    """
    raise NotImplementedError("TODO: softmax, then topk, then (optionally) divide by the sum of the k weights")


def keep_mask(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """experts (N, k) -> keep (N, k) bool: True where the assignment gets one of its expert's `capacity` slots.

    Slots are handed out in priority order: first the FIRST choices of all tokens (token 0, 1, ..., N-1), then
    the second choices of all tokens, and so on. An assignment that finds its expert full is dropped (False).
    Hint: lay the choices out choice-major, one-hot them, and a cumulative sum gives each assignment's slot.
    """
    raise NotImplementedError("TODO: the slot of each assignment = earlier assignments to the same expert")


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch Transformers' auxiliary loss E * sum_i f_i * P_i (a 0-dim tensor).

    f_i: fraction of all N*k assignments (before capacity) that went to expert i, not differentiable.
    P_i: mean of probs[:, i] over the N tokens; the gradient flows through P only.
    """
    raise NotImplementedError("TODO: f from a bincount of experts, P from probs.mean(0)")
