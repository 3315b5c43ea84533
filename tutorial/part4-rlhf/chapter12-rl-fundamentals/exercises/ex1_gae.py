"""Exercise ch12.1 — generalized advantage estimation, vectorized over environments.

Rollouts are time-major: rewards, values, dones have shape (T, N), T steps of N environments. dones[t, n] = 1
means env n's episode ended after step t: no bootstrap from step t + 1, and nothing carried back across it.
last_value (N,) is V of the state after the last step. The recursion (GAE paper, https://arxiv.org/abs/1506.02438):

    delta_t = r_t + gamma * V(s_{t+1}) * (1 - done_t) - V(s_t)
    A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1},        A_T = 0

Loop backwards over time only; handle all N environments at once with tensor operations (no loop over N).
Check your work:  make check EX=ch12.1
"""

from __future__ import annotations

from torch import Tensor


def td_errors(rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor, gamma: float) -> Tensor:
    """The one-step TD errors delta_t, shape (T, N)."""
    raise NotImplementedError("TODO: next values = values shifted up one step with last_value appended at the end")


def compute_gae(rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor,
                gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Return (advantages, returns), both (T, N), with returns = advantages + values."""
    raise NotImplementedError("TODO: a reversed loop over t, carrying A_{t+1} for all N envs as one (N,) tensor")
