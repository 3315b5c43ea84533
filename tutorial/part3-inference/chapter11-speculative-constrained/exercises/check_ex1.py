"""Checker for ch11.1 — your acceptance rule: residual by hand, edge cases, and the output distribution equal to
the target's (chi-square over fixed-seed samples, explicit p and q)."""

from __future__ import annotations

import torch

from mlsys.exercises import call_many, task
from mlsys.speculative import chi_square

P = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.6, 0.1, 0.2], [0.25, 0.25, 0.25, 0.25]])  # target, k+1 = 3
Q = torch.tensor([[0.1, 0.6, 0.1, 0.2], [0.4, 0.1, 0.4, 0.1]])  # draft, k = 2


@task("residual(p, q) = normalize(max(0, p - q))")
def check_residual(ex) -> None:
    got = ex.residual(torch.tensor([0.5, 0.3, 0.2, 0.0]), torch.tensor([0.2, 0.1, 0.6, 0.1]))
    want = torch.tensor([0.6, 0.4, 0.0, 0.0])  # max(0, p - q) = [.3, .2, 0, 0], sum .5
    assert torch.allclose(got, want, atol=1e-6), f"got {got.tolist()}, want {want.tolist()}"


@task("edge cases: q == p accepts everything; p(d) = 0 always rejects d")
def check_edges(ex) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        j, _ = ex.verify_sampled(P[[0, 1, 1]], P[:2], torch.tensor([1, 3]), g)
        assert j == 2, f"with q == p every draft must be accepted, got j={j}"
        p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25] * 4])
        j, nxt = ex.verify_sampled(p, Q[:1], torch.tensor([0]), g)
        assert j == 0 and nxt in (1, 2), f"p(d)=0: must reject and redraw from the residual, got ({j}, {nxt})"


@task("the emitted tokens follow the target: token 1 ~ p[0], token 2 ~ p[1], bonus ~ p[2] (chi-square)")
def check_distribution(ex) -> None:
    g = torch.Generator().manual_seed(1)
    first, second, bonus = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    drafts = [torch.stack([torch.multinomial(Q[i], 1, generator=g)[0] for i in range(2)]) for _ in range(8000)]
    # the 8000 calls as one request to the attempt's process; its draws from g follow the drafts' draws
    results = call_many(ex.verify_sampled, [(P, Q, d, g) for d in drafts])
    for d, (j, nxt) in zip(drafts, results):
        emitted = [*d[:j].tolist(), nxt]
        first[emitted[0]] += 1
        if j >= 1:
            second[emitted[1]] += 1
        if j == 2:
            bonus[nxt] += 1
    for name, counts, p in [("first token", first, P[0]), ("second token", second, P[1]), ("bonus", bonus, P[2])]:
        stat, critical = chi_square(counts, p)
        freq = [round(x, 3) for x in (counts / counts.sum()).tolist()]
        want = [round(x, 3) for x in p.tolist()]
        assert stat < critical, f"{name}: frequencies {freq}, target {want}: chi2 {stat:.1f} > {critical:.1f}"
