"""Checker for ch13.3 — k2 against mlsys.rlhf.kl_estimators, the exact statistics against torch.distributions'
KL and a large sample, the controller against mlsys.rlhf.AdaptiveKLController."""

from __future__ import annotations

import torch

from mlsys import rlhf
from mlsys.exercises import reference_helpers, task


def _k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """mlsys.rlhf's k2: stands in for yours in the estimator_stats tasks (kl_k2 has its own task)."""
    return rlhf.kl_estimators(logp, ref_logp)["k2"]




def _pair(seed: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, generator=g, dtype=torch.float64)
    return base.softmax(0), (base + scale * torch.randn(6, generator=g, dtype=torch.float64)).softmax(0)


@task("kl_k2: equals mlsys.rlhf.kl_estimators' k2, 0 where the log-probs agree")
def check_k2(ex) -> None:
    g = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(500, generator=g), torch.randn(500, generator=g)
    want = rlhf.kl_estimators(logp, ref)["k2"]
    got = ex.kl_k2(logp, ref)
    assert torch.allclose(got, want, atol=1e-6), f"max error {(got - want).abs().max().item():.3g}"
    assert torch.equal(ex.kl_k2(logp, logp), torch.zeros_like(logp)), "k2 must be 0 where pi = pi_ref"


@task("estimator_stats: k1 and k3 unbiased, k2 biased, against torch's exact KL and a 400k-sample estimate")
def check_stats(ex) -> None:
    for seed, scale in ((0, 0.3), (1, 1.0), (2, 2.0)):
        p, q = _pair(seed, scale)
        kl = torch.distributions.kl_divergence(torch.distributions.Categorical(probs=p),
                                               torch.distributions.Categorical(probs=q)).item()
        with reference_helpers(ex, kl_k2=_k2):  # estimator_stats may call your kl_k2
            stats = ex.estimator_stats(p, q)
        assert abs(stats["k1"][0]) < 1e-9 and abs(stats["k3"][0]) < 1e-9, f"k1, k3 must be unbiased: {stats}"
        x = torch.multinomial(p, 400_000, replacement=True, generator=torch.Generator().manual_seed(seed))
        log_r = q.log()[x] - p.log()[x]
        samples = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": torch.expm1(log_r) - log_r}
        for name, s in samples.items():
            bias, var = stats[name]
            assert abs(bias - (s.mean().item() - kl)) < 0.02 + 0.02 * abs(bias), f"{name} bias {bias:.4f}, sampled " \
                f"{s.mean().item() - kl:.4f} (scale {scale})"
            assert abs(var - s.var().item()) < 0.05 * s.var().item() + 1e-6, f"{name} variance {var:.4f}, sampled " \
                f"{s.var().item():.4f} (scale {scale})"
        assert abs(stats["k2"][0]) > 1e-4, f"k2 should be biased here (scale {scale}), got bias {stats['k2'][0]}"


@task("estimator_stats: measured on close policies, k3's variance is far below k1's")
def check_measure(ex) -> None:
    p, q = _pair(3, 0.2)
    with reference_helpers(ex, kl_k2=_k2):  # estimator_stats may call your kl_k2
        s = ex.estimator_stats(p, q)
    assert s["k3"][1] < 0.2 * s["k1"][1], f"variance k3 {s['k3'][1]:.2e} vs k1 {s['k1'][1]:.2e}"


@task("update_beta: the proportional controller equals mlsys.rlhf.AdaptiveKLController, error clipped to +-0.2")
def check_controller(ex) -> None:
    ctl = rlhf.AdaptiveKLController(0.1, 6.0, k_beta=0.1)
    beta = 0.1
    for kl in (2.0, 5.5, 6.0, 7.0, 30.0, 0.0, 6.6):
        want = ctl.update(kl)
        beta = ex.update_beta(beta, kl, 6.0, 0.1)
        assert abs(beta - want) < 1e-12, f"after kl = {kl}: beta {beta}, want {want}"
