"""Checker for ch10.1 — your graph-size choice and padding against the engine's CUDAGraphRunner (on a CPU its
static buffers are filled exactly as on a GPU; only the capture is skipped)."""

from __future__ import annotations

import random

import torch

from mlsys.engine import ModelRunner, cuda_graphs
from mlsys.exercises import task
from mlsys.model import GPT, GPTConfig


@task("pick_graph_size equals the engine's on sorted and unsorted size lists, None past the largest")
def check_pick(ex) -> None:
    for sizes in ([1, 2, 4, 8, 16, 24, 32], [8, 1, 4, 2], [3], [1, 2, 4, 8, 12]):
        for n in range(1, max(sizes) + 3):
            want = cuda_graphs.pick_graph_size(n, sizes)
            got = ex.pick_graph_size(n, sizes)
            assert got == want, f"pick_graph_size({n}, {sizes}) = {got}, want {want}"


@task("pad_decode_batch equals CUDAGraphRunner.fill for batches of 1..8 sequences in graphs of 1, 2, 4, 8")
def check_pad(ex) -> None:
    rng = random.Random(0)
    model = GPT(GPTConfig.preset("tiny"))
    for bs in (1, 4, 16):
        runner = ModelRunner(model, num_blocks=80, block_size=bs)
        g = cuda_graphs.CUDAGraphRunner(runner, max_model_len=64, sizes=[1, 2, 4, 8])
        for n in range(1, 9):
            positions = [rng.randrange(0, 64) for _ in range(n)]
            tables = [rng.sample(range(80), p // bs + 1) for p in positions]  # shuffled blocks, room for position p
            ids = [rng.randrange(3, 40) for _ in range(n)]
            B = cuda_graphs.pick_graph_size(n, g.sizes)
            b = g.buffers[B]
            g.fill(b, ids, positions, tables)
            got = ex.pad_decode_batch(ids, positions, tables, B, bs, g.scratch_block, g.max_blocks)
            for key in ("input_ids", "positions", "slot_mapping", "block_tables"):
                want = getattr(b, key)
                assert torch.is_tensor(got[key]) and got[key].shape == want.shape, (
                    f"{key}: shape {tuple(got[key].shape) if torch.is_tensor(got[key]) else type(got[key])}, "
                    f"want {tuple(want.shape)}")
                assert torch.equal(got[key].long(), want), (f"block_size {bs}, n={n} in a graph of {B}: {key} "
                                                            f"{got[key].tolist()}, want {want.tolist()}")


@task("pad_decode_batch refuses a graph smaller than the batch (ValueError)")
def check_too_small(ex) -> None:
    try:
        ex.pad_decode_batch([1, 2, 3], [0, 1, 2], [[0], [1], [2]], 2, 4, 9, 2)
    except ValueError:
        return
    raise AssertionError("3 sequences in a graph of batch size 2 should raise ValueError")
