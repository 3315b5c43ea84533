"""Checker for ch12.3 — n = 1 against the TD errors and n >= T against GAE(lambda = 1) from mlsys.rl, every n
against a brute-force per-environment sum, and the returns against the loop reference."""

from __future__ import annotations

import torch

from mlsys import rl
from mlsys.exercises import task


def rollout(T: int, N: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, N, generator=g, dtype=torch.float64), torch.randn(T, N, generator=g, dtype=torch.float64),
            (torch.rand(T, N, generator=g) < 0.2).double(), torch.randn(N, generator=g, dtype=torch.float64))


def brute(rewards, values, dones, last_value, gamma, n):
    T, N = rewards.shape
    out = torch.zeros(T, N, dtype=torch.float64)
    for e in range(N):
        for t in range(T):
            total, k = 0.0, 0
            while True:
                total += gamma**k * float(rewards[t + k, e])
                if dones[t + k, e]:
                    break
                if k + 1 == n or t + k + 1 == T:
                    nxt = float(last_value[e]) if t + k + 1 == T else float(values[t + k + 1, e])
                    total += gamma ** (k + 1) * nxt
                    break
                k += 1
            out[t, e] = total - float(values[t, e])
    return out


@task("discounted_returns: hand case, and equal to GAE(lambda = 1) advantages + values from mlsys.rl")
def check_returns(ex) -> None:
    r, d, lv = torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[0.0], [1.0], [0.0]]), torch.tensor([10.0])
    got = ex.discounted_returns(r, d, lv, 0.5)
    assert torch.allclose(got[:, 0], torch.tensor([2.0, 2.0, 8.0])), f"got {got[:, 0].tolist()}, want [2, 2, 8]"
    r, v, d, lv = rollout(17, 5, 0)
    adv, _ = rl.compute_gae_loop(r, v, d, lv, 0.9, 1.0)
    got = ex.discounted_returns(r, d, lv, 0.9)
    assert torch.allclose(got, adv + v, atol=1e-9), f"max error {(got - adv - v).abs().max().item():.3g}"


@task("n = 1 is the TD error (GAE lambda = 0); n >= T is GAE lambda = 1 (mlsys.rl.compute_gae_loop)")
def check_ends(ex) -> None:
    for seed, gamma in enumerate((0.99, 0.9, 1.0)):
        r, v, d, lv = rollout(13, 6, seed)
        for n, lam in ((1, 0.0), (13, 1.0), (40, 1.0)):
            want, _ = rl.compute_gae_loop(r, v, d, lv, gamma, lam)
            got = ex.n_step_advantages(r, v, d, lv, gamma, n)
            err = (got - want).abs().max().item()
            assert err < 1e-9, f"gamma {gamma}, n {n}: max error {err:.3g} against GAE(lambda={lam})"


@task("every n in between equals a brute-force sum, episode ends and the rollout's end included")
def check_middle(ex) -> None:
    for seed, (gamma, n) in enumerate([(0.9, 2), (0.99, 3), (0.8, 5), (1.0, 7)]):
        r, v, d, lv = rollout(11, 4, 10 + seed)
        want = brute(r, v, d, lv, gamma, n)
        got = ex.n_step_advantages(r, v, d, lv, gamma, n)
        bad = (got - want).abs().argmax().item()
        t, e = divmod(bad, 4)
        assert torch.allclose(got, want, atol=1e-9), (f"gamma {gamma}, n {n}: at t={t}, env {e} got "
                                                      f"{got[t, e].item():.5f}, want {want[t, e].item():.5f}")
