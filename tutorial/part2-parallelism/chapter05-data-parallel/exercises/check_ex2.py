"""Checker for ch05.2 — shard bounds against their definition, and your reduce-scatter on real ranks against the
numpy mean of every rank's gradient, padded and sliced."""

from __future__ import annotations

import math

import numpy as np
import torch

from mlsys.exercises import run_ranks, source_of, task


@task("shard_bounds: padded is the smallest multiple of W >= numel, and the ranks tile [0, padded) in order")
def check_shard_bounds(ex) -> None:
    for numel in (1, 2, 7, 10, 12, 29_024):
        for world_size in (1, 2, 3, 4, 8):
            want_padded = math.ceil(numel / world_size) * world_size
            size = want_padded // world_size
            for rank in range(world_size):
                got = tuple(ex.shard_bounds(numel, world_size, rank))
                want = (want_padded, rank * size, (rank + 1) * size)
                assert got == want, f"shard_bounds({numel}, {world_size}, {rank}) = {got}, want {want}"


@task("reduce_scatter_grad on 1-4 ranks returns this rank's slice of the mean gradient (zeros in the padding)")
def check_reduce_scatter_grad(ex) -> None:
    for world_size, numel in [(1, 5), (2, 7), (3, 10), (4, 3)]:
        rng = np.random.default_rng(world_size * 100 + numel)
        grads = [rng.normal(size=numel).astype(np.float32) for _ in range(world_size)]
        padded = math.ceil(numel / world_size) * world_size
        mean = np.zeros(padded, dtype=np.float64)
        mean[:numel] = np.mean(grads, axis=0)
        size = padded // world_size
        got = run_ranks(ex, "reduce_scatter_grad", [(torch.from_numpy(g),) for g in grads])
        for rank, g in enumerate(got):
            want = mean[rank * size:(rank + 1) * size]
            assert np.shape(g) == want.shape, f"W={world_size}, numel={numel}: rank {rank} got shape {np.shape(g)}"
            assert np.allclose(g, want, atol=1e-6), f"W={world_size}, numel={numel}: rank {rank} got {g}, want {want}"


@task("reduce_scatter_grad uses a reduce-scatter, not an all-reduce")
def check_uses_reduce_scatter(ex) -> None:
    source = source_of(ex.reduce_scatter_grad)
    if "NotImplementedError" in source:
        raise NotImplementedError("TODO: write reduce_scatter_grad first")
    assert "all_reduce" not in source, "reduce_scatter_grad calls all_reduce: every rank would get everything"
    assert "reduce_scatter" in source or "REDUCE_SCATTER" in source, "use dist.reduce_scatter_single"
