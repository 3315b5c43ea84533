"""Checker for ch14.3 — the gap and weights against numpy on padded batches, the gap's expectation against
torch.distributions' KL, and the corrected mean against the exact expectation under the current policy."""

from __future__ import annotations

import numpy as np
import torch

from mlsys.exercises import reference_helpers, task


def _batch(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    b = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    c = b + 0.5 * torch.randn(5, 7, generator=g, dtype=torch.float64)
    lengths = torch.tensor([7, 3, 1, 5, 6])
    mask = (torch.arange(7)[None] < lengths[:, None]).double()
    c = c + 100.0 * (1 - mask)  # garbage on padding must not leak in
    return b, c, mask


def _weights(b: torch.Tensor, c: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """numpy's min(exp(current - behaviour), cap) on real tokens, 0 on padding: the oracle of importance_weights."""
    B, C, M = b.numpy(), c.numpy(), mask.numpy()
    return torch.from_numpy(np.where(M > 0, np.minimum(np.exp(np.where(M > 0, C - B, 0.0)), cap), 0.0))


def _pair() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(1)
    pb = torch.randn(8, generator=g, dtype=torch.float64).softmax(0)
    pc = (pb.log() + 0.6 * torch.randn(8, generator=g, dtype=torch.float64)).softmax(0)
    f = 2 * (pc - pb) / (pc - pb).abs().max()  # a quantity the policy change moves
    return pb, pc, f, g




@task("off_policy_gap: mean of behaviour - current log-prob over real tokens; sampled, it estimates the KL")
def check_gap(ex) -> None:
    b, c, mask = _batch(0)
    B, C, M = b.numpy(), c.numpy(), mask.numpy()
    want_gap = ((B - C) * M).sum() / M.sum()
    got = ex.off_policy_gap(b, c, mask)
    assert abs(got - want_gap) < 1e-9, f"gap {got}, want {want_gap} (mean over the {int(M.sum())} real tokens)"
    pb, pc, _, g = _pair()
    x = torch.multinomial(pb, 200_000, replacement=True, generator=g).view(400, 500)
    mask = torch.ones(400, 500, dtype=torch.float64)
    kl = torch.distributions.kl_divergence(torch.distributions.Categorical(probs=pb),
                                           torch.distributions.Categorical(probs=pc)).item()
    gap = ex.off_policy_gap(pb.log()[x], pc.log()[x], mask)
    assert abs(gap - kl) < 0.01, f"sampled from pi_behaviour: gap {gap:.4f}, KL(behaviour || current) = {kl:.4f}"


@task("importance_weights: min(exp(current - behaviour), cap) on real tokens, 0 on padding (cap 2 and no cap)")
def check_weights(ex) -> None:
    b, c, mask = _batch(0)
    for cap in (2.0, float("inf")):
        want = _weights(b, c, mask, cap).numpy()
        got_w = ex.importance_weights(b, c, mask, cap)
        assert tuple(got_w.shape) == want.shape, f"shape {tuple(got_w.shape)}, want {want.shape}"
        assert np.allclose(got_w.numpy(), want), f"cap {cap}: weights differ, e.g. row 0 {got_w[0].tolist()}"
    b, c, mask = _batch(3)
    w = ex.importance_weights(b, c, mask, 2.0)
    assert float(w.max()) <= 2.0 + 1e-12, f"weights above the cap: max {float(w.max())}"


@task("corrected_mean: sampled from pi_behaviour it hits E_current[f]; a cap trades bias for variance")
def check_corrected(ex) -> None:
    # corrected_mean may call your importance_weights: numpy's weights stand in for it here, so this task checks
    # the weighted mean alone (importance_weights has its own task above)
    with reference_helpers(ex, importance_weights=_weights):
        pb, pc, f, g = _pair()
        x = torch.multinomial(pb, 200_000, replacement=True, generator=g).view(400, 500)
        mask = torch.ones(400, 500, dtype=torch.float64)
        exact_current, exact_behaviour = float((pc * f).sum()), float((pb * f).sum())
        got = ex.corrected_mean(f[x], pb.log()[x], pc.log()[x], mask)
        assert abs(got - exact_current) < 0.02, (f"corrected mean {got:.4f}, E_current[f] = {exact_current:.4f} "
                                                 f"(E_behaviour[f] = {exact_behaviour:.4f})")
        assert abs(exact_current - exact_behaviour) > 0.1, "test case too easy"
        g = torch.Generator().manual_seed(2)
        pb = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
        pc = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
        f = torch.tensor([0.0, 0.0, 1.0, 2.0], dtype=torch.float64)
        x = torch.multinomial(pb, 100_000, replacement=True, generator=g).view(100, 1000)
        mask = torch.ones(100, 1000, dtype=torch.float64)
        b, c = pb.log()[x], pc.log()[x]
        exact = float((pc * f).sum())
        full = ex.corrected_mean(f[x], b, c, mask)
        capped = ex.corrected_mean(f[x], b, c, mask, cap=2.0)
        want_capped = float((pb * torch.clamp(pc / pb, max=2.0) * f).sum())
        assert abs(full - exact) < 0.05, f"uncapped {full:.3f}, exact {exact:.3f}"
        assert abs(capped - want_capped) < 0.02, f"cap 2: {capped:.3f}, want E_b[min(w, 2) f] = {want_capped:.3f}"
        b, c, mask = _batch(0)
        f = torch.ones_like(b)
        want_pad = float((_weights(b, c, mask, 2.0) * f).sum() / mask.sum())
        got_pad = ex.corrected_mean(f, b, c, mask, cap=2.0)
        assert abs(got_pad - want_pad) < 1e-9, f"padded batch: corrected mean {got_pad}, want {want_pad} " \
                                               "(a mean over the real tokens)"
