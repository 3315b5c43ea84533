"""Exercise ch11.3 — warm-up: the cost model of speculative decoding, and the best k.

If each draft token is accepted with probability alpha, independently, and the first rejection ends the step,
a step emits the accepted drafts plus one token from the target (the correction or the bonus):

    E[tokens per step] = 1 + alpha + alpha^2 + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)   (k + 1 at alpha = 1)

A step costs k draft forwards (c_draft each, relative to one plain target decode step) and one target forward
over k + 1 tokens (c_verify, relative too), so

    speed-up(k) = E[tokens per step] / (k * c_draft + c_verify)

Check your work:  make check EX=ch11.3
"""

from __future__ import annotations


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens per step] for acceptance rate alpha (0 <= alpha <= 1) and k drafts."""
    raise NotImplementedError("TODO: the geometric sum 1 + alpha + ... + alpha^k (mind alpha == 1)")


def speedup(alpha: float, k: int, c_draft: float, c_verify: float) -> float:
    """Plain decode steps replaced per unit of cost: E[tokens per step] / (k * c_draft + c_verify)."""
    raise NotImplementedError("TODO: expected tokens over the cost of one speculative step")


def best_k(alpha: float, c_draft: float, c_verify: float, k_max: int) -> int:
    """The k in 1..k_max with the largest speed-up (the smallest such k on a tie)."""
    raise NotImplementedError("TODO: evaluate speedup for every k and keep the best")
