"""Exercise ch14.3 — extend: asynchronous rollouts are one step off-policy; measure the gap and correct for it.

In the asynchronous loop a rollout worker samples batch k with the weights of step k - 1 (the behaviour policy),
while the trainer updates the current policy. For every response token you have log pi_behaviour (the engine's
log-prob, recorded while generating) and log pi_current (recomputed by the trainer); mask (B, L) marks the real
tokens.
  * the off-policy gap: the mean over real tokens of log pi_behaviour - log pi_current, an estimate of
    KL(pi_behaviour || pi_current) (0 for synchronous rollouts);
  * the importance weight of a token, pi_current / pi_behaviour, truncated at `cap` (so one token that the
    current policy likes far more cannot dominate the batch), 0 on padding;
  * a corrected estimate of E_current[f] from behaviour samples: the weighted mean of f over real tokens,
    sum(w * f) / sum(mask) (without weights you estimate E_behaviour[f] instead).
Check your work:  make check EX=ch14.3
"""

from __future__ import annotations

import torch


def off_policy_gap(behaviour_logp: torch.Tensor, current_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over real tokens of behaviour_logp - current_logp."""
    raise NotImplementedError("TODO: masked sum of the difference over the number of real tokens")


def importance_weights(behaviour_logp: torch.Tensor, current_logp: torch.Tensor, mask: torch.Tensor,
                       cap: float) -> torch.Tensor:
    """min(pi_current / pi_behaviour, cap) on real tokens, 0 on padding; same shape as the inputs."""
    raise NotImplementedError("TODO: exp(current - behaviour), clamp at cap, times mask")


def corrected_mean(f: torch.Tensor, behaviour_logp: torch.Tensor, current_logp: torch.Tensor, mask: torch.Tensor,
                   cap: float = float("inf")) -> float:
    """Importance-weighted estimate of E_current[f] from tokens sampled by the behaviour policy."""
    raise NotImplementedError("TODO: sum(importance_weights * f) / number of real tokens")
