"""Exercise ch13.2 — GRPO's critic-free advantages.

GRPO (DeepSeekMath, https://arxiv.org/abs/2402.03300) samples G responses for each prompt and uses the group as
its own baseline: a response's advantage is its score minus the group mean, divided by the group's standard
deviation (plus a small eps), and every token of that response gets the same advantage.
Check your work:  make check EX=ch13.2
"""

from __future__ import annotations

import torch


def group_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """scores (B,), where rows g*G .. g*G + G - 1 answer the same prompt -> advantages (B,).

    Use the sample standard deviation (torch.std's default, dividing by G - 1).
    """
    raise NotImplementedError("TODO: view as (B/G, G), subtract the row mean, divide by row std + eps, flatten")


def token_advantages(scores: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """mask (B, L) of real response tokens -> (B, L): each row's group advantage on its real tokens, 0 on padding."""
    raise NotImplementedError("TODO: group_advantages(...)[:, None] * mask")
