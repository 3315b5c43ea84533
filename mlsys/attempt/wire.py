"""What crosses between the checker and the attempt's process: plain data (Encoder, Decoder), exceptions as
data (describe, rebuild), and the framing (Wire: an 8-byte big-endian length, then UTF-8 JSON). The
checker's side trusts nothing it reads: a size cap, a deadline, a whitelist of types; never pickle."""

from __future__ import annotations

import base64
import json
import math
import os
import select
import socket
import struct
import sys
import time
from collections.abc import Callable, ItemsView, Iterator, KeysView, ValuesView
from pathlib import Path
from typing import Any

MAX_MESSAGE = 64 << 20  # bytes of one message the parent reads; an answer past it is an error of the task
MAX_DEPTH = 100  # nesting of a value (a list that contains itself ends here)
MAX_ITEMS = 1 << 22  # items one iterator the attempt returns may yield before it is cut off as an error
TORCH_DTYPES = ("float16", "bfloat16", "float32", "float64", "complex64", "complex128", "int8", "int16", "int32",
                "int64", "uint8", "bool")
NUMPY_DTYPES = ("float16", "float32", "float64", "complex64", "complex128", "int8", "int16", "int32", "int64",
                "uint8", "uint16", "uint32", "uint64", "bool")
# exceptions the attempt raises come back as the nearest of these builtins (the checker may catch ValueError...)
EXCEPTIONS = {cls.__name__: cls for cls in (
    ArithmeticError, AssertionError, AttributeError, BufferError, EOFError, FloatingPointError, ImportError,
    IndexError, KeyError, LookupError, MemoryError, ModuleNotFoundError, NameError, NotImplementedError, OSError,
    OverflowError, RecursionError, ReferenceError, RuntimeError, TypeError, UnboundLocalError, UnicodeError,
    ValueError, ZeroDivisionError)}
PLAIN = "numbers, strings, lists, tuples, dicts, sets, tensors, numpy arrays"


class ProtocolError(Exception):
    """A message that is not what the protocol allows: malformed, too large, or not asked for."""


class AttemptError(Exception):
    """An exception the attempt raised that is none of EXCEPTIONS (a torch error, a class of its own...)."""


class AttemptExit(BaseException):
    """The attempt called sys.exit (or raised KeyboardInterrupt...): never caught by a checker's except clause."""


# ----------------------------------------------------------------------------------------------- codec
def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: Any) -> bytes:
    if not isinstance(text, str):
        raise ProtocolError("bytes must be base64 text")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as err:
        raise ProtocolError(f"bad base64: {err}") from None


