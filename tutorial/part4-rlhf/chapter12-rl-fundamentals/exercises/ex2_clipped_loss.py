"""Exercise ch12.2 — PPO's clipped surrogate loss and its diagnostics.

PPO (https://arxiv.org/abs/1707.06347, eq. 7) maximizes E[min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)] with
ratio = pi_new(a|s) / pi_old(a|s) = exp(logp_new - logp_old). As a loss to minimize, negate it: the mean over
samples of max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)). Where the ratio has already moved past 1 +/- eps
in the direction A favours, the clipped term wins and that sample's gradient is zero.
Check your work:  make check EX=ch12.2
"""

from __future__ import annotations

from torch import Tensor


def clipped_loss(logp_new: Tensor, logp_old: Tensor, advantages: Tensor, clip_eps: float) -> Tensor:
    """The scalar PPO policy loss (differentiable in logp_new); all inputs the same shape."""
    raise NotImplementedError("TODO: ratio = exp(logp_new - logp_old); mean of max(-A * ratio, -A * clipped ratio)")


def clip_fraction(logp_new: Tensor, logp_old: Tensor, clip_eps: float) -> float:
    """Share of samples whose ratio lies outside [1 - eps, 1 + eps]."""
    raise NotImplementedError("TODO: mean of (|ratio - 1| > eps)")


def approx_kl(logp_new: Tensor, logp_old: Tensor) -> float:
    """The k3 estimate of KL(old || new) from samples of the old policy: mean((ratio - 1) - log ratio), >= 0."""
    raise NotImplementedError("TODO: with log ratio = logp_new - logp_old")
