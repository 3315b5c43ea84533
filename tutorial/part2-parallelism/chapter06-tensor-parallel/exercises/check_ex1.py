"""Checker for ch06.1 — runs your f, g and Megatron MLP on real ranks and compares with the dense MLP of
mlsys.model (output, input gradient, weight gradients) and with the sums f and g must compute."""

from __future__ import annotations

import numpy as np
import torch

from mlsys.exercises import run_ranks, source_of, task
from mlsys.model import MLP, GPTConfig


def _inputs(t: int, shape: tuple, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    return x, [torch.randn(*shape, generator=gen) for _ in range(t)]  # a different upstream gradient per rank


def _written(fn) -> None:
    """A stub's function still raises NotImplementedError: report the task as TODO before starting any rank."""
    if "NotImplementedError" in source_of(fn):
        raise NotImplementedError(f"TODO: write {fn.__name__}")


@task("CopyToTP (f): forward returns x unchanged, backward sums the gradients of all ranks")
def check_f(ex) -> None:
    _written(ex.CopyToTP)  # the ranks call it through a given wrapper
    for t in (3,):
        x, ups = _inputs(t, (2, 3), 10 + t)
        got = run_ranks(ex, "probe", [("f", x, u) for u in ups])
        for r, out in enumerate(got):
            assert np.allclose(out["y"], x.numpy()), f"t={t}: rank {r} forward changed x"
            want = torch.stack(ups).sum(0).double().numpy()
            assert np.allclose(out["grad"], want, atol=1e-6), (
                f"t={t}: rank {r} x.grad {np.round(out['grad'], 3).tolist()}, want the sum over ranks "
                f"{np.round(want, 3).tolist()}")


@task("ReduceFromTP (g): forward sums x over the ranks, backward passes the gradient through")
def check_g(ex) -> None:
    _written(ex.ReduceFromTP)  # the ranks call it through a given wrapper
    for t in (2,):
        gen = torch.Generator().manual_seed(20 + t)
        xs = [torch.randn(2, 3, generator=gen) for _ in range(t)]
        up = torch.randn(2, 3, generator=gen)
        got = run_ranks(ex, "probe", [("g", x, up) for x in xs])
        for r, out in enumerate(got):
            want = torch.stack(xs).sum(0).numpy()
            assert np.allclose(out["y"], want, atol=1e-6), f"t={t}: rank {r} output is not the sum of every x"
            assert np.allclose(out["grad"], up.numpy()), f"t={t}: rank {r} backward changed the gradient"


@task("megatron_mlp equals mlsys.model.MLP (output and all gradients) at t=2 and 4, with 1 all-reduce each way")
def check_mlp(ex) -> None:
    _written(ex.megatron_mlp)  # the ranks call it through a given wrapper
    torch.manual_seed(0)
    dense = MLP(GPTConfig(n_embd=8, n_head=1, vocab_size=8))
    x, (up,) = _inputs(1, (2, 5, 8), 30)
    xr = x.clone().requires_grad_(True)
    (dense(xr) * up).sum().backward()
    fc_w, fc_b, pr_w, pr_b = (p.detach() for p in (dense.c_fc.weight, dense.c_fc.bias, dense.c_proj.weight,
                                                    dense.c_proj.bias))
    with torch.no_grad():
        y_ref = dense(x)
    for t in (2, 4):
        args = [(x, fc_w.chunk(t, 0)[r], fc_b.chunk(t, 0)[r], pr_w.chunk(t, 1)[r], pr_b, up) for r in range(t)]
        got = run_ranks(ex, "mlp_step", args)
        for r, out in enumerate(got):
            assert np.allclose(out["y"], y_ref.numpy(), atol=1e-5), f"t={t}: rank {r} output differs from the dense MLP"
            assert np.allclose(out["dx"], xr.grad.numpy(), atol=1e-5), (
                f"t={t}: rank {r} input gradient differs (is f's backward summing the ranks?)")
            want = [dense.c_fc.weight.grad.chunk(t, 0)[r], dense.c_fc.bias.grad.chunk(t, 0)[r],
                    dense.c_proj.weight.grad.chunk(t, 1)[r], dense.c_proj.bias.grad]
            for name, g, w in zip(("w_fc", "b_fc", "w_proj", "b_proj"), out["grads"], want):
                assert np.allclose(g, w.numpy(), atol=1e-5), f"t={t}: rank {r} gradient of {name} differs"
            calls = (out["forward_all_reduces"], out["backward_all_reduces"])
            assert calls == (1, 1), (f"t={t}: {calls[0]} torch.distributed.all_reduce call(s) forward and "
                                       f"{calls[1]} backward; Megatron needs exactly 1 and 1")