class Encoder:
    """Turns a value into JSON-ready data. `grad`: tensors that require grad are numbered (the parent's inputs of a
    call, the child's outputs); `generators`: torch.Generators numbered (their state comes back after a call);
    `callback`: the parent's way to pass a function (the child gets a stub that calls back); `exhaust`: the child
    turns iterators and ranges into lists (an attempt may return a generator where a list is expected)."""

    def __init__(self, *, grad: bool = False, callback: Callable | None = None, exhaust: bool = False,
                 ref_type: type | None = None):
        self.grad_tensors: list[Any] = []
        self.generators: list[Any] = []
        self.grad, self.callback, self.exhaust, self.ref_type = grad, callback, exhaust, ref_type

    def __call__(self, x: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError(f"a value nested more than {MAX_DEPTH} levels deep (a list that contains itself?)")
        kind = type(x)
        if x is None or x is True or x is False or kind is int or kind is str:
            return x
        if kind is float:
            return x if math.isfinite(x) else {"float": repr(x)}
        if kind is list:  # the common containers first: a checker may call a function thousands of times
            return [self(i, depth + 1) for i in x]
        if kind is tuple:
            return {"tuple": [self(i, depth + 1) for i in x]}
        np = sys.modules.get("numpy")
        torch = sys.modules.get("torch")
        if np is not None and isinstance(x, np.generic):
            return {"np": [self._np_dtype(x.dtype), self(x.item(), depth + 1)]}
        if isinstance(x, int):  # an int subclass (an __eq__ that says True stays behind): its plain value
            return int.__int__(x)
        if isinstance(x, float):
            return self(float.__float__(x), depth)
        if isinstance(x, complex):
            return {"complex": [self(complex.__complex__(x).real), self(complex.__complex__(x).imag)]}
        if isinstance(x, str):
            return str.__str__(x)
        if isinstance(x, (bytes, bytearray)):
            return {"bytes": _b64(bytes(x))}
        if torch is not None and isinstance(x, torch.Tensor):
            return {"tensor": self._tensor(x, torch)}
        if torch is not None and isinstance(x, torch.Generator):
            for slot, known in enumerate(self.generators):
                if known is x:  # the same generator again (in several calls of one request): the same object there
                    return {"generator": {"slot": slot}}
            self.generators.append(x)
            return {"generator": {"device": x.device.type, "state": _b64(x.get_state().numpy().tobytes()),
                                  "slot": len(self.generators) - 1}}
        if np is not None and isinstance(x, np.ndarray):
            a = np.ascontiguousarray(x)
            dtype = self._np_dtype(a.dtype)
            a = a.astype(a.dtype.newbyteorder("<"), copy=False)
            return {"ndarray": {"dtype": dtype, "shape": list(a.shape), "data": _b64(a.tobytes())}}
        if isinstance(x, tuple):
            return {"tuple": [self(i, depth + 1) for i in x]}
        if isinstance(x, list):
            return [self(i, depth + 1) for i in x]
        if isinstance(x, dict):
            return {"dict": [[self(k, depth + 1), self(v, depth + 1)] for k, v in dict.items(x)]}
        if isinstance(x, (set, frozenset)):
            return {type(x).__name__ if type(x) in (set, frozenset) else "set": [self(i, depth + 1) for i in x]}
        if self.ref_type is not None and isinstance(x, self.ref_type):  # the parent's handle on a child's object
            return {"ref": x._handle}
        if self.callback is not None and callable(x):
            return {"callback": self.callback(x)}
        if self.exhaust and isinstance(x, (range, Iterator, KeysView, ValuesView, ItemsView)):
            items = []
            for item in x:
                items.append(self(item, depth + 1))
                if len(items) > MAX_ITEMS:
                    raise TypeError(f"an iterator that yielded more than {MAX_ITEMS} items")
            return items
        raise TypeError(f"a {kind.__module__}.{kind.__qualname__} object, not plain data ({PLAIN})")

    @staticmethod
    def _np_dtype(dtype: Any) -> str:
        if dtype.name not in NUMPY_DTYPES:
            raise TypeError(f"a numpy array of dtype {dtype}, not one of {', '.join(NUMPY_DTYPES)}")
        return dtype.name

    def _tensor(self, x: Any, torch: Any) -> dict:
        t = x.detach()
        if type(t) is not torch.Tensor:
            t = torch.Tensor.as_subclass(t, torch.Tensor)
        dtype = str(t.dtype).removeprefix("torch.")
        if t.layout != torch.strided or t.is_quantized or t.is_meta or dtype not in TORCH_DTYPES:
            raise TypeError(f"a {t.layout} tensor of dtype {t.dtype}, not a dense tensor of one of {TORCH_DTYPES}")
        device = t.device.type
        t = t.resolve_conj().resolve_neg().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out = {"dtype": dtype, "shape": list(t.shape), "data": _b64(raw), "device": device}
        if self.grad and x.requires_grad:
            self.grad_tensors.append(x)
            out["grad"] = len(self.grad_tensors) - 1
        return out


class Decoder:
    """Rebuilds a value from Encoder's output, trusting nothing: every field is checked, only the types listed in
    the module docstring come out. `refs`: the child's table of objects the parent holds references to;
    `callback`: the child turns a callback number into a function that calls the parent back."""

    def __init__(self, *, refs: dict | None = None, callback: Callable | None = None, leaves: bool = False):
        self.refs, self.callback, self.leaves = refs, callback, leaves
        self.grad_tensors: dict[int, Any] = {}  # number -> tensor (the child: leaves that require grad)
        self.generators: dict[int, Any] = {}

    def __call__(self, j: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH + 2:
            raise ProtocolError("value nested too deep")
        if j is None or type(j) in (bool, int, float, str):
            return j
        if type(j) is list:
            return [self(i, depth + 1) for i in j]
        if type(j) is not dict or len(j) != 1:
            raise ProtocolError(f"unexpected {type(j).__name__} in a value")
        ((tag, v),) = j.items()
        if tag == "tuple":
            return tuple(self(self._list(v), depth + 1))
        if tag == "dict":
            out = {}
            for pair in self._list(v):
                if type(pair) is not list or len(pair) != 2:
                    raise ProtocolError("a dict item must be a [key, value] pair")
                out[self._hashable(self(pair[0], depth + 1))] = self(pair[1], depth + 1)
            return out
        if tag in ("set", "frozenset"):
            items = [self._hashable(self(i, depth + 1)) for i in self._list(v)]
            return set(items) if tag == "set" else frozenset(items)
        if tag == "float":
            if v not in ("nan", "inf", "-inf"):
                raise ProtocolError(f"bad float {str(v)[:20]!r}")
            return float(v)
        if tag == "complex":
            parts = [self(p) for p in self._list(v)]
            if len(parts) != 2 or not all(type(p) in (int, float) for p in parts):
                raise ProtocolError("a complex number is [real, imag]")
            return complex(*parts)
        if tag == "bytes":
            return _unb64(v)
        if tag == "np":
            import numpy as np

            items = self._list(v)
            if len(items) != 2 or items[0] not in NUMPY_DTYPES:
                raise ProtocolError("a numpy scalar is [dtype, value]")
            value = self(items[1], depth + 1)
            if type(value) not in (bool, int, float, complex):
                raise ProtocolError("a numpy scalar holds a number")
            try:
                return np.dtype(items[0]).type(value)
            except (OverflowError, ValueError, TypeError) as err:
                raise ProtocolError(f"bad numpy scalar: {err}") from None
        if tag == "ndarray":
            import numpy as np

            fields = self._fields(v, {"dtype", "shape", "data"})
            if fields["dtype"] not in NUMPY_DTYPES:
                raise ProtocolError(f"numpy dtype {str(fields['dtype'])[:20]!r} is not allowed")
            dtype = np.dtype(fields["dtype"]).newbyteorder("<")
            shape = self._shape(fields["shape"], dtype.itemsize, raw := _unb64(fields["data"]))
            return np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="), copy=True).reshape(shape)
        if tag == "tensor":
            return self._tensor(self._fields(v, {"dtype", "shape", "data", "device"}, {"grad"}))
        if tag == "generator":
            import torch

            if type(v) is dict and set(v) == {"slot"}:
                if v["slot"] not in self.generators:
                    raise ProtocolError("a generator seen before that was not")
                return self.generators[v["slot"]]
            fields = self._fields(v, {"device", "state", "slot"})
            device = "cuda" if fields["device"] == "cuda" and torch.cuda.is_available() else "cpu"
            g = torch.Generator(device=device)
            try:
                g.set_state(torch.frombuffer(bytearray(_unb64(fields["state"])), dtype=torch.uint8))
            except (RuntimeError, ValueError) as err:
                raise ProtocolError(f"bad generator state: {str(err)[:100]}") from None
            if type(fields["slot"]) is int:
                self.generators[fields["slot"]] = g
            return g
        if tag == "ref" and self.refs is not None:
            if v not in self.refs:
                raise ProtocolError("a reference to nothing")
            return self.refs[v]
        if tag == "callback" and self.callback is not None:
            return self.callback(v)
        raise ProtocolError(f"unexpected tag {str(tag)[:20]!r}")

    @staticmethod
    def _list(v: Any) -> list:
        if type(v) is not list:
            raise ProtocolError("expected a list")
        return v

    @staticmethod
    def _hashable(k: Any) -> Any:
        try:
            hash(k)
        except TypeError:
            raise ProtocolError("an unhashable dict key or set item") from None
        return k

    @staticmethod
    def _fields(v: Any, required: set, optional: set = frozenset()) -> dict:
        if type(v) is not dict or not required <= set(v) <= required | optional:
            raise ProtocolError(f"expected the fields {sorted(required)}")
        return v

    @staticmethod
    def _shape(shape: Any, itemsize: int, raw: bytes) -> tuple:
        if type(shape) is not list or len(shape) > 32 or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape):
            raise ProtocolError("a shape is a list of at most 32 sizes")
        if math.prod(shape) * itemsize != len(raw):
            raise ProtocolError(f"shape {shape} does not match {len(raw)} bytes of data")
        return tuple(shape)

    def _tensor(self, fields: dict) -> Any:
        import torch

        if fields["dtype"] not in TORCH_DTYPES:
            raise ProtocolError(f"tensor dtype {str(fields['dtype'])[:20]!r} is not allowed")
        dtype = getattr(torch, fields["dtype"])
        raw = _unb64(fields["data"])
        shape = self._shape(fields["shape"], dtype.itemsize, raw)
        t = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape) if raw else torch.empty(shape, dtype=dtype)
        if fields["device"] == "cuda" and torch.cuda.is_available():
            t = t.to("cuda")
        if "grad" in fields:
            if type(fields["grad"]) is not int:
                raise ProtocolError("a tensor's grad number must be an int")
            if t.is_floating_point() or t.is_complex():
                if self.leaves:
                    t.requires_grad_(True)
                self.grad_tensors[fields["grad"]] = t
        return t


