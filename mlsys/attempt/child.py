"""The attempt's process: its own process group, capped output and memory; it imports the attempt and answers
the checker's requests with observations (what the attempt's functions returned, as plain data)."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlsys.attempt.wire import Decoder, Encoder, Wire, describe, rebuild

_CONTEXT: Any = None


def context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        import multiprocessing as mp

        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed"])
    return _CONTEXT


def child_main(target: str, sock: socket.socket, output_path: str, memory_limit: int, output_limit: int) -> None:
    """In the child: own process group, capped output and memory, import the attempt, answer requests until EOF."""
    import resource
    import signal

    os.setsid()  # a group of our own: the parent can kill us and everything we start in one call
    output_fd = os.open(output_path, os.O_WRONLY | os.O_APPEND)
    for fd in (1, 2):
        os.dup2(output_fd, fd)  # the attempt's prints go to a file the parent reads the end of
    os.close(output_fd)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the cap a write fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (output_limit, output_limit))
    # memory: an attempt that grows without end gets MemoryError (its task FAILs) long before the machine's RAM
    # runs out; the cap is on data added beyond what this process (torch imported) already holds
    held = next((int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmData")), 0)
    resource.setrlimit(resource.RLIMIT_DATA, (held + memory_limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    import torch  # noqa: F401

    from mlsys.loader import load_module

    wire = Wire(sock)
    try:
        attempt = load_module(Path(target))
    except BaseException as err:  # a syntax error, an exception or sys.exit at import: every task fails with it
        info = describe(err, target)
        wire.send({"op": "load_error", "text": f"{info['type']}: {info['message']}".splitlines()[0][:300]
                   + info["where"]})
        return
    wire.send({"op": "ready"})
    _Server(wire, attempt, target).serve()
    sys.stdout.flush()


class _Server:
    """The child's side: answers the parent's requests about the attempt; observations only."""

    def __init__(self, wire: Wire, attempt: Any, target: str):
        self.wire, self.attempt, self.target = wire, attempt, target
        self.refs: dict[int, Any] = {}
        self.graphs: dict[int, tuple[dict, list]] = {}
        self.bound: dict[tuple[int, str], int] = {}  # (object, name) -> the reference the parent keeps for it
        self.calls = 0
        self._reset()

    def _reset(self) -> None:
        self.refs = {0: self.attempt}
        self.graphs.clear()
        self.bound.clear()

    def _stale(self) -> list:
        """The names whose reference the parent keeps that now hold another object (the attempt rebound them)."""
        stale = []
        for (ref, name), handle in list(self.bound.items()):
            try:
                same = getattr(self.refs[ref], name) is self.refs[handle]
            except Exception:
                same = False
            if not same:
                stale.append([ref, name])
                del self.bound[(ref, name)]
        return stale

    def serve(self) -> None:
        while True:
            try:
                msg = self.wire.recv()
            except EOFError:
                return
            self.answer(msg)

    def answer(self, msg: dict) -> None:
        try:
            reply = {"op": "return", "id": msg["id"], **self.dispatch(msg)}
            reply["stale"] = self._stale()
            self.wire.send(reply)
        except BaseException as err:  # the attempt's exception, sys.exit, MemoryError, a value not plain data...
            if isinstance(err, MemoryError):  # its frames hold what filled the memory: free them before describing
                err.__traceback__ = None
            self.wire.send({"op": "raise", "id": msg["id"], "error": describe(err, self.target),
                            "stale": self._stale()})

    def _ref(self, obj: Any) -> int:
        for handle, known in self.refs.items():
            if known is obj:
                return handle
        self.refs[len(self.refs)] = obj
        return len(self.refs) - 1

    def decoder(self, leaves: bool = False) -> Decoder:
        return Decoder(refs=self.refs, callback=self._callback, leaves=leaves)

    def dispatch(self, msg: dict) -> dict:
        op = msg["op"]
        if op == "getattr":
            value = getattr(self.refs[msg["ref"]], msg["name"])
            if not callable(value):
                try:
                    return {"value": Encoder(exhaust=False)(value)}
                except TypeError:
                    pass
            handle = self._ref(value)
            self.bound[(msg["ref"], msg["name"])] = handle
            return {"value": {"ref": handle}}
        if op == "setattr":
            setattr(self.refs[msg["ref"]], msg["name"], self.decoder()(msg["value"]))
            return {"value": None}
        if op == "call":
            dec = self.decoder(leaves=True)
            args, kwargs = dec(msg["args"]), dec(msg["kwargs"])
            fn = self.refs[msg["ref"]]
            result = fn(*args, **kwargs)
            enc = Encoder(grad=True, exhaust=True)
            try:
                value = enc(result)
            except TypeError as err:
                raise TypeError(f"{getattr(fn, '__name__', 'the function')} returned {err}") from None
            self.calls += 1
            if enc.grad_tensors and dec.grad_tensors:  # kept for a later "grad" request
                self.graphs[self.calls] = (dec.grad_tensors, enc.grad_tensors)
            states = {str(k): Encoder()(g)["generator"]["state"] for k, g in dec.generators.items()}
            return {"value": value, "call": self.calls, "generators": states}
        if op == "map":  # the same function over many argument lists, in order: one request for thousands of calls
            dec = self.decoder()
            fn, calls = self.refs[msg["ref"]], dec(msg["calls"])
            results = [fn(*args) for args in calls]
            try:
                value = Encoder(exhaust=True)(results)
            except TypeError as err:
                raise TypeError(f"{getattr(fn, '__name__', 'the function')} returned {err}") from None
            states = {str(k): Encoder()(g)["generator"]["state"] for k, g in dec.generators.items()}
            return {"value": value, "generators": states}
        if op == "ranks":
            from mlsys.loader import run_ranks_here

            per_rank = self.decoder()(msg["args"])
            result = run_ranks_here(self.attempt, msg["name"], per_rank, backend=msg["backend"], timeout=msg["timeout"])
            return {"value": Encoder(exhaust=True)(result)}
        if op == "grad":
            import torch

            inputs, outputs = self.graphs[msg["call"]]
            grads = self.decoder()(msg["grads"])
            wanted = [inputs[k] for k in sorted(inputs)]
            got = torch.autograd.grad(outputs, wanted, grads, allow_unused=True, retain_graph=True)
            return {"value": Encoder()({k: g for k, g in zip(sorted(inputs), got)})}
        if op == "end":
            self._reset()
            return {"value": None}
        raise ValueError(f"unknown request {op!r}")

    def _callback(self, number: int) -> Callable:
        def reference(*args: Any, **kwargs: Any) -> Any:
            """One of the checker's reference functions: runs in the checker's process."""
            self.calls += 1
            rid = -self.calls  # the child's requests have negative ids
            self.wire.send({"op": "callback", "id": rid, "callback": number, "args": Encoder(exhaust=True)(list(args)),
                            "kwargs": Encoder(exhaust=True)(kwargs), "stale": self._stale()})
            while True:
                msg = self.wire.recv()
                if msg.get("id") == rid and msg.get("op") == "return":
                    return self.decoder()(msg["value"])
                if msg.get("id") == rid and msg.get("op") == "raise":
                    raise rebuild(msg["error"])
                self.answer(msg)  # the reference function asked the attempt something in turn

        return reference


