"""Checker for ch07.2 — routing, capacity and the aux loss against hand cases and a plain Python loop."""

from __future__ import annotations

import torch

from mlsys.exercises import task


def loop_keep(experts: list[list[int]], num_experts: int, capacity: int) -> list[list[bool]]:
    """The priority rule spelled out: choice j of every token, tokens in order, a counter per expert."""
    keep = [[False] * len(row) for row in experts]
    used = [0] * num_experts
    for j in range(len(experts[0]) if experts else 0):
        for t, row in enumerate(experts):
            if used[row[j]] < capacity:
                used[row[j]] += 1
                keep[t][j] = True
    return keep


@task("route: softmax, top-k (best first) and renormalization on hand cases")
def check_route(ex) -> None:
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.1, 0.1, 0.3]]))
    probs, w, e = ex.route(logits, 2, renormalize=True)
    assert torch.allclose(probs, logits.exp(), atol=1e-6), f"probs should be the softmax, got {probs}"
    assert e.tolist() == [[3, 2], [0, 3]], f"experts: got {e.tolist()}, want [[3, 2], [0, 3]]"
    assert torch.allclose(w, torch.tensor([[4 / 7, 3 / 7], [5 / 8, 3 / 8]])), f"renormalized weights: got {w}"
    _, w, _ = ex.route(logits, 2, renormalize=False)
    assert torch.allclose(w, torch.tensor([[0.4, 0.3], [0.5, 0.3]])), f"raw weights: got {w}"


@task("keep_mask: first choices before second choices, earlier tokens first, `capacity` slots per expert")
def check_keep_mask(ex) -> None:
    hand = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    got = ex.keep_mask(hand, 3, 2).tolist()
    want = [[True, True], [True, True], [False, False], [True, False]]
    assert got == want, f"hand case: got {got}, want {want}"
    gen = torch.Generator().manual_seed(0)
    for N, E, k, cap in [(16, 4, 1, 3), (20, 4, 2, 6), (9, 8, 3, 2), (5, 2, 2, 0), (30, 5, 2, 30)]:
        experts = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
        got = ex.keep_mask(experts, E, cap)
        assert got.dtype == torch.bool and got.shape == (N, k), \
            f"want a bool (N, k) tensor, got {got.dtype} {got.shape}"
        want = loop_keep(experts.tolist(), E, cap)
        assert got.tolist() == want, f"N={N} E={E} k={k} capacity={cap}: {int((~got).sum())} dropped, " \
                                     f"want {sum(not v for row in want for v in row)}"


@task("load_balancing_loss: 1 when balanced, E * P_busy when all on one expert, gradient E * f_i / N")
def check_aux(ex) -> None:
    uniform = torch.full((8, 4), 0.25)
    got = float(ex.load_balancing_loss(uniform, torch.arange(8).remainder(4)[:, None]))
    assert abs(got - 1.0) < 1e-6, f"balanced: got {got}, want 1"
    probs = torch.tensor([[0.75, 0.25]]).repeat(5, 1).requires_grad_(True)
    loss = ex.load_balancing_loss(probs, torch.zeros(5, 1, dtype=torch.long))
    assert abs(loss.item() - 1.5) < 1e-6, f"all tokens on expert 0 with P=0.75, E=2: got {loss.item()}, want 1.5"
    loss.backward()
    want = torch.tensor([[0.4, 0.0]]).repeat(5, 1)
    assert probs.grad is not None and torch.allclose(probs.grad, want), f"gradient: got {probs.grad}, want {want}"
    got = float(ex.load_balancing_loss(torch.tensor([[0.9, 0.1]] * 3), torch.tensor([[0, 1]] * 3)))
    assert abs(got - 1.0) < 1e-6, f"top-2 of 2 experts always gives f = (1/2, 1/2) and loss 1, got {got}"