def describe(err: BaseException, target: str = "") -> dict:
    """An exception as data: its type, the nearest builtin the parent may rebuild, its text, where in the attempt."""
    import traceback

    def text(value: Any) -> str:  # an exception's __str__ or __repr__ is the attempt's code too: it may raise
        try:
            return str(value)
        except Exception:
            return "(its text raised an exception)"

    base = next((c.__name__ for c in type(err).__mro__ if c.__module__ == "builtins" and c.__name__ in EXCEPTIONS),
                None)
    try:
        frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == target] if target else []
    except Exception:
        frames = []
    where = f" (line {frames[-1].lineno} of {Path(target).name})" if frames else ""
    if isinstance(err, SyntaxError):
        message, where = text(err.msg), f" (line {err.lineno} of {Path(target).name})" if target else ""
    else:
        message = text(err)
    out = {"type": text(type(err).__name__), "base": base, "message": message[:2000], "where": where,
           "exception": isinstance(err, Exception)}
    if isinstance(err, OSError) and type(err.errno) is int:
        out["errno"] = err.errno
    if isinstance(err, SystemExit):
        try:
            out["code"] = repr(err.code)[:100]
        except Exception:
            out["code"] = "?"
    return out


def _clean(text: Any, limit: int) -> str:
    """Text the child sent, shown to the learner: no control characters (a terminal escape cannot rewrite lines)."""
    text = str(text)[:limit]
    return "".join(c if c in "\n\t" or c.isprintable() else "?" for c in text)


