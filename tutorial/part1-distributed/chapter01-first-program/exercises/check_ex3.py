"""Checker for ch01.3 — your uneven gather on 1 to 4 real ranks against numpy's concatenation, and the padding
overhead against a slot-by-slot count."""

from __future__ import annotations

import numpy as np
import torch

from mlsys.exercises import run_ranks, task


@task("gather_uneven on 1-4 ranks, shards of different lengths (some empty), equals numpy.concatenate")
def check_gather_uneven(ex) -> None:
    rng = np.random.default_rng(13)
    for sizes in [[4], [2, 5], [0, 3, 1], [3, 0, 0, 2]]:
        shards = [rng.normal(size=n).astype(np.float32) for n in sizes]
        want = np.concatenate(shards)
        got = run_ranks(ex, "gather_uneven", [(torch.from_numpy(s),) for s in shards], timeout=20)
        for rank, g in enumerate(got):
            g = np.asarray(g, dtype=np.float32).ravel()
            assert g.shape == want.shape, f"sizes {sizes}: rank {rank} got {g.size} elements, want {want.size} " \
                                          "(padding left in, or pieces cut to the wrong length?)"
            assert np.array_equal(g, want), f"sizes {sizes}: rank {rank} got {np.round(g, 3).tolist()}, " \
                                            f"want {np.round(want, 3).tolist()}"


@task("padding_overhead counts the padding slots of a (W x max length) buffer")
def check_padding_overhead(ex) -> None:
    for lengths in [[4, 1], [3, 3, 3], [0, 5], [7], [0, 0], [1, 2, 3, 10]]:
        longest = max(lengths)
        slots = [[i < n for i in range(longest)] for n in lengths]  # True where a slot holds data
        total = sum(len(row) for row in slots)
        want = 0.0 if total == 0 else sum(not s for row in slots for s in row) / total
        got = ex.padding_overhead(list(lengths))
        assert abs(float(got) - want) < 1e-12, f"padding_overhead({lengths}) = {got}, expected {want}"
