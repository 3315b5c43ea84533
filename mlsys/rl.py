"""Reinforcement-learning building blocks shared by Chapter 12 (PPO on CartPole) and Chapter 13 (RLHF on tokens).

Layout convention: time-major tensors of shape (T, N) -- T steps of N parallel environments (Chapter 12) or
N sequences of T tokens transposed (Chapter 13). Everything here is plain torch, no environment code.

Papers:
- GAE: Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
  https://arxiv.org/abs/1506.02438
- PPO: Schulman et al., "Proximal Policy Optimization Algorithms", https://arxiv.org/abs/1707.06347
- approx-KL estimators (k1, k2, k3): J. Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html
"""

from __future__ import annotations

import torch
from torch import Tensor


# --8<-- [start:gae]
def compute_gae(rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor,
                gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation, vectorized over the N columns (GAE paper, eq. 16).

    rewards, values, dones: (T, N); dones[t] = 1 if the episode ended after step t (no bootstrap from t+1).
    last_value: (N,) V(s_T), the value of the state after the last step.  Returns (advantages, returns), both
    (T, N), with returns = advantages + values (the value-function target, "TD(lambda) return").

        delta_t = r_t + gamma * V(s_{t+1}) * (1 - done_t) - V(s_t)        one-step TD error
        A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1}            the backwards recursion
    lam = 0 gives A_t = delta_t (TD(0), low variance, biased by V); lam = 1 gives the discounted Monte-Carlo
    return minus V(s_t) (unbiased, high variance).
    """
    T = rewards.shape[0]
    not_done = 1.0 - dones.to(values.dtype)                     # (T, N)
    next_values = torch.cat([values[1:], last_value[None]], 0)  # (T, N): V(s_{t+1})
    deltas = rewards + gamma * next_values * not_done - values  # (T, N)
    advantages = torch.zeros_like(values)
    next_adv = torch.zeros_like(last_value)                     # (N,): A_T = 0
    for t in reversed(range(T)):                                # a loop over time only; all N envs at once
        next_adv = deltas[t] + gamma * lam * not_done[t] * next_adv
        advantages[t] = next_adv
    return advantages, advantages + values
# --8<-- [end:gae]


def compute_gae_loop(rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor,
                     gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """The reference for compute_gae: the same recursion, one Python float at a time (same shapes and result)."""
    T, N = rewards.shape
    r, v, d, lv = rewards.tolist(), values.tolist(), dones.tolist(), last_value.tolist()
    adv = [[0.0] * N for _ in range(T)]
    for n in range(N):
        running = 0.0
        for t in reversed(range(T)):
            next_v = lv[n] if t == T - 1 else v[t + 1][n]
            keep = 0.0 if d[t][n] else 1.0
            delta = r[t][n] + gamma * next_v * keep - v[t][n]
            running = delta + gamma * lam * keep * running
            adv[t][n] = running
    advantages = torch.tensor(adv, dtype=values.dtype)
    return advantages, advantages + values


def masked_mean(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """Mean of x over the positions where mask is 1 (all positions if mask is None); mask has x's shape."""
    if mask is None:
        return x.mean()
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def masked_whiten(x: Tensor, mask: Tensor | None = None, eps: float = 1e-8) -> Tensor:
    """(x - mean) / (std + eps) with mean and (biased) std over the masked positions: advantage normalization.

    Positions outside the mask are shifted and scaled too; callers must keep masking them out of their losses.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) / (var.sqrt() + eps)


# --8<-- [start:policy_loss]
def ppo_policy_loss(logp_new: Tensor, logp_old: Tensor, advantages: Tensor, clip_eps: float,
                    mask: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped surrogate loss (PPO paper, eq. 7), negated so that it is minimized.

    logp_new: log pi_theta(a|s) with grad; logp_old: log pi_old(a|s) from the rollout; advantages: A_t;
    all the same shape (any shape, e.g. (B,) or (N, T) tokens), mask optional of that shape.

        ratio = pi_theta / pi_old = exp(logp_new - logp_old)
        loss  = mean( max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)) )
    The max of the two negated terms is the pessimistic bound: once the ratio has moved past 1 +/- eps in the
    direction the advantage favours, the clipped term wins and its gradient is zero.

    stats: clip_frac (share of samples with |ratio - 1| > eps), approx_kl (k3 estimator of KL(old || new):
    mean((ratio - 1) - log ratio), always >= 0), ratio_mean.
    """
    log_ratio = logp_new - logp_old
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean(((ratio - 1.0).abs() > clip_eps).to(ratio.dtype), mask).item(),
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
        }
    return loss, stats
# --8<-- [end:policy_loss]


# --8<-- [start:value_loss]
def ppo_value_loss(values_new: Tensor, values_old: Tensor, returns: Tensor, clip_eps: float | None = None,
                   mask: Tensor | None = None) -> Tensor:
    """0.5 * mean squared error between V_theta(s) and the GAE returns; all tensors the same shape.

    With clip_eps, the PPO2 / cleanrl variant: the new value may move at most clip_eps from the rollout's value,
    and the loss is the max of the clipped and unclipped squared errors (pessimistic, like the policy loss).
    """
    err = (values_new - returns) ** 2
    if clip_eps is not None:
        v_clipped = values_old + (values_new - values_old).clamp(-clip_eps, clip_eps)
        err = torch.maximum(err, (v_clipped - returns) ** 2)
    return 0.5 * masked_mean(err, mask)
# --8<-- [end:value_loss]
