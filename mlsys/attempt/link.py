"""The checker's side: `ex` in a task is a RemoteRef on the attempt's module; every read, call, backward pass
is a request to the attempt's process with the task's deadline, and every answer is decoded as plain data.
PASS or FAIL is decided here, by the checker's own code on those observations."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlsys.attempt.child import child_main, context
from mlsys.attempt.wire import Decoder, Encoder, ProtocolError, Wire, _clean, describe, rebuild


class Lost(BaseException):
    """The attempt's process can no longer answer (time limit, death, broken protocol). A BaseException, so the
    checker's `except ValueError` / `except Exception` never swallows it; the task FAILs with `detail`."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


class RemoteRef:
    """The parent's handle on an object in the attempt's process: the module (`ex` in a checker), a function, a
    class. Attribute reads and calls are requests; comparisons and hashing are by identity, never the attempt's."""

    __slots__ = ("_link", "_handle", "_path", "__weakref__")

    def __init__(self, link: Link, handle: int, path: tuple[str, ...]):
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name: str) -> Any:
        if name in ("__name__", "__qualname__"):
            return self._path[-1] if self._path else self._link.module_name
        if name == "__file__" and not self._path:
            return str(self._link.target)
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self._link.getattr(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._link.setattr(self, name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._link.call(self, args, kwargs)

    def __repr__(self) -> str:
        return f"<the attempt's {'.'.join(self._path) or 'module'}>"


_REMOTE_GRAD: Any = None


def _remote_grad() -> Any:
    global _REMOTE_GRAD
    if _REMOTE_GRAD is not None:
        return _REMOTE_GRAD
    import torch

    class RemoteGrad(torch.autograd.Function):
        """Connects a call's outputs to its inputs in the parent's autograd graph: backward asks the child."""

        @staticmethod
        def forward(ctx: Any, link: Link, call: int, outputs: tuple, *inputs: Any) -> tuple:
            ctx.link, ctx.call, ctx.inputs = link, call, [(t.shape, t.dtype, t.device) for t in inputs]
            return tuple(o.clone() for o in outputs)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> tuple:
            return (None, None, None, *ctx.link.grad(ctx.call, grads, ctx.inputs))

    _REMOTE_GRAD = RemoteGrad
    return RemoteGrad


def _substitute(x: Any, new: dict[int, Any]) -> Any:
    if id(x) in new:
        return new[id(x)]
    if type(x) is list:
        return [_substitute(i, new) for i in x]
    if type(x) is tuple:
        return tuple(_substitute(i, new) for i in x)
    if type(x) is dict:
        return {k: _substitute(v, new) for k, v in x.items()}
    return x


class Link:
    """The parent's side of one child: start it, send requests with the task's deadline, read answers as data."""

    def __init__(self, target: Path, source: str, time_limit: float, memory_limit: int, output_limit: int):
        self.target, self.source_text, self.time_limit = target, source, time_limit
        self.module_name = target.stem
        self.output = tempfile.NamedTemporaryFile(prefix="mlsys-attempt-", suffix=".log")
        ours, theirs = socket.socketpair()
        ctx = context()
        self.child = ctx.Process(target=child_main, args=(str(target), theirs, self.output.name, memory_limit,
                                                           output_limit))
        self.child.start()
        theirs.close()
        ours.setblocking(False)
        self.wire = Wire(ours, watch=self._watch)
        self.lost: Lost | None = None
        self.ready = False
        self.load_error = ""
        self.next_id = 0
        self.callbacks: dict[int, Callable] = {}  # the checker's functions the attempt may call back, this task's
        self.next_callback = 0
        self.module = RemoteRef(self, 0, ())
        self.refs: dict[int, RemoteRef] = {0: self.module}
        self.bound: dict[tuple[int, str], RemoteRef] = {}  # ex.f read before: no request until the child says stale

    # -- the task's frame
    def start_task(self) -> None:
        self.wire.deadline = time.monotonic() + self.time_limit
        if not self.ready and not self.load_error:
            msg = self._recv()
            if type(msg) is dict and msg.get("op") == "ready":
                self.ready = True
            elif type(msg) is dict and msg.get("op") == "load_error":
                self.load_error = _clean(msg.get("text", ""), 400).replace("\n", " ")
            else:
                raise self._lose("protocol", "its first message was neither 'ready' nor 'load_error'")

    def end_task(self) -> None:
        self.callbacks.clear()
        self.refs = {0: self.module}
        self.bound.clear()
        if self.lost is None and self.ready:
            self._request({"op": "end"})

    def close(self) -> None:
        import signal

        try:
            self.wire.sock.close()
        except OSError:
            pass
        self.child.join(2)
        try:
            os.killpg(self.child.pid, signal.SIGKILL)  # the child and anything it left running in its group
        except (ProcessLookupError, PermissionError):
            pass
        self.child.join(5)
        self.output.close()

    # -- requests
    def getattr(self, ref: RemoteRef, name: str) -> Any:
        if (ref._handle, name) in self.bound:
            return self.bound[(ref._handle, name)]
        value = self._request({"op": "getattr", "ref": ref._handle, "name": name})["value"]
        if type(value) is dict and set(value) == {"ref"}:
            handle = value["ref"]
            if type(handle) is not int:
                raise self._lose("protocol", "a reference that is not a number")
            if handle not in self.refs:
                self.refs[handle] = RemoteRef(self, handle, (*ref._path, name))
            self.bound[(ref._handle, name)] = self.refs[handle]
            return self.refs[handle]
        return self._decode(Decoder(), value)

    def setattr(self, ref: RemoteRef, name: str, value: Any) -> None:
        self.bound.pop((ref._handle, name), None)
        self._request({"op": "setattr", "ref": ref._handle, "name": name,
                       "value": Encoder(callback=self._register, ref_type=RemoteRef)(value)})

    def call(self, ref: RemoteRef, args: tuple, kwargs: dict) -> Any:
        enc = Encoder(grad=True, callback=self._register, ref_type=RemoteRef)
        msg = {"op": "call", "ref": ref._handle, "args": enc(list(args)), "kwargs": enc(dict(kwargs))}
        reply = self._request(msg)
        dec = Decoder()
        value = self._decode(dec, reply.get("value"))
        if type(reply.get("call")) is not int:
            raise self._lose("protocol", "a call's answer without its number")
        self._advance(enc.generators, reply.get("generators"))
        if dec.grad_tensors:
            outputs = [dec.grad_tensors[k] for k in sorted(dec.grad_tensors)]
            if enc.grad_tensors:
                joined = _remote_grad().apply(self, reply["call"], tuple(outputs), *enc.grad_tensors)
                value = _substitute(value, {id(o): j for o, j in zip(outputs, joined)})
            else:
                for o in outputs:
                    o.requires_grad_(True)
        return value

    def map(self, ref: RemoteRef, calls: list) -> list:
        """[ref(*args) for args in calls] in one request (no gradients: the arguments are sent without them)."""
        enc = Encoder(callback=self._register, ref_type=RemoteRef)
        reply = self._request({"op": "map", "ref": ref._handle, "calls": enc([list(args) for args in calls])})
        value = self._decode(Decoder(), reply.get("value"))
        if type(value) is not list or len(value) != len(calls):
            raise self._lose("protocol", "a map's answer that is not one result per call")
        self._advance(enc.generators, reply.get("generators"))
        return value

    def _advance(self, generators: list, states: Any) -> None:
        """The attempt drew from the checker's generators: advance them to where the attempt's copies stopped."""
        if type(states) is not dict:
            raise self._lose("protocol", "an answer without its generators' states")
        for slot, g in enumerate(generators):
            if str(slot) in states:
                fresh = self._decode(Decoder(), {"generator": {"device": g.device.type, "state": states[str(slot)],
                                                               "slot": None}})
                g.set_state(fresh.get_state())

    def ranks(self, fn_name: str, per_rank_args: list, backend: str, timeout: float) -> Any:
        msg = {"op": "ranks", "name": fn_name, "args": Encoder()(per_rank_args), "backend": backend,
               "timeout": timeout}
        return self._decode(Decoder(), self._request(msg).get("value"))

    def grad(self, call: int, grads: tuple, inputs: list) -> list:
        import torch

        got = self._decode(Decoder(), self._request({"op": "grad", "call": call, "grads": Encoder()(list(grads))})
                           .get("value"))
        if type(got) is not dict:
            raise self._lose("protocol", "a gradient answer that is not a dict")
        out = []
        for k, (shape, dtype, device) in enumerate(inputs):
            g = got.get(k)
            if g is not None and (not isinstance(g, torch.Tensor) or g.shape != shape):
                raise RuntimeError(f"the attempt's gradient for input {k} has shape "
                                   f"{tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__}, "
                                   f"want {tuple(shape)}")
            out.append(None if g is None else g.to(dtype=dtype, device=device))
        return out

    def source(self, ref: RemoteRef) -> str:
        """The source of the attempt's module or of one of its top-level functions or classes, read from the file
        as it was before the attempt ran (the attempt's process is not asked)."""
        import ast

        if not ref._path:
            return self.source_text
        try:
            tree = ast.parse(self.source_text)
        except SyntaxError:
            raise OSError("could not get the source: the attempt does not parse") from None
        lines = self.source_text.splitlines(keepends=True)
        body = tree.body
        node = None
        for name in ref._path:
            node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                         and n.name == name), None)
            if node is None:
                raise OSError(f"could not find the source of {'.'.join(ref._path)} (not a def or class in the file)")
            body = node.body
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])  # type: ignore[union-attr]
        return "".join(lines[first - 1:node.end_lineno])  # type: ignore[union-attr]

    # -- machinery
    def _register(self, fn: Callable) -> int:
        self.next_callback += 1  # never reused: a stub left in the attempt by an earlier task calls nothing
        self.callbacks[self.next_callback] = fn
        return self.next_callback

    def _request(self, msg: dict) -> dict:
        if self.lost is not None:
            raise self.lost
        self.next_id += 1
        rid = msg["id"] = self.next_id
        self._send(msg)
        while True:
            reply = self._recv()
            op = reply.get("op") if type(reply) is dict else None
            self._forget(reply.get("stale", []) if op else [])
            if op in ("return", "raise") and reply.get("id") == rid:
                if op == "raise":
                    raise self._protocol(rebuild, reply.get("error"))
                return reply
            if op in ("return", "raise") and type(reply.get("id")) is int and 0 < reply["id"] < rid:
                continue  # the late answer to a request abandoned when a reference function raised
            if op == "callback" and type(reply.get("id")) is int:
                self._serve_callback(reply)
                continue
            raise self._lose("protocol", f"a message it was not asked for ({str(op)[:30]!r})")

    def _forget(self, stale: Any) -> None:
        if type(stale) is not list or not all(type(s) is list and len(s) == 2 for s in stale):
            raise self._lose("protocol", "a malformed list of rebound names")
        for handle, name in stale:
            if type(handle) is int and type(name) is str:
                self.bound.pop((handle, name), None)

    def _serve_callback(self, msg: dict) -> None:
        number = msg.get("callback")
        fn = self.callbacks.get(number) if type(number) is int else None
        if fn is None:
            err = RuntimeError("the checker's reference function belonged to an earlier task")
            self._send({"op": "raise", "id": msg["id"], "error": describe(err)})
            return
        args, kwargs = self._decode(Decoder(), msg.get("args")), self._decode(Decoder(), msg.get("kwargs"))
        if type(args) is not list or type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
            raise self._lose("protocol", "a callback without its arguments")
        try:
            value = Encoder(callback=self._register, ref_type=RemoteRef)(fn(*args, **kwargs))
        except Lost:
            raise
        except BaseException as err:  # the reference function raised: so does the stub the attempt called
            self._send({"op": "raise", "id": msg["id"], "error": describe(err)})
            if not isinstance(err, Exception):
                raise
            return
        self._send({"op": "return", "id": msg["id"], "value": value})

    def _decode(self, dec: Decoder, value: Any) -> Any:
        return self._protocol(dec, value)

    def _protocol(self, fn: Callable, value: Any) -> Any:
        try:
            return fn(value)
        except (ProtocolError, RecursionError, KeyError, TypeError, ValueError) as err:
            raise self._lose("protocol", str(err)[:200]) from None

    def _send(self, msg: dict) -> None:
        try:
            self.wire.send(msg)
        except TimeoutError:
            raise self._lose("timeout") from None
        except EOFError:
            raise self._lose("closed") from None

    def _recv(self) -> Any:
        try:
            return self.wire.recv()
        except TimeoutError:
            raise self._lose("timeout") from None
        except EOFError:
            raise self._lose("closed") from None
        except ProtocolError as err:
            raise self._lose("protocol", str(err)) from None

    def _watch(self) -> None:
        if not self.child.is_alive():
            raise self._lose("closed")

    def _lose(self, why: str, what: str = "") -> Lost:
        import signal

        if self.lost is not None:
            return self.lost
        self.child.join(0.5 if why == "closed" else 0)
        alive = self.child.is_alive()
        try:
            os.killpg(self.child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.child.kill()
        self.child.join(5)
        if why == "timeout":
            detail = (f"no result after {self.time_limit:g} s (an endless loop, or ranks waiting for each other?); "
                      "the attempt's processes were stopped")
        elif why == "closed" and not alive:
            detail = how_it_died(self.child.exitcode)
        elif why == "closed":
            detail = "the attempt closed the checker's connection to its process"
        else:
            detail = f"the attempt's process broke the checker's protocol ({_clean(what, 200)}); a check cannot " \
                     "pass that way"
        tail = _tail(self.output)
        self.lost = Lost(detail + (f"; it printed: {tail}" if tail else ""))
        return self.lost


def how_it_died(exitcode: int | None) -> str:
    import signal

    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"the attempt killed the checker's process ({name})"
    return f"the attempt ended the checker's process (exit code {exitcode}, e.g. sys.exit or os._exit)"


def _tail(output: Any, limit: int = 300) -> str:
    """The last line the attempt printed, shortened: enough to recognise, never a flood."""
    try:
        size = os.fstat(output.fileno()).st_size
        output.seek(max(0, size - 4096))
        lines = output.read().decode("utf-8", "replace").strip().splitlines()
    except (OSError, ValueError):
        return ""
    return _clean(lines[-1][:limit] + ("..." if len(lines[-1]) > limit else ""), limit + 3) if lines else ""
