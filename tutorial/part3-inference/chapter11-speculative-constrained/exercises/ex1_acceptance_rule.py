"""Exercise ch11.1 — the acceptance rule of speculative sampling.

The draft proposed k tokens d_0..d_{k-1}, token d_i drawn from the draft's distribution q[i]. The target scored
them in one forward pass: p[i] is its distribution at the position of d_i, and p[k] the one after all k drafts.
Keep the target's distribution exactly (Leviathan et al. 2022, https://arxiv.org/abs/2211.17192, Algorithm 1):

    for i in 0..k-1: accept d_i with probability min(1, p[i][d_i] / q[i][d_i]); stop at the first rejection
    rejected at i:   the next token is drawn from normalize(max(0, p[i] - q[i]))
    all k accepted:  the next ("bonus") token is drawn from p[k]

Check your work:  make check EX=ch11.1
"""

from __future__ import annotations

import torch


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) along the last dim: p, q (V,) -> (V,) summing to 1 (return p if p == q)."""
    raise NotImplementedError("TODO: clamp p - q at 0, divide by its sum")


def verify_sampled(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                   generator: torch.Generator | None = None) -> tuple[int, int]:
    """p (k+1, V), q (k, V), drafts (k,) -> (j, next token): j drafts accepted, then one token drawn as above.

    Draw every random number from `generator` (torch.rand / torch.multinomial with generator=generator)."""
    raise NotImplementedError("TODO: a uniform per draft, accept while u < p/q, then residual or bonus draw")
