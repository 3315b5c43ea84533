"""Exercise ch12.3 — extend: n-step advantages, the other knob between TD and Monte Carlo.

GAE blends all n-step estimates with weights (1 - lam) lam^(n-1). The older way picks one n: sum n rewards,
then bootstrap from the critic,

    A_t^(n) = r_t + gamma r_{t+1} + ... + gamma^(n-1) r_{t+n-1} + gamma^n V(s_{t+n}) - V(s_t)

with the same conventions as ch12.1: rollouts are time-major (T, N); dones[t] = 1 ends the episode after step t
(the sum stops there and nothing is bootstrapped); past the last step the state's value is last_value (N,).
n = 1 is GAE with lam = 0 (the TD error); n >= T is GAE with lam = 1 (the bootstrapped Monte-Carlo return).
Check your work:  make check EX=ch12.3
"""

from __future__ import annotations

from torch import Tensor


def discounted_returns(rewards: Tensor, dones: Tensor, last_value: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * (1 - done_t) * G_{t+1}, with G_T = last_value; shape (T, N)."""
    raise NotImplementedError("TODO: a reversed loop over t carrying G for all N environments")


def n_step_advantages(rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor, gamma: float,
                      n: int) -> Tensor:
    """A_t^(n) for every t and environment, shape (T, N); the sum is cut short by an episode end or by T."""
    raise NotImplementedError("TODO: for each offset i < n: add gamma^i r_{t+i} while no episode ended, then bootstrap")
