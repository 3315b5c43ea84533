"""Checker for ch14.1 — your bucket planning against mlsys.weight_sync.plan_buckets, your packing against torch's
own _flatten_dense_tensors, and your bucketed broadcast on 3 real ranks, compared bit for bit."""

from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from mlsys.exercises import run_ranks, source_of, task
from mlsys.weight_sync import plan_buckets

DTYPES = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.int64": torch.int64}


def _case(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 5), (7,), (1,), (4, 4, 2), (33,), (2, 9), (100,), (6, 6)]
    out = []
    for i, shape in enumerate(shapes):
        dtype = list(DTYPES.values())[i % 3]
        t = torch.randint(-99, 99, shape, generator=g) if dtype is torch.int64 else torch.randn(shape, generator=g)
        out.append(t.to(dtype))
    return out


@task("assign_buckets: a hand case (fits exactly, overflows, oversized, other dtype)")
def check_hand_case(ex) -> None:
    got = ex.assign_buckets([40, 80, 20, 400, 4], ["f32", "f32", "f32", "f32", "bf16"], 120)
    want = [[0, 1], [2], [3], [4]]  # 40 + 80 = 120 fits; +20 overflows; 400 alone; bf16 its own bucket
    assert got == want, f"assign_buckets([40, 80, 20, 400, 4], ...) = {got}, want {want}"


@task("assign_buckets: equals mlsys.weight_sync.plan_buckets for many bucket sizes")
def check_against_library(ex) -> None:
    tensors = _case(0)
    meta = [(str(i), tuple(t.shape), t.dtype) for i, t in enumerate(tensors)]
    for cap in (1, 8, 64, 100, 300, 1000, 1 << 20):
        want = [[int(s.name) for s in b.slots] for b in plan_buckets(meta, cap)]
        got = ex.assign_buckets([t.numel() * t.element_size() for t in tensors], [str(t.dtype) for t in tensors], cap)
        assert got == want, f"bucket_bytes={cap}: got {got}, want {want}"


@task("pack: equals torch._utils._flatten_dense_tensors")
def check_pack(ex) -> None:
    tensors = [t for t in _case(1) if t.dtype == torch.float32]
    flat = ex.pack(tensors)
    assert torch.equal(flat, _flatten_dense_tensors(tensors)), "pack differs from torch's flatten"


@task("unpack: torch's flat buffer back into the shapes, bit for bit (torch._utils._unflatten_dense_tensors)")
def check_unpack(ex) -> None:
    tensors = [t for t in _case(1) if t.dtype == torch.float32]
    back = ex.unpack(_flatten_dense_tensors(tensors), [tuple(t.shape) for t in tensors])
    want = _unflatten_dense_tensors(_flatten_dense_tensors(tensors), tensors)
    assert len(back) == len(want), f"unpack returned {len(back)} tensors, want {len(want)}"
    for i, (a, b) in enumerate(zip(back, want)):
        assert tuple(a.shape) == tuple(b.shape), f"tensor {i}: shape {tuple(a.shape)}, want {tuple(b.shape)}"
        assert torch.equal(a, b), f"tensor {i} differs from its slice of the flat buffer"


@task("sync_bucketed on 3 ranks: every rank ends with rank 0's tensors, bit for bit")
def check_sync(ex) -> None:
    if "NotImplementedError" in source_of(ex.sync_bucketed):
        raise NotImplementedError("TODO: write sync_bucketed")
    # the ranks run your sync_bucketed with your assign_buckets / pack / unpack (they load this same file): those
    # are checked on paper first, so a wrong helper is named here instead of showing up as a wrong broadcast
    want = _case(2)
    nbytes, dtypes = [t.numel() * t.element_size() for t in want], [str(t.dtype) for t in want]
    meta = [(str(i), tuple(t.shape), t.dtype) for i, t in enumerate(want)]
    planned = [[int(s.name) for s in b.slots] for b in plan_buckets(meta, 100)]
    assert ex.assign_buckets(nbytes, dtypes, 100) == planned, "fix assign_buckets first (its own tasks above)"
    floats = [t for t in want if t.dtype == torch.float32]
    assert torch.equal(ex.pack(floats), _flatten_dense_tensors(floats)), "fix pack first (its own task above)"
    back = ex.unpack(_flatten_dense_tensors(floats), [tuple(t.shape) for t in floats])
    assert all(torch.equal(a, b) for a, b in zip(back, floats)), "fix unpack first (its own task above)"
    per_rank = [([t.clone() if r == 0 else torch.zeros_like(t) for t in want], 100, 0) for r in range(3)]
    results = run_ranks(ex, "sync_bucketed", per_rank)
    expected = torch.cat([t.double().reshape(-1) for t in want])
    for rank, got in enumerate(results):
        got = torch.as_tensor(got, dtype=torch.float64)
        assert got.shape == expected.shape, f"rank {rank}: returned {got.numel()} values, want {expected.numel()}"
        wrong = (got != expected).nonzero().flatten().tolist()
        assert not wrong, f"rank {rank}: {len(wrong)} values differ from rank 0's, first at flat index {wrong[0]}"
