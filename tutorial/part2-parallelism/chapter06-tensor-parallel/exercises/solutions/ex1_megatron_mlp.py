"""Solution ch06.1 — Megatron's f and g, and the tensor-parallel MLP built with them.

The ranks of the default process group hold the SAME input x (B, T, C). Rank r of t holds
    w_fc   (4C/t, C)  rows r of the dense c_fc weight      b_fc  (4C/t,)  its slice of the c_fc bias
    w_proj (C, 4C/t)  columns r of the dense c_proj weight  b_proj (C,)   the whole c_proj bias (replicated)
and `megatron_mlp` must return the dense MLP's output, gelu(x W_fc^T + b_fc) W_proj^T + b_proj, on every rank,
with ONE all-reduce in forward and ONE in backward, both hidden inside the two autograd functions below:

    CopyToTP (f):     forward returns x unchanged;     backward all-reduces (sums) the incoming gradient
    ReduceFromTP (g): forward all-reduces (sums) x;    backward returns the gradient unchanged

Hints: torch.distributed.all_reduce works in place, and an autograd function must not modify its input in place
(clone first). Use F.gelu(..., approximate="tanh") like mlsys.model.MLP. Add b_proj once, AFTER the sum.

Check: make check EX=ch06.1
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)  # every rank's partial dL/dx, summed
        return grad


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out)  # the partial products of the row-parallel layer, summed
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def megatron_mlp(x: torch.Tensor, w_fc: torch.Tensor, b_fc: torch.Tensor, w_proj: torch.Tensor,
                 b_proj: torch.Tensor) -> torch.Tensor:
    """x (B, T, C) replicated -> the dense MLP's output (B, T, C) on every rank."""
    h = F.gelu(F.linear(CopyToTP.apply(x), w_fc, b_fc), approximate="tanh")  # (B, T, 4C/t), no communication
    return ReduceFromTP.apply(F.linear(h, w_proj)) + b_proj  # (B, T, C)


# ----------------------------------------------------------------------------------------------- provided
def probe(name: str, x: torch.Tensor, upstream: torch.Tensor) -> dict:
    """Run one function forward and backward on this rank; the checker calls this on every rank."""
    x = x.clone().requires_grad_(True)
    fn = {"f": CopyToTP.apply, "g": ReduceFromTP.apply}[name]
    y = fn(x)
    (y * upstream).sum().backward()
    return {"y": y.detach().tolist(), "grad": x.grad.tolist()}


def mlp_step(x: torch.Tensor, w_fc, b_fc, w_proj, b_proj, upstream: torch.Tensor) -> dict:
    """Forward and backward of megatron_mlp with (y * upstream).sum() as the loss; counts the all-reduces."""
    calls = {"n": 0}
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        params = [p.clone().requires_grad_(True) for p in (w_fc, b_fc, w_proj, b_proj)]
        x = x.clone().requires_grad_(True)
        y = megatron_mlp(x, *params)
        forward_calls = calls["n"]
        (y * upstream).sum().backward()
    finally:
        dist.all_reduce = real
    return {"y": y.detach().tolist(), "dx": x.grad.tolist(), "grads": [p.grad.tolist() for p in params],
            "forward_all_reduces": forward_calls, "backward_all_reduces": calls["n"] - forward_calls}
