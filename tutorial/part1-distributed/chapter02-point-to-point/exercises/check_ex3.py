"""Checker for ch02.3 — your micro-batched hand-off on 1-3 real ranks against the same stages run on the whole
batch in one process (loss and every stage's weight and bias gradients)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mlsys.exercises import run_ranks, source_of, task

TIMEOUT_S = 15.0


def reference(x, target, weights, biases) -> tuple[float, list, list]:
    """The whole model in one process, the whole batch at once."""
    ws = [w.clone().requires_grad_(True) for w in weights]
    bs = [b.clone().requires_grad_(True) for b in biases]
    h = x
    for w, b in zip(ws, bs):
        h = torch.tanh(F.linear(h, w, b))
    loss = F.mse_loss(h, target)
    loss.backward()
    return loss.item(), [w.grad for w in ws], [b.grad for b in bs]


def _written(fn) -> None:
    """A stub's function still raises NotImplementedError: report the task as TODO before starting any rank."""
    if "NotImplementedError" in source_of(fn):
        raise NotImplementedError(f"TODO: write {fn.__name__}")


@task("micro_batched_step on 1-3 ranks, 1-4 micro-batches: loss and gradients equal the whole batch in one process")
def check_step(ex) -> None:
    _written(ex.micro_batched_step)  # the ranks call it through a given wrapper
    for world_size, num_micro in [(2, 1), (2, 4), (3, 2), (1, 2)]:
        gen = torch.Generator().manual_seed(10 * world_size + num_micro)
        batch, hidden = 4, 3
        x, target = torch.randn(batch, hidden, generator=gen), torch.randn(batch, hidden, generator=gen)
        weights = [torch.randn(hidden, hidden, generator=gen) for _ in range(world_size)]
        biases = [torch.randn(hidden, generator=gen) for _ in range(world_size)]
        want_loss, want_w, want_b = reference(x, target, weights, biases)
        got = run_ranks(ex, "run_step", [(x, target, weights[r], biases[r], num_micro)
                                                   for r in range(world_size)], timeout=TIMEOUT_S)
        where = f"W={world_size}, {num_micro} micro-batches"
        last = got[-1]["loss"]
        assert last is not None and abs(float(last) - want_loss) < 1e-5, \
            f"{where}: the last rank's loss is {last}, expected {want_loss:.6f}"
        for r, out in enumerate(got):
            for name, g, w in (("weight", out["grad_weight"], want_w[r]), ("bias", out["grad_bias"], want_b[r])):
                assert g is not None, f"{where}: rank {r} has no {name} gradient"
                g = np.asarray(g, dtype=np.float64)
                ratio = float(np.abs(g).sum() / max(np.abs(w.numpy()).sum(), 1e-12))
                assert np.allclose(g, w.numpy(), atol=1e-5), (
                    f"{where}: rank {r}'s {name} gradient differs from one process "
                    f"(|yours| / |expected| = {ratio:.3f})")
