"""Checker for ch05.4 — your outer step over 3 rounds on 1 to 3 real ranks against torch.optim.SGD(nesterov=True)
in one process, fed the mean parameter change as its gradient; and the one case where the answer is known by hand."""

from __future__ import annotations

import numpy as np
import torch

from mlsys.exercises import run_ranks, source_of, task

LR, MOMENTUM = 0.7, 0.9


def _written(fn) -> None:
    """A stub's function still raises NotImplementedError: report the task as TODO before starting any rank."""
    if "NotImplementedError" in source_of(fn):
        raise NotImplementedError(f"TODO: write {fn.__name__}")


@task("one rank, lr 1, momentum 0: the outer step lands exactly where the inner steps ended")
def check_identity(ex) -> None:
    _written(ex.outer_step)  # the ranks call it through a given wrapper
    init = torch.tensor([1.0, -2.0, 3.0])
    drift = torch.tensor([0.5, 0.25, -1.0])
    (got,) = run_ranks(ex, "run_rounds", [(init, [drift], 1.0, 0.0)], timeout=30)
    assert np.allclose(got[0], (init + drift).tolist()), (
        f"with one rank, lr 1 and no momentum the new global parameters must be the local ones, "
        f"{(init + drift).tolist()}; got {got[0]}")


@task("3 rounds on 1, 2 and 3 ranks equal torch.optim.SGD(lr 0.7, momentum 0.9, nesterov) on the mean change")
def check_rounds(ex) -> None:
    _written(ex.outer_step)  # the ranks call it through a given wrapper
    for world_size in (1, 2, 3):
        gen = torch.Generator().manual_seed(50 + world_size)
        init = torch.randn(6, generator=gen)
        drifts = [[0.1 * torch.randn(6, generator=gen) for _ in range(3)] for _ in range(world_size)]
        param = init.clone().requires_grad_(True)
        opt = torch.optim.SGD([param], lr=LR, momentum=MOMENTUM, nesterov=True)
        want = []
        for k in range(3):
            param.grad = -torch.stack([drifts[r][k] for r in range(world_size)]).mean(0)  # global - local
            opt.step()
            want.append(param.detach().clone().numpy())
        got = run_ranks(ex, "run_rounds", [(init, drifts[r], LR, MOMENTUM) for r in range(world_size)], timeout=30)
        for rank, rounds in enumerate(got):
            for k, (g, w) in enumerate(zip(rounds, want, strict=True)):
                assert np.allclose(g, w, atol=1e-5), (
                    f"W={world_size}: rank {rank}'s global parameters after round {k + 1} differ from "
                    f"torch.optim.SGD(nesterov=True) on the mean of (global - local): max diff "
                    f"{np.abs(np.asarray(g) - w).max():.3g}")
