"""The link between a checker and the attempt's process (mlsys.attempt_link): what crosses it is plain data, read
defensively, and a checker written as if the attempt ran beside it (calls, a shared generator, loss.backward(),
reference helpers, source checks, the attempt's exceptions) behaves as it did in one process."""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest
import torch

from mlsys import exercises
from mlsys.attempt.wire import AttemptError, AttemptExit, Decoder, Encoder, ProtocolError, Wire, rebuild

ATTEMPT = '''\
import torch

def draw(generator):
    return torch.rand(2, generator=generator)

def square_sum(x, scale=1.0):
    return (x * x).sum() * scale, x.detach().clone().long()

def helper(v):
    return v + 1

def uses_helper(v):
    return helper(v)

def echo(value):
    return value

class Odd(KeyError):
    pass

def fails():
    raise Odd("no such block")

def rebind():
    global helper
    helper = lambda v: v - 1

def gives_a_generator(n):
    return (i * i for i in range(n))
'''

CHECKER = '''\
import math
import numpy as np
import torch
from mlsys.exercises import reference_helpers, source_of, task

@task("a generator shared with the attempt advances as in one process")
def check_generator(ex):
    g, h = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    got = [ex.draw(g), torch.rand(2, generator=g), ex.draw(g)]
    want = [torch.rand(2, generator=h) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)

@task("loss.backward() on a returned tensor fills the checker's grad")
def check_backward(ex):
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    loss, as_long = ex.square_sum(x, scale=0.5)
    assert as_long.dtype == torch.int64 and not as_long.requires_grad
    (loss * 2).backward()
    assert torch.allclose(x.grad, 2 * x.detach()), x.grad

@task("a reference helper runs in the checker's process; the attempt's own comes back after")
def check_helper(ex):
    calls = []
    def helper(v):
        calls.append(v)
        return v * 10
    with reference_helpers(ex, helper=helper):
        assert ex.uses_helper(3) == 30
    assert calls == [3] and ex.helper(3) == 4 and ex.uses_helper(3) == 4
    ex.rebind()  # the attempt rebinds its own global: ex.helper is read again
    assert ex.helper(3) == 2 and ex.uses_helper(3) == 2

@task("plain data comes back with its types")
def check_values(ex):
    values = [None, True, 3, 2 ** 80, 2.5, float("inf"), "s", b"\\x00b", (1, (2,)), [1], {"a": 1, (2, 3): "b"},
              {1, 2}, frozenset({3}), 1 + 2j, np.float32(1.5), np.int64(-4), np.arange(6.0).reshape(2, 3),
              torch.arange(6, dtype=torch.bfloat16).reshape(3, 2), torch.ones(0, 4, dtype=torch.bool)]
    got = ex.echo(values)
    assert [type(v) for v in got] == [type(v) for v in values], [type(v) for v in got]
    for a, b in zip(got, values):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        elif isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        else:
            assert a == b, (a, b)
    assert math.isnan(ex.echo(float("nan"))) and list(ex.gives_a_generator(4)) == [0, 1, 4, 9]

@task("the attempt's exception comes back as the nearest builtin, with its own name and line")
def check_exception(ex):
    try:
        ex.fails()
    except KeyError as err:
        info = err.attempt_info
        assert info["type"] == "Odd" and "no such block" in info["message"], info
        assert info["where"] == " (line 22 of ex1_link.py)", info
    else:
        raise AssertionError("no exception")

@task("source_of reads the attempt's file, a function or the whole module")
def check_source(ex):
    assert source_of(ex.draw).startswith("def draw(generator):") and source_of(ex).startswith("import torch")
'''


def test_a_checker_behaves_as_if_the_attempt_ran_beside_it(tmp_path) -> None:
    attempt, checker = tmp_path / "ex1_link.py", tmp_path / "check_ex1.py"
    attempt.write_text(ATTEMPT)
    checker.write_text(CHECKER)
    exercise = exercises.Exercise("ch00.1", attempt, attempt, checker)
    outcomes = exercises.check(exercise, target=attempt, time_limit=60)
    assert [o.status for o in outcomes] == ["PASS"] * 6, outcomes


