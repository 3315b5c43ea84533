"""`--verbose`: print every point-to-point and collective call a script makes, on every rank.

`enable(rank)` wraps the public functions of `torch.distributed` (the ones a script calls as `dist.all_reduce(...)`)
so each call prints one line when it starts and one when it returns, with the tensor's shape and dtype and the time
spent. Calls that torch makes internally are not traced, only the script's own.

`recording(calls)` does the same silently for the point-to-point calls, for pictures: inside the `with`, each call
(and each `wait()` on the request an isend, irecv or batch_isend_irecv returned) appends
{call, peer, numel, start, end, outcome} to `calls`; `recording(calls, also=("all_reduce",))` records collectives
too (an async one's wait() and the moment its result was ready included); `note(calls, what, value)` adds an
instant of the script's own (a tensor changed, a buffer read) to the same list.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
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
            return base.__new__(cls, inspect.unwrap(op), *args, **kwargs)

        def __init__(self, op, *args, **kwargs):
            super().__init__(inspect.unwrap(op), *args, **kwargs)

    return P2POp


# ---- recording for pictures -----------------------------------------------------------------------------------
# --8<-- [start:recording]
RECORDED = ("barrier", "new_group", "send", "recv", "isend", "irecv", "batch_isend_irecv")


class _Request:
    """Stands in for the request isend/irecv return, so that its wait() is recorded too."""

    def __init__(self, request: Any, log: Any, name: str, peer: int | None, numel: int | None) -> None:
        self._request, self._log, self._name, self._peer, self._numel = request, log, name, peer, numel

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        with self._log(f"wait({self._name})", self._peer, self._numel):
            return self._request.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # is_completed(), ... unchanged
        return getattr(self._request, name)


@contextlib.contextmanager
def recording(calls: list[dict], also: tuple[str, ...] = (), values: bool = False):
    """Wrap the torch.distributed functions in RECORDED (called as `dist.send(...)` etc.) so that each call appends
    {call, peer, numel, start, end, outcome} to `calls`: start and end in time.perf_counter() seconds (one clock for
    every process of a machine), outcome "returned" or "raised". batch_isend_irecv is one call, with the operations
    it posted under "ops" as [kind, peer, numel]; the requests it returns are recorded as wait(isend) / wait(irecv),
    in the order of its list.

    `also` names more functions to record, collectives such as "all_reduce" or "monitored_barrier": numel is their
    first tensor's, "op" the reduce op's name. One called with async_op=True returns its work handle recorded like
    a request (its wait() as wait(all_reduce)), and its entry gets "done": the moment its result was ready (the
    handle's future completed, on the backend's own thread). values=True adds a blocking collective's tensor as
    "in" (before the call) and "out" (after it), as lists."""
    import torch
    import torch.distributed as dist

    @contextlib.contextmanager
    def log(name: str, peer: int | None, numel: int | None = None):
        entry = {"call": name, "peer": peer, "numel": numel, "start": time.perf_counter(), "outcome": "returned"}
        calls.append(entry)
        try:
            yield
        except BaseException:
            entry["outcome"] = "raised"
            raise
        finally:
            entry["end"] = time.perf_counter()

    def wrap(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if name == "batch_isend_irecv":
                ops = list(args[0] if args else kwargs["p2p_op_list"])
                with log(name, None):
                    calls[-1]["ops"] = [["isend" if op.op is real_isend else "irecv", op.peer, op.tensor.numel()]
                                        for op in ops]  # what the one call posted
                    works = fn(*args, **kwargs)
                return [_Request(w, log, "isend" if op.op is real_isend else "irecv", op.peer, op.tensor.numel())
                        for w, op in zip(works, ops)]
            p2p = name in ("send", "recv", "isend", "irecv")
            peer = kwargs.get("dst", kwargs.get("src", args[1] if p2p and len(args) > 1 else None))
            numel = (args[0] if args else kwargs["tensor"]).numel() if p2p else None
            tensor = next((a for a in (*args, kwargs.get("tensor")) if isinstance(a, torch.Tensor)), None)
            collective = name in also
            with log(name, peer, tensor.numel() if collective and tensor is not None else numel):
                if collective and "reduce" in name:  # the op: by keyword, second positional, or the default SUM
                    op = kwargs.get("op", args[1] if len(args) > 1 else None)
                    calls[-1]["op"] = getattr(op, "name", "SUM") if op is not None else "SUM"
                if collective and values and tensor is not None and not kwargs.get("async_op"):
                    calls[-1]["in"] = tensor.tolist()
                entry = calls[-1]
                out = fn(*args, **kwargs)
                if "in" in entry:
                    entry["out"] = tensor.tolist()
            if collective and kwargs.get("async_op") and out is not None:
                # the handle's future completes when the result is ready: note the moment, on whatever thread
                out.get_future().add_done_callback(lambda _: entry.__setitem__("done", time.perf_counter()))
                return _Request(out, log, name, None, entry["numel"])
            return _Request(out, log, name, peer, numel) if name in ("isend", "irecv") else out
        return recorded

    originals = {name: getattr(dist, name) for name in (*RECORDED, *also)}
    real_isend, p2p_op = inspect.unwrap(originals["isend"]), dist.P2POp
    try:
        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        dist.P2POp = _p2p_op_taking_wrappers(p2p_op)  # so that P2POp(dist.isend, ...) accepts the wrapper
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        dist.P2POp = p2p_op


def note(calls: list[dict], what: str, value: Any = None) -> None:
    """An instant of the script's own in the same record: `what` happened now; `value` (a tensor is stored as its
    list) is what the script saw or wrote."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    now = time.perf_counter()
    calls.append({"call": what, "peer": None, "numel": None, "start": now, "end": now, "outcome": "note",
                  "value": value})
# --8<-- [end:recording]
