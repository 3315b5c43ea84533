"""Tensor parallelism, the communication: Megatron's f and g and the sequence-parallel pair as autograd functions,
recording every collective they run in mlsys/comm_log.py. The layers that use them: mlsys/tp_layers.py; the overview:
mlsys/tensor_parallel.py."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mlsys.comm_log import CommEvent, comm_log  # noqa: F401  (re-exported: from mlsys.tensor_parallel import comm_log)
from mlsys.comm_log import record as _record


def _size(group) -> int:
    return dist.get_world_size(group)


def _rank(group) -> int:
    return dist.get_rank(group)


# Running totals of this process's all-reduces, always on (tensor-parallel serving reports them per step).
COMM = {"all_reduce_calls": 0, "all_reduce_bytes": 0, "all_reduce_s": 0.0}


def _all_reduce(x: torch.Tensor, group, phase: str, tag: str = "activation") -> torch.Tensor:
    if _size(group) == 1:
        return x
    out = x.contiguous().clone()
    nbytes = out.numel() * out.element_size()
    _record("all_reduce", phase, nbytes, tag)
    if out.is_cuda:  # NCCL returns before the sum is done: time it from idle GPU to finished sum
        torch.cuda.synchronize(out.device)
    t0 = time.perf_counter()
    dist.all_reduce(out, group=group)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    COMM["all_reduce_s"] += time.perf_counter() - t0
    COMM["all_reduce_calls"] += 1
    COMM["all_reduce_bytes"] += nbytes
    return out


def _all_gather(x: torch.Tensor, dim: int, group, phase: str) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (in rank order)."""
    w = _size(group)
    if w == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(w)]
    _record("all_gather", phase, w * x.numel() * x.element_size())
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group, phase: str) -> torch.Tensor:
    """Sum `x` over the ranks and keep this rank's chunk along `dim`."""
    w = _size(group)
    if w == 1:
        return x
    chunks = [c.contiguous() for c in x.chunk(w, dim=dim)]
    out = torch.empty_like(chunks[_rank(group)])
    _record("reduce_scatter", phase, x.numel() * x.element_size())
    dist.reduce_scatter(out, chunks, group=group)
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's chunk of `x` along `dim` (no communication)."""
    return x.chunk(_size(group), dim=dim)[_rank(group)].contiguous()


# ----------------------------------------------------------------------------------------------- Megatron's f and g
# --8<-- [start:f_and_g]
class CopyToTP(torch.autograd.Function):
    """f: the input of a column-parallel layer. Forward: identity. Backward: all-reduce, because every rank's
    partial input gradient (from its own columns) must be summed to give the full gradient."""

    @staticmethod
    def forward(ctx, x, group, tag="activation"):
        ctx.group, ctx.tag = group, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, "backward", ctx.tag), None, None


class ReduceFromTP(torch.autograd.Function):
    """g: the output of a row-parallel layer. Forward: all-reduce the partial sums. Backward: identity, because
    the gradient of a sum with respect to each term is the gradient of the sum itself."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None
# --8<-- [end:f_and_g]


# --8<-- [start:sp_pair]
class GatherFromSP(torch.autograd.Function):
    """Sequence parallelism's f: all-gather the sequence shards (dim 1) forward; reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, 1, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 1, ctx.group, "backward"), None


class ReduceScatterToSP(torch.autograd.Function):
    """Sequence parallelism's g: sum the partial outputs and keep this rank's sequence shard; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, 1, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 1, ctx.group, "backward"), None
# --8<-- [end:sp_pair]


class GatherLastDim(torch.autograd.Function):
    """All-gather along the last dimension (the head's vocabulary shards); backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, -1, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


# --8<-- [start:column_sp_fn]
class ColumnSPLinearFn(torch.autograd.Function):
    """y = all_gather_seq(x) @ W^T + b, saving only the sequence shard x (B, T/t, in) for backward.

    Backward all-gathers x again to form dW, and reduce-scatters dX so each rank gets the gradient of its shard.
    Saving the gathered (B, T, in) input instead would keep a replicated activation alive and undo the memory saving.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group = group
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        full = _all_gather(x, 1, group, "forward")  # (B, T, in)
        return F.linear(full, weight, bias)  # (B, T, out/t)

    @staticmethod
    def backward(ctx, grad):  # grad: (B, T, out/t)
        x, weight = ctx.saved_tensors
        full = _all_gather(x, 1, ctx.group, "backward")  # recomputed, not stored
        grad_weight = grad.flatten(0, 1).t() @ full.flatten(0, 1)  # (out/t, in)
        grad_bias = grad.sum((0, 1)) if ctx.has_bias else None
        grad_x = _reduce_scatter(grad @ weight, 1, ctx.group, "backward")  # (B, T/t, in)
        return grad_x, grad_weight, grad_bias, None
# --8<-- [end:column_sp_fn]


def copy_to_tp(x: torch.Tensor, group, tag: str = "activation") -> torch.Tensor:
    return CopyToTP.apply(x, group, tag)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return ReduceFromTP.apply(x, group)


def gather_from_sp(x: torch.Tensor, group) -> torch.Tensor:
    return GatherFromSP.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    return ReduceScatterToSP.apply(x, group)


def gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    return GatherLastDim.apply(x, group)


# --8<-- [start:replicated_param]
def replicated_param(p: torch.Tensor | None, group, sequence_parallel: bool) -> torch.Tensor | None:
    """A replicated parameter as used inside a block: under sequence parallelism each rank sees only part of the
    sequence, so the parameter's gradient is partial and f all-reduces it in backward."""
    if p is None or not sequence_parallel:
        return p
    return copy_to_tp(p, group, "param_grad")
# --8<-- [end:replicated_param]