# ----------------------------------------------------------------------------------------------- the codec
def test_plain_data_round_trips_and_objects_do_not() -> None:
    value = {"t": torch.randn(3, 2, dtype=torch.float64), "a": np.eye(2, dtype=np.int32), "n": [1, 2.5, None]}
    back = Decoder()(Encoder()(value))
    assert torch.equal(back["t"], value["t"]) and np.array_equal(back["a"], value["a"]) and back["n"] == value["n"]

    class EqualsAll(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    assert type(Decoder()(Encoder()(EqualsAll(7)))) is int  # its value, without its __eq__
    with pytest.raises(TypeError, match="not plain data"):
        Encoder()(object())
    loop: list = []
    loop.append(loop)
    with pytest.raises(TypeError, match="nested"):
        Encoder()(loop)
    with pytest.raises(TypeError, match="dtype object"):
        Encoder()(np.array([object()]))


@pytest.mark.parametrize("bad", [
    {"pickle": "gASVBAAAAAAAAACMAXiULg=="},  # an unknown tag
    {"ref": 0},  # a reference: only the child resolves those
    {"callback": 0},
    {"ndarray": {"dtype": "object", "shape": [1], "data": ""}},
    {"tensor": {"dtype": "float32", "shape": [3], "data": "AAAAAA==", "device": "cpu"}},  # 4 bytes for 3 floats
    {"tensor": {"dtype": "float32", "shape": [-1], "data": "", "device": "cpu"}},
    {"tensor": {"dtype": "qint8", "shape": [0], "data": "", "device": "cpu"}},
    {"tensor": {"dtype": "float32", "shape": [0], "data": "", "device": "cpu", "extra": 1}},
    {"dict": [[[1], 2]]},  # an unhashable key
    {"float": "1e999"},
    {"bytes": "not base64!"},
    {"tuple": [1], "list": [2]},
    {"generator": {"device": "cpu", "state": "AAAA", "slot": 0}},
], ids=lambda b: next(iter(b)))
def test_the_checker_rebuilds_only_the_types_it_allows(bad) -> None:
    with pytest.raises(ProtocolError):
        Decoder()(bad)


def test_deep_nesting_is_refused() -> None:
    deep: object = 1
    for _ in range(200):
        deep = [deep]
    with pytest.raises(ProtocolError):
        Decoder()(deep)


def test_an_exception_description_rebuilds_only_builtins() -> None:
    assert type(rebuild({"type": "ValueError", "base": "ValueError", "message": "m", "where": "",
                         "exception": True})) is ValueError
    # a base the checker must not rebuild (StopIteration would end a checker's loop early): a plain AttemptError
    assert type(rebuild({"type": "StopIteration", "base": "StopIteration", "message": "", "where": "",
                         "exception": True})) is AttemptError
    assert type(rebuild({"type": "SystemExit", "base": None, "message": "", "where": "", "code": "0",
                         "exception": False})) is AttemptExit
    err = rebuild({"type": "X", "base": "RuntimeError", "message": "a\x1b[2Kb", "where": "", "exception": True})
    assert err.attempt_info["message"] == "a?[2Kb"  # no terminal escapes in what the learner reads
    with pytest.raises(ProtocolError):
        rebuild({"type": 1})


def test_the_wire_refuses_a_message_past_its_cap_or_not_json() -> None:
    for sent, words in [(struct.pack(">Q", 1 << 40) + b"x" * 16, "more than"), (struct.pack(">Q", 5) + b"{nope",
                                                                              "not JSON")]:
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        wire = Wire(ours, watch=lambda: None)
        theirs.sendall(sent)
        with pytest.raises(ProtocolError, match=words):
            wire.recv()
        ours.close()
        theirs.close()


def test_the_wire_times_out_on_a_message_cut_short() -> None:
    """A header that promises bytes that never come ends at the deadline (the task FAILs), never blocks."""
    import time

    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    wire = Wire(ours, watch=lambda: None)
    wire.deadline = time.monotonic() + 0.5
    theirs.sendall(struct.pack(">Q", 100) + b"{")
    with pytest.raises(TimeoutError):
        wire.recv()
    ours.close()
    theirs.close()

