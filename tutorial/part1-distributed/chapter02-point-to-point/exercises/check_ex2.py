"""Checker for ch02.2 — the chain's formula against a loop, the chain on 1-4 real ranks against numpy's cumulative
sum, and your ordered ring on 2-4 ranks against numpy.roll (a deadlocked ring fails after 10 seconds)."""

from __future__ import annotations

import numpy as np
import torch

from mlsys.exercises import run_ranks, source_of, task

TIMEOUT_S = 10.0


@task("chain_expected: start + 0 + 1 + ... + rank, for ranks 0-40")
def check_chain_expected(ex) -> None:
    for start in (0.0, 10.0, -2.5):
        total = start
        for rank in range(41):
            total += rank  # what the chain itself adds, one rank at a time
            got = ex.chain_expected(start, rank)
            assert abs(float(got) - total) < 1e-9, f"chain_expected({start}, {rank}) = {got}, expected {total}"


@task("chain on 1, 2, 3 and 4 real ranks: rank r holds start + cumsum(0..r)")
def check_chain(ex) -> None:
    for world_size, start in [(1, 5.0), (2, 0.0), (3, 1.5), (4, 10.0)]:
        got = run_ranks(ex, "chain", [(start,)] * world_size, timeout=TIMEOUT_S)
        want = (start + np.cumsum(np.arange(world_size))).tolist()
        assert [float(g) for g in got] == want, f"W={world_size}, start {start}: ranks hold {got}, expected {want}"


@task("ordered_ring_shift on 2, 3 and 4 ranks equals numpy.roll(inputs, 1), with blocking calls only")
def check_ordered_ring(ex) -> None:
    source = source_of(ex.ordered_ring_shift)
    if "NotImplementedError" in source:
        raise NotImplementedError("TODO: write ordered_ring_shift first")
    for name in ("isend", "irecv", "batch_isend_irecv", "all_gather", "all_to_all"):
        assert name not in source, f"ordered_ring_shift uses {name}: this exercise is about ordering blocking calls"
    for world_size in (2, 3, 4):
        data = np.random.default_rng(world_size).normal(size=(world_size, 3)).astype(np.float32)
        got = run_ranks(ex, "ordered_ring_shift", [(torch.from_numpy(row),) for row in data], timeout=TIMEOUT_S)
        want = np.roll(data, 1, axis=0)
        assert np.array_equal(np.asarray(got, dtype=np.float32), want), \
            f"W={world_size}: ranks got {np.round(np.asarray(got, dtype=float), 3).tolist()}, " \
            f"expected {np.round(want.astype(float), 3).tolist()}"
