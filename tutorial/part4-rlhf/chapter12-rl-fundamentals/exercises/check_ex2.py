"""Checker for ch12.2 — your clipped loss against a hand computation (values and gradients, both clipping sides)
and against mlsys.rl.ppo_policy_loss on random inputs."""

from __future__ import annotations

import torch

from mlsys import rl
from mlsys.exercises import task


def hand_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logp_new = torch.tensor([0.5, 1.1, 1.5, 0.5, 1.1, 1.5]).log().requires_grad_()
    return logp_new, torch.zeros(6), torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])


@task("clipped_loss: a hand case: ratios 0.5, 1.1, 1.5 with A = +1 and A = -1, eps = 0.2")
def check_value(ex) -> None:
    logp_new, logp_old, adv = hand_case()
    loss = ex.clipped_loss(logp_new, logp_old, adv, 0.2)
    # A=+1: -0.5, -1.1, -1.2 (clipped at 1.2);  A=-1: 0.8 (clipped at 0.8), 1.1, 1.5;  mean 0.1
    value = loss.item()
    assert abs(value - 0.1) < 1e-6, f"loss {value:.6f}, want 0.1"


@task("clipped_loss: gradients zero exactly where the clipped term wins")
def check_grad(ex) -> None:
    logp_new, logp_old, adv = hand_case()
    ex.clipped_loss(logp_new, logp_old, adv, 0.2).backward()
    want = torch.tensor([-0.5, -1.1, 0.0, 0.0, 1.1, 1.5]) / 6
    assert logp_new.grad is not None and torch.allclose(logp_new.grad, want, atol=1e-6), (
        f"d loss / d logp_new = {logp_new.grad}, want {want.tolist()}")


def _random_cases():
    g = torch.Generator().manual_seed(0)
    for eps in (0.1, 0.2, 0.3):
        logp_old = -torch.rand(500, generator=g) * 2
        logp_new = (logp_old + 0.3 * torch.randn(500, generator=g)).requires_grad_()
        adv = torch.randn(500, generator=g)
        want, stats = rl.ppo_policy_loss(logp_new, logp_old, adv, eps)
        yield eps, logp_new, logp_old, adv, want, stats


@task("clipped_loss: matches mlsys.rl.ppo_policy_loss on random inputs")
def check_random_loss(ex) -> None:
    for eps, logp_new, logp_old, adv, want, _ in _random_cases():
        got = ex.clipped_loss(logp_new, logp_old, adv, eps)
        assert torch.allclose(got, want, atol=1e-6), f"eps {eps}: loss {got.item()}, want {want.item()}"


@task("clip_fraction: the share of tokens whose ratio is outside [1 - eps, 1 + eps] (hand case, then mlsys.rl)")
def check_clip_fraction(ex) -> None:
    logp_new, logp_old, _ = hand_case()
    frac = ex.clip_fraction(logp_new, logp_old, 0.2)
    assert abs(frac - 4 / 6) < 1e-6, f"clip fraction {frac}, want 4/6 (ratios 0.5 and 1.5, twice)"
    for eps, logp_new, logp_old, _, _, stats in _random_cases():
        got = ex.clip_fraction(logp_new, logp_old, eps)
        assert abs(got - stats["clip_frac"]) < 1e-6, f"eps {eps}: clip fraction {got}, want {stats['clip_frac']}"


@task("approx_kl: the mean k3 estimate (r - 1) - log r (hand case, then mlsys.rl)")
def check_approx_kl(ex) -> None:
    logp_new, logp_old, _ = hand_case()
    r = logp_new.detach().exp()
    want = float(((r - 1) - r.log()).mean())
    kl = ex.approx_kl(logp_new, logp_old)
    assert abs(kl - want) < 1e-6, f"approx_kl {kl}, want {want}"
    for eps, logp_new, logp_old, _, _, stats in _random_cases():
        got = ex.approx_kl(logp_new, logp_old)
        want = stats["approx_kl"]
        assert abs(got - want) < 1e-5, f"random case (eps {eps}): approx_kl {got}, want {want}"
