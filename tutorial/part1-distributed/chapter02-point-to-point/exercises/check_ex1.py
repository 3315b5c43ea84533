"""Checker for ch02.1 — runs your ring functions on 2, 3 and 4 real ranks and compares with numpy."""

from __future__ import annotations

import numpy as np
import torch

from mlsys.exercises import run_ranks, task

TIMEOUT_S = 10.0  # a deadlocked attempt fails after this long instead of hanging the checker


def inputs(world_size: int, numel: int) -> np.ndarray:
    rng = np.random.default_rng(world_size)
    return rng.normal(size=(world_size, numel)).astype(np.float32)  # row r: rank r's tensor


@task("ring_shift: rank r gets rank r-1's tensor (numpy.roll), for 2, 3 and 4 ranks, without deadlock")
def check_ring_shift(ex) -> None:
    for world_size, numel in [(2, 3), (3, 1), (4, 5)]:
        data = inputs(world_size, numel)
        got = run_ranks(ex, "ring_shift", [(torch.from_numpy(row),) for row in data], timeout=TIMEOUT_S)
        want = np.roll(data, 1, axis=0)
        assert np.array_equal(np.asarray(got, dtype=np.float32), want), \
            f"W={world_size}: ranks got {np.round(got, 3).tolist()}, expected {np.round(want, 3).tolist()}"


@task("ring_allgather: every rank holds all tensors in rank order, for 2, 3 and 4 ranks")
def check_ring_allgather(ex) -> None:
    for world_size, numel in [(2, 2), (3, 4), (4, 1)]:
        data = inputs(world_size, numel)
        got = run_ranks(ex, "ring_allgather", [(torch.from_numpy(row),) for row in data], timeout=TIMEOUT_S)
        for rank, held in enumerate(got):
            assert np.array_equal(np.asarray(held, dtype=np.float32), data), \
                f"W={world_size}: rank {rank} holds {np.round(held, 3).tolist()}, expected {np.round(data, 3).tolist()}"
