"""Checker for ch13.1 — your KL estimators against exact expectations, and your shaping against mlsys.rlhf."""

from __future__ import annotations

import torch

from mlsys import rlhf
from mlsys.exercises import task


def _categoricals(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(7, generator=g, dtype=torch.float64).mul(1.5).softmax(0)
    q = torch.randn(7, generator=g, dtype=torch.float64).mul(1.5).softmax(0)
    return p, q


def _unbiased(name: str, fn) -> None:
    """E_pi[estimator] over 7 outcomes equals KL(pi || pi_ref), torch.distributions as the oracle."""
    for seed in range(4):
        p, q = _categoricals(seed)
        exact = torch.distributions.kl_divergence(torch.distributions.Categorical(probs=p),
                                                  torch.distributions.Categorical(probs=q)).item()
        values = fn(p.log(), q.log())  # the estimator's value at each of the 7 outcomes
        assert values.shape == p.shape, f"{name}: shape {tuple(values.shape)}, want {tuple(p.shape)}"
        got = (p * values).sum().item()
        assert abs(got - exact) < 1e-9, f"{name}: E_pi[{name}] = {got:.6f}, but KL = {exact:.6f} (seed {seed})"


def _samples() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2000, generator=g) * 3, torch.randn(2000, generator=g) * 3


@task("kl_k1: log pi - log pi_ref per token; its expectation under pi is KL(pi || pi_ref)")
def check_k1(ex) -> None:
    logp, ref = _samples()
    want = rlhf.kl_estimators(logp, ref)["k1"]
    got = ex.kl_k1(logp, ref)
    assert got.shape == want.shape, f"k1: shape {tuple(got.shape)}, want {tuple(want.shape)} (no sums: per token)"
    assert torch.allclose(got, want, atol=1e-6), "k1 differs from log pi - log pi_ref"
    _unbiased("k1", ex.kl_k1)


@task("kl_k3: (w - 1) - log w per token, >= 0 everywhere, exactly 0 where pi = pi_ref, unbiased")
def check_k3(ex) -> None:
    logp, ref = _samples()
    k3 = ex.kl_k3(logp, ref)
    assert k3.shape == logp.shape, f"k3: shape {tuple(k3.shape)}, want {tuple(logp.shape)} (no sums: per token)"
    assert (k3 >= 0).all(), f"k3 has {(k3 < 0).sum().item()} negative values, e.g. {k3.min().item():.4f}"
    assert torch.equal(ex.kl_k3(logp, logp), torch.zeros_like(logp)), "k3 must be exactly 0 where pi = pi_ref"
    assert torch.allclose(k3, rlhf.kl_estimators(logp, ref)["k3"], rtol=1e-5, atol=1e-6), \
        "k3 differs from (w - 1) - log w"
    _unbiased("k3", ex.kl_k3)


@task("shape_rewards: -beta * KL per real token, the score on the last one, 0 on padding")
def check_shaping(ex) -> None:
    kl = torch.tensor([[0.5, -0.2, 0.1, 9.0], [0.3, 0.4, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    scores = torch.tensor([2.0, -1.0, 0.5])
    got = ex.shape_rewards(scores, kl.clone(), mask, 0.1)
    want = rlhf.shape_rewards(scores, kl, mask, 0.1)
    assert got.shape == want.shape, f"shape {tuple(got.shape)}, want {tuple(want.shape)}"
    assert torch.allclose(got, want, atol=1e-6), f"got\n{got}\nwant\n{want}"
    sums = scores - 0.1 * (kl * mask).sum(1)
    assert torch.allclose(got.sum(1), sums, atol=1e-6), "each row must sum to score - beta * sum of its KL"
