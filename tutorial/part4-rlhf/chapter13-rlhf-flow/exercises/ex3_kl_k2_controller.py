"""Exercise ch13.3 — extend: a third KL estimator, its bias and variance measured exactly, and the adaptive beta.

With log w = log pi_ref - log pi per sampled token (ch13.1): k1 = -log w, k3 = (w - 1) - log w, and

    k2 = (log w)^2 / 2      never negative, low variance, but BIASED: E_pi[k2] != KL(pi || pi_ref) in general

For a categorical pi and pi_ref you can measure each estimator exactly, without sampling: its mean under pi is
sum_x pi(x) k(x), its bias that mean minus the true KL, its variance sum_x pi(x) (k(x) - mean)^2.
The adaptive controller (Ziegler et al., 2019) then keeps the measured KL near a target:
beta <- beta * (1 + k_beta * clip(kl / target - 1, -0.2, 0.2)).
Check your work:  make check EX=ch13.3
"""

from __future__ import annotations

import torch


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k2 = (log pi_ref - log pi)^2 / 2, same shape as the inputs."""
    raise NotImplementedError("TODO: half the square of the log-ratio")


def estimator_stats(p: torch.Tensor, p_ref: torch.Tensor) -> dict[str, tuple[float, float]]:
    """Categorical pi = p and pi_ref = p_ref (V,) -> {"k1": (bias, variance), "k2": ..., "k3": ...}, exact under pi."""
    raise NotImplementedError("TODO: evaluate each estimator at every outcome, weight by p")


def update_beta(beta: float, kl: float, target: float, k_beta: float = 0.1) -> float:
    """One step of the adaptive KL controller."""
    raise NotImplementedError("TODO: the proportional error kl / target - 1, clipped to [-0.2, 0.2]")