def rebuild(info: Any) -> BaseException:
    """The exception an error description stands for (the parent: nothing but builtins and AttemptError/Exit)."""
    if type(info) is not dict or not all(type(info.get(k)) is str for k in ("type", "message", "where")):
        raise ProtocolError("malformed error description")
    name, message = _clean(info["type"], 100), _clean(info["message"], 2000)
    base = EXCEPTIONS.get(info.get("base")) if type(info.get("base")) is str else None
    if name == "SystemExit":
        err: BaseException = AttemptExit(f"the attempt called sys.exit({_clean(info.get('code', ''), 100)}); "
                                         "a check cannot pass that way")
    elif info.get("exception") is not True:  # KeyboardInterrupt, GeneratorExit...: no checker's except catches it
        err = AttemptExit(f"{name} raised by the attempt")
    elif base is OSError and type(info.get("errno")) is int:
        err = OSError(info["errno"], message)
    elif base is not None:
        err = base(message)
    else:
        err = AttemptError(message)
    err.attempt_info = {"type": name, "message": message, "where": _clean(info["where"], 200)}  # type: ignore
    return err


# ----------------------------------------------------------------------------------------------- wire
class Wire:
    """Length-prefixed JSON over a socket. The parent's side waits with deadlines and checks that the child lives;
    the child's side blocks (the parent kills it when it must)."""

    def __init__(self, sock: socket.socket, watch: Callable[[], None] | None = None):
        self.sock, self.fd, self.watch = sock, sock.fileno(), watch
        self.deadline = math.inf

    def send(self, msg: dict) -> None:
        data = json.dumps(msg, separators=(",", ":")).encode()
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"a message of {len(data) >> 20} MiB, more than the {MAX_MESSAGE >> 20} MiB allowed")
        view = memoryview(struct.pack(">Q", len(data)) + data)
        if self.watch is None:
            self.sock.sendall(view)
            return
        while view:
            self._wait(write=True)
            try:
                view = view[os.write(self.fd, view):]
            except BlockingIOError:
                continue
            except OSError as err:
                raise EOFError(f"connection closed ({err.strerror})") from None

    def recv(self) -> Any:
        (size,) = struct.unpack(">Q", self._read(8))
        if size > MAX_MESSAGE:
            raise ProtocolError(f"a message of {size} bytes, more than the {MAX_MESSAGE >> 20} MiB allowed")
        try:
            return json.loads(self._read(size))
        except (ValueError, RecursionError) as err:
            raise ProtocolError(f"not JSON: {str(err)[:100]}") from None

    def _read(self, n: int) -> bytes:
        parts, got = [], 0
        while got < n:
            if self.watch is not None:
                self._wait(write=False)
            try:
                chunk = os.read(self.fd, min(n - got, 1 << 20))
            except BlockingIOError:
                continue
            except OSError as err:
                raise EOFError(f"connection closed ({err.strerror})") from None
            if not chunk:
                raise EOFError("connection closed")
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def _wait(self, write: bool) -> None:
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            r, w, _ = select.select([] if write else [self.fd], [self.fd] if write else [], [], min(0.2, left))
            if r or w:
                return
            self.watch()  # type: ignore[misc]


