"""Mistake for ch10.1: padding rows write to slot 0, a real sequence's block, instead of the scratch block."""

from __future__ import annotations

import torch


def pick_graph_size(num_seqs: int, captured_sizes: list[int]) -> int | None:
    fitting = [s for s in captured_sizes if s >= num_seqs]
    return min(fitting) if fitting else None


def pad_decode_batch(token_ids: list[int], positions: list[int], block_tables: list[list[int]], graph_size: int,
                     block_size: int, scratch_block: int, max_blocks: int) -> dict[str, torch.Tensor]:
    n = len(token_ids)
    if graph_size < n:
        raise ValueError(f"{n} sequences do not fit a graph of batch size {graph_size}")
    pad = graph_size - n
    slots = [table[p // block_size] * block_size + p % block_size for table, p in zip(block_tables, positions)]
    tables = [t + [scratch_block] * (max_blocks - len(t)) for t in block_tables] + [[scratch_block] * max_blocks] * pad
    return {
        "input_ids": torch.tensor(list(token_ids) + [0] * pad),
        "positions": torch.tensor(list(positions) + [0] * pad),
        "slot_mapping": torch.tensor(slots + [0] * pad),
        "block_tables": torch.tensor(tables, dtype=torch.long).view(graph_size, max_blocks),
    }
