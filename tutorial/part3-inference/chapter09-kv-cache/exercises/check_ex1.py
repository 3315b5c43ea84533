"""Checker for ch09.1 — your block-table arithmetic against the engine's own (mlsys.engine)."""

from __future__ import annotations

import random

import torch

from mlsys.engine import BlockManager, ModelRunner, SamplingParams, Sequence
from mlsys.exercises import task
from mlsys.model import GPT, GPTConfig


@task("slot_of: position -> (block, offset) -> slot, IndexError past the table")
def check_slot_of(ex) -> None:
    table = [5, 2, 7]
    for pos, want in [(0, 20), (3, 23), (4, 8), (7, 11), (8, 28), (11, 31)]:
        got = ex.slot_of(pos, table, 4)
        assert got == want, (f"slot_of({pos}, {table}, 4) = {got}, want {want} "
                             f"(block {table[pos // 4]}, offset {pos % 4})")
    for bad in (12, -1):
        try:
            ex.slot_of(bad, table, 4)
        except IndexError:
            continue
        raise AssertionError(f"slot_of({bad}, {table}, 4) should raise IndexError")


@task("slot_mapping of a packed prefill + decode step equals the engine's ModelRunner.prepare")
def check_slot_mapping(ex) -> None:
    model = GPT(GPTConfig.preset("tiny"))
    rng = random.Random(0)
    for bs in (1, 4, 16):
        runner = ModelRunner(model, num_blocks=64, block_size=bs)
        free = list(range(64))
        rng.shuffle(free)  # physical blocks in no particular order
        starts, lengths = [0, 17, 5, bs], [9, 1, 3, 1]  # a prefill, two decodes, a chunk from position 5
        tables = [[free.pop() for _ in range(-(-(start + n) // bs))] for start, n in zip(starts, lengths)]
        want = runner.prepare(starts, [[3] * n for n in lengths], tables, [True] * 4).slot_mapping.tolist()
        got = list(ex.slot_mapping(starts, lengths, tables, bs))
        assert got == want, (f"block_size {bs}, starts {starts}, lengths {lengths}, tables {tables}: "
                             f"got {got}, want {want}")


@task("blocks_to_append equals the engine's BlockManager.blocks_needed at and around block boundaries")
def check_blocks_to_append(ex) -> None:
    for bs in (1, 4, 16):
        bm = BlockManager(num_blocks=64, block_size=bs)
        for held in (0, 1, bs - 1, bs, bs + 1, 3 * bs):
            for new in (1, 2, bs, 2 * bs + 1):
                seq = Sequence("s", [3] * max(held, 1), SamplingParams())
                seq.num_computed_tokens = held
                seq.block_table = list(range(-(-held // bs)))
                want = bm.blocks_needed(seq, new)
                got = ex.blocks_to_append(held, len(seq.block_table), new, bs)
                assert got == want, f"block_size {bs}, {held} tokens held, {new} new: got {got}, want {want}"


@task("gather_kv through a shuffled block table equals the contiguous K written token by token")
def check_gather(ex) -> None:
    gen = torch.Generator().manual_seed(0)
    for bs, length in [(4, 1), (4, 4), (4, 9), (16, 33)]:
        nb = -(-length // bs)
        pool = torch.zeros(10 + nb, bs, 2, 3)
        table = torch.randperm(10 + nb, generator=gen)[:nb].tolist()
        contiguous = torch.randn(length, 2, 3, generator=gen)
        for pos in range(length):  # write the way the engine does: one slot per token
            block, offset = divmod(pos, bs)
            pool[table[block], offset] = contiguous[pos]
        got = ex.gather_kv(pool, table, length)
        assert tuple(got.shape) == (length, 2, 3), f"shape {tuple(got.shape)}, want {(length, 2, 3)}"
        assert torch.equal(got, contiguous), f"block_size {bs}, length {length}, table {table}: values differ"
