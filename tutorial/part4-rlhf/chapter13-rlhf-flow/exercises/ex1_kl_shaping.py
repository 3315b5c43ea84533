"""Exercise ch13.1 — the KL penalty of RLHF: two estimators and per-token reward shaping.

The policy pi sampled a response; for each of its tokens you have log pi(token) and log pi_ref(token) under the
frozen reference. With log w = log pi_ref - log pi (one number per token; `log_r` in the code):

    k1 = -log w               unbiased estimate of KL(pi || pi_ref), but a single token's value can be negative
    k3 = (w - 1) - log w      also unbiased (E_pi[w] = 1), and never negative

PPO-based RLHF then turns the reward model's one score per response into one reward per token: every real token
pays -beta * kl_t, and the last real token also receives the score. Padding positions (mask 0) get 0.
Check your work:  make check EX=ch13.1
"""

from __future__ import annotations

import torch


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate, same shape as the inputs."""
    raise NotImplementedError("TODO: k1 = log pi - log pi_ref")


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate, same shape as the inputs; must be >= 0 and exactly 0 where the log-probs agree."""
    raise NotImplementedError("TODO: log_r = ref_logp - logp; k3 = (exp(log_r) - 1) - log_r (torch.expm1 helps)")


def shape_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """scores (B,), kl and mask (B, L) with each row's real tokens first -> rewards (B, L).

    rewards[b, t] = -beta * kl[b, t] on real tokens, plus scores[b] on row b's last real token, 0 on padding.
    """
    raise NotImplementedError("TODO: -beta * kl * mask, then add each score at index mask.sum(1) - 1 of its row")
