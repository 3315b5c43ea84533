"""Checker for ch01.1 — rank arithmetic, against numpy's array_split and torchrun's numbering."""

from __future__ import annotations

import numpy as np

from mlsys.exercises import task


@task("shard_bounds gives every rank the same slice as numpy.array_split")
def check_shard_bounds(ex) -> None:
    for num_items in [0, 1, 3, 10, 17, 64]:
        for world_size in [1, 2, 3, 4, 7]:
            pieces = np.array_split(np.arange(num_items), world_size)
            for rank, piece in enumerate(pieces):
                got = tuple(ex.shard_bounds(num_items, rank, world_size))
                start = int(sum(len(p) for p in pieces[:rank]))
                want = (start, start + len(piece))
                assert got == want, f"shard_bounds({num_items}, {rank}, {world_size}) = {got}, expected {want}"


@task("node_and_local_rank matches how torchrun numbers ranks")
def check_node_and_local_rank(ex) -> None:
    for nproc in [1, 2, 4, 8]:
        for node in range(3):
            for local in range(nproc):
                rank = node * nproc + local  # torchrun: RANK = node_rank * nproc_per_node + LOCAL_RANK
                got = tuple(ex.node_and_local_rank(rank, nproc))
                assert got == (node, local), f"node_and_local_rank({rank}, {nproc}) = {got}, expected {(node, local)}"
