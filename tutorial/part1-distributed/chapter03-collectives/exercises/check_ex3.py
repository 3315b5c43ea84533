"""Checker for ch03.3 — your ring all-reduce on 1 to 4 real ranks against a float64 numpy sum, and the bytes per
rank against mlsys.collectives.comm_volume."""

from __future__ import annotations

import numpy as np
import torch

from mlsys.collectives import comm_volume
from mlsys.exercises import run_ranks, source_of, task


@task("ring_all_reduce on 1-4 ranks, lengths W does not divide, equals numpy's sum on every rank")
def check_ring_all_reduce(ex) -> None:
    for world_size, n in [(1, 3), (2, 5), (3, 7), (4, 10), (3, 3)]:
        rng = np.random.default_rng(world_size * 100 + n)
        data = rng.normal(size=(world_size, n)).astype(np.float32)
        want = data.astype(np.float64).sum(axis=0)
        got = run_ranks(ex, "ring_all_reduce", [(torch.from_numpy(row),) for row in data], timeout=20)
        for rank, g in enumerate(got):
            g = np.asarray(g, dtype=np.float64)
            assert g.shape == want.shape, f"W={world_size}, n={n}: rank {rank} got shape {g.shape}, want {want.shape}"
            assert np.allclose(g, want, atol=1e-5), (f"W={world_size}, n={n}: rank {rank} got "
                                                     f"{np.round(g, 3).tolist()}, want {np.round(want, 3).tolist()}")


@task("ring_all_reduce calls no collective (only isend/irecv, batch_isend_irecv, send/recv)")
def check_no_collectives(ex) -> None:
    source = source_of(ex)
    if "NotImplementedError" in source_of(ex.ring_all_reduce):
        raise NotImplementedError("TODO: write ring_all_reduce first")
    for name in ("all_reduce(", "all_gather", "reduce_scatter", "broadcast(", "all_to_all"):
        assert f"dist.{name}" not in source, f"your module calls dist.{name}; use point-to-point calls only"


@task("ring_bytes_per_rank equals the all-reduce row of mlsys.collectives.comm_volume")
def check_bytes(ex) -> None:
    for num_bytes in (1000, 4096, 12):
        for world_size in (1, 2, 3, 4, 8):
            want = comm_volume("all_reduce", num_bytes, world_size)["sent"]
            got = ex.ring_bytes_per_rank(num_bytes, world_size)
            assert abs(float(got) - want) < 1e-9, f"ring_bytes_per_rank({num_bytes}, {world_size}) = {got}, want {want}"
