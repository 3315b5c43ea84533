"""Checker for ch12.1 — your GAE against hand-worked cases and the plain-loop reference
(mlsys.rl.compute_gae_loop)."""

from __future__ import annotations

import ast

import torch

from mlsys import rl
from mlsys.exercises import source_of, task


def rollout(T: int, N: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, N, generator=g), torch.randn(T, N, generator=g),
            (torch.rand(T, N, generator=g) < 0.2).float(), torch.randn(N, generator=g))


@task("td_errors: r + gamma * V(s') * (1 - done) - V(s), bootstrapping the last step from last_value")
def check_td(ex) -> None:
    r, v, lv = torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[0.5], [1.0], [1.5]]), torch.tensor([2.0])
    for dones, want in [([0.0, 0.0, 0.0], [1.0, 1.75, 2.5]), ([0.0, 1.0, 1.0], [1.0, 1.0, 1.5])]:
        got = ex.td_errors(r, v, torch.tensor(dones)[:, None], lv, 0.5)
        assert torch.allclose(got[:, 0], torch.tensor(want)), f"dones {dones}: got {got[:, 0].tolist()}, want {want}"


@task("compute_gae on a hand-worked case, with and without an episode end")
def check_hand(ex) -> None:
    r, v, lv = torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[0.5], [1.0], [1.5]]), torch.tensor([2.0])
    for dones, want in [([0.0, 0.0, 0.0], [1.59375, 2.375, 2.5]), ([0.0, 1.0, 0.0], [1.25, 1.0, 2.5])]:
        adv, ret = ex.compute_gae(r, v, torch.tensor(dones)[:, None], lv, 0.5, 0.5)
        assert torch.allclose(adv[:, 0], torch.tensor(want)), f"dones {dones}: got {adv[:, 0].tolist()}, want {want}"
        assert torch.allclose(ret, adv + v), "returns must be advantages + values"


@task("compute_gae equals the loop reference on random (T, N) rollouts with episode ends, lambda 0 .. 1")
def check_random(ex) -> None:
    for seed, (gamma, lam) in enumerate([(0.99, 0.95), (0.9, 0.0), (1.0, 1.0), (0.97, 0.5)]):
        args = rollout(23, 7, seed)
        adv, ret = ex.compute_gae(*args, gamma, lam)
        want_adv, want_ret = rl.compute_gae_loop(*args, gamma, lam)
        err = (adv - want_adv).abs().max().item()
        assert err < 1e-4, f"gamma={gamma}, lam={lam}: max abs error {err:.3g} vs the loop reference"
        assert torch.allclose(ret, want_ret, atol=1e-4), "returns must be advantages + values"


def loops_behind(tree: ast.Module, name: str) -> tuple[int, list[str]]:
    """(loops, imports): the Python loops (for, while, comprehensions) in function `name` of the attempt's module and
    in every module function it calls, directly or not, and the modules the attempt imports from mlsys."""
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    seen, todo = set(), [name]
    while todo:
        fn = todo.pop()
        if fn in seen or fn not in defs:
            continue
        seen.add(fn)
        todo += [c.func.id for c in ast.walk(defs[fn]) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
    loops = sum(isinstance(n, (ast.For, ast.AsyncFor, ast.While, ast.comprehension))
                for fn in seen for n in ast.walk(defs[fn]))
    imports = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names] + \
              [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    return loops, [m for m in imports if m.split(".")[0] == "mlsys"]


@task("compute_gae handles N = 4096 environments in one pass (one loop, over time; shapes (T, N) in and out)")
def check_wide(ex) -> None:
    args = rollout(8, 4096, 7)
    adv, _ = ex.compute_gae(*args, 0.99, 0.95)
    assert adv.shape == (8, 4096), f"shape {tuple(adv.shape)}, want (8, 4096)"
    assert torch.allclose(adv, rl.compute_gae(*args, 0.99, 0.95)[0], atol=1e-4)
    # the values cannot tell a loop over the environments from tensor operations: the source can
    loops, book = loops_behind(ast.parse(source_of(ex)), "compute_gae")
    assert not book, f"compute_gae must be your own: the attempt imports {book[0]} (the book's GAE)"
    assert loops <= 1, (f"{loops} Python loops run behind compute_gae; want one, the backward loop over time, with "
                        "all N environments handled at once by tensor operations")
