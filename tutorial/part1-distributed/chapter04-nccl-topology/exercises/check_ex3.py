"""Checker for ch04.3 — your tree all-reduce on 1 to 6 real ranks against a float64 numpy sum, and the elements
every rank sent against the tree's count (n up to the parent, n down to each child), compared with the ring's."""

from __future__ import annotations

import numpy as np
import torch

from mlsys.exercises import run_ranks, source_of, task


def _tree_sends(rank: int, world_size: int) -> int:
    """Messages of n elements a rank sends: one up to its parent (all but the root), one down to each child."""
    children = sum(1 for c in (2 * rank + 1, 2 * rank + 2) if c < world_size)
    return (1 if rank > 0 else 0) + children


@task("tree_all_reduce on 1, 2, 5 and 6 ranks equals numpy's sum on every rank, input left unchanged")
def check_sum(ex) -> None:
    if "NotImplementedError" in source_of(ex.tree_all_reduce):  # run_and_count (given) calls it on each rank
        raise NotImplementedError("TODO: write tree_all_reduce first")
    for world_size in (1, 2, 5, 6):
        rng = np.random.default_rng(world_size)
        data = rng.normal(size=(world_size, 6)).astype(np.float32)
        want = data.astype(np.float64).sum(axis=0)
        got = run_ranks(ex, "run_and_count", [(torch.from_numpy(row),) for row in data], timeout=20)
        for rank, out in enumerate(got):
            g = np.asarray(out["result"], dtype=np.float64)
            assert np.allclose(g, want, atol=1e-5), (f"W={world_size}: rank {rank} holds {np.round(g, 3).tolist()}, "
                                                     f"want {np.round(want, 3).tolist()}")
            assert out["input_after"] == data[rank].tolist(), (  # the rank's tensor after the call, against ours
                f"W={world_size}: rank {rank}'s input tensor was modified; work on a copy")


@task("tree_all_reduce: every rank sends n per tree edge it owns; the busiest sends more than the ring's 2(p-1)/p n")
def check_traffic(ex) -> None:
    source = source_of(ex.tree_all_reduce)
    if "NotImplementedError" in source:
        raise NotImplementedError("TODO: write tree_all_reduce first")
    for name in ("all_reduce", "broadcast", "reduce(", "all_gather"):
        assert f"dist.{name}" not in source, f"tree_all_reduce calls dist.{name}; use send/recv only"
    world_size, n = 5, 8
    got = run_ranks(ex, "run_and_count", [(torch.full((n,), float(r)),) for r in range(world_size)], timeout=20)
    for rank, out in enumerate(got):
        want = _tree_sends(rank, world_size) * n
        assert out["elements"] == want, (f"W={world_size}: rank {rank} sent {out['elements']} elements in "
                                         f"{out['messages']} messages, want {want} (n per edge, up and down)")
    busiest, ring = max(o["elements"] for o in got), 2 * (world_size - 1) / world_size * n
    assert busiest > ring, f"the busiest tree rank sent {busiest}, no more than the ring's {ring:g}?"
