"""Checker for ch06.2 — your formulas against the functions the chapter's scripts assert on
(mlsys.tensor_parallel.layer_comm_volume and block_activation_bytes), over a grid of shapes and t."""

from __future__ import annotations

import math

from mlsys.exercises import task
from mlsys.tensor_parallel import block_activation_bytes, layer_comm_volume

SHAPES = [(2, 16, 32, 4), (8, 1024, 4096, 32), (1, 7, 12, 3)]  # (batch, seq, hidden, heads)


@task("block_comm_bytes: forward and backward bytes per rank, TP and TP + SP, t = 1, 2, 4, 8")
def check_comm(ex) -> None:
    for b, s, h, _ in SHAPES:
        for t in (1, 2, 4, 8):
            for dtype_bytes in (2, 4):
                for sp in (False, True):
                    want = layer_comm_volume(b, s, h, t, dtype_bytes, sequence_parallel=sp)
                    got = tuple(ex.block_comm_bytes(b, s, h, t, dtype_bytes, sp))
                    for name, g, w in zip(("forward", "backward"), got,
                                          (want["forward_sent_per_rank"], want["backward_sent_per_rank"])):
                        assert math.isclose(g, w, rel_tol=1e-12, abs_tol=1e-9), \
                            f"b={b} s={s} h={h} t={t} {dtype_bytes}-byte {'TP+SP' if sp else 'TP'}: {name} {g:g}, " \
                            f"want {w:g}"


@task("block_activation_bytes: TP and TP + SP, t = 1, 2, 4, 8")
def check_memory(ex) -> None:
    for b, s, h, a in SHAPES:
        for t in (1, 2, 4, 8):
            for sp in (False, True):
                want = block_activation_bytes(b, s, h, a, t, 4, sequence_parallel=sp)["bytes"]
                got = ex.block_activation_bytes(b, s, h, a, t, 4, sp)
                assert math.isclose(got, want, rel_tol=1e-12), \
                    f"b={b} s={s} h={h} heads={a} t={t} {'TP+SP' if sp else 'TP'}: {got:g} bytes, want {want:g}"


@task("sp_saving: the ratio of the sbh terms, 1.25 at t = 2 and 1.75 at t = 4")
def check_saving(ex) -> None:
    for t in (1, 2, 3, 4, 8, 64):
        want = (4 + 12 / t) / (16 / t)
        assert math.isclose(ex.sp_saving(t), want, rel_tol=1e-12), f"sp_saving({t}) = {ex.sp_saving(t)}, want {want}"
