"""A mistake for ch06.1: b_proj is added on every rank BEFORE g's sum, so it is counted t times."""

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
    return ReduceFromTP.apply(F.linear(h, w_proj, b_proj))  # (B, T, C)


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
