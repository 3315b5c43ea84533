"""Checker for ch01.2 — runs your functions on real ranks and compares with a single-process numpy answer."""

from __future__ import annotations

import numpy as np
import torch

from mlsys.exercises import run_ranks, task


@task("global_mean over uneven shards equals numpy's mean of everything (1, 2 and 3 ranks)")
def check_global_mean(ex) -> None:
    rng = np.random.default_rng(0)
    for sizes in [[5], [1, 7], [4, 0, 9]]:
        shards = [rng.normal(size=n).astype(np.float32) for n in sizes]
        want = float(np.concatenate(shards).mean())
        got = run_ranks(ex, "global_mean", [(torch.from_numpy(s),) for s in shards])
        for rank, value in enumerate(got):
            assert abs(float(value) - want) < 1e-5, f"shards of sizes {sizes}: rank {rank} got {value}, want {want:.6f}"


@task("argmax_rank finds the rank with the largest value, lowest rank on ties")
def check_argmax_rank(ex) -> None:
    for values in [[0.5, 2.0, -1.0], [3.0, 3.0, 1.0], [-2.0, -1.0, -1.0], [7.0]]:
        want = int(np.argmax(values))  # numpy's argmax also returns the first maximum
        got = run_ranks(ex, "argmax_rank", [(v,) for v in values])
        assert got == [want] * len(values), f"values {values}: ranks answered {got}, expected {want} everywhere"
