"""`--verbose`: print every point-to-point and collective call a script makes, on every rank.

`enable(rank)` wraps the public functions of `torch.distributed` (the ones a script calls as `dist.all_reduce(...)`)
so each call prints one line when it starts and one when it returns, with the tensor's shape and dtype and the time
spent. Calls that torch makes internally are not traced, only the script's own.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any

TRACED = (
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "broadcast", "scatter", "gather", "all_gather",
    "all_gather_into_tensor", "reduce", "all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "barrier", "broadcast_object_list", "all_gather_object", "gather_object",
    "scatter_object_list",
)


def describe(value: Any) -> str:
    """Short text for one argument: tensors as shape and dtype, lists by length, the rest by repr."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}:{str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe(v) for v in value[:2]) + (", ..." if len(value) > 2 else "")
        return f"[{inner}]"
    if type(value).__name__ == "RedOpType":  # ReduceOp.SUM prints as <RedOpType.SUM: 0>
        return str(value.name)
    text = repr(value)
    return text if len(text) < 40 else text[:37] + "..."


def _wrap(name: str, fn: Any, rank: int) -> Any:
    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        shown = [describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()]
        sys.stderr.write(f"[rank {rank}] -> {name}({', '.join(shown)})\n")
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        done = "started (async)" if name.startswith("i") or kwargs.get("async_op") else "done"
        sys.stderr.write(f"[rank {rank}] <- {name} {done} in {1e3 * (time.perf_counter() - start):.2f} ms\n")
        return out

    traced.__mlsys_traced__ = True  # type: ignore[attr-defined]
    return traced


def enable(rank: int) -> None:
    """Wrap the traced functions of torch.distributed in this process (idempotent)."""
    import torch.distributed as dist

    for name in TRACED:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "__mlsys_traced__", False):
            setattr(dist, name, _wrap(name, fn, rank))
    if not getattr(dist.P2POp, "__mlsys_traced__", False):
        dist.P2POp = _p2p_op_taking_wrappers(dist.P2POp)


def _p2p_op_taking_wrappers(base: type) -> type:
    """torch's P2POp accepts only torch's own isend/irecv; a script that writes `dist.P2POp(dist.isend, ...)`
    under --verbose hands it our wrapper. This subclass unwraps it (the batch is traced as batch_isend_irecv)."""

    class P2POp(base):  # type: ignore[misc, valid-type]
        __mlsys_traced__ = True

        def __new__(cls, op, *args, **kwargs):
            return base.__new__(cls, getattr(op, "__wrapped__", op), *args, **kwargs)

        def __init__(self, op, *args, **kwargs):
            super().__init__(getattr(op, "__wrapped__", op), *args, **kwargs)

    return P2POp
