"""Checker for ch03.1 — runs your functions on real ranks and compares with numpy/torch on the full data."""

from __future__ import annotations

import numpy as np
import torch

from mlsys.exercises import run_ranks, task


@task("sharded_mean_var over uneven shards (one empty) equals numpy's mean and var of everything")
def check_mean_var(ex) -> None:
    rng = np.random.default_rng(3)
    for sizes in [[6], [2, 9], [5, 0, 11]]:
        shards = [rng.normal(4.0, 1.5, size=n).astype(np.float32) for n in sizes]
        full = np.concatenate(shards).astype(np.float64)
        got = run_ranks(ex, "sharded_mean_var", [(torch.from_numpy(s),) for s in shards])
        for rank, (mean, var) in enumerate(got):
            assert abs(mean - full.mean()) < 1e-6, f"sizes {sizes}: rank {rank} mean {mean}, want {full.mean():.6f}"
            assert abs(var - full.var()) < 1e-6, f"sizes {sizes}: rank {rank} var {var}, want {full.var():.6f}"


@task("sharded_softmax slices equal torch.softmax of the whole vector, even for values near 1000")
def check_softmax(ex) -> None:
    rng = np.random.default_rng(4)
    for sizes, offset in [([5], 0.0), ([3, 4], 0.0), ([1, 6, 2], 1000.0)]:
        shards = [torch.from_numpy(rng.normal(offset, 3.0, size=n).astype(np.float32)) for n in sizes]
        want = torch.softmax(torch.cat(shards), 0).split(sizes)
        got = run_ranks(ex, "sharded_softmax", [(s,) for s in shards])
        for rank, (g, w) in enumerate(zip(got, want)):
            assert np.all(np.isfinite(g)), f"sizes {sizes}, values near {offset}: rank {rank} got non-finite {g}"
            assert np.allclose(g, w.numpy(), rtol=1e-5, atol=1e-7), f"sizes {sizes}: rank {rank} got {g}, want {w}"
