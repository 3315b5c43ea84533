"""Exercise ch10.1 — run a decode batch in a captured CUDA graph: pick the graph, pad the batch.

A CUDA graph replays fixed shapes, so an engine captures the decode step for a few batch sizes (say 1, 2, 4,
8, 16) and runs n sequences in the smallest captured size B >= n. The graph's static inputs then hold n real
rows and B - n padding rows. Padding rows must be harmless: token 0 at position 0, whose K/V go to a scratch
block that no sequence owns (the engine puts it right after the pool: block id num_blocks), and whose block
table points only at that scratch block. Every table is padded to the same width, max_blocks, with the
scratch block id. Your tensors must equal what mlsys.engine.cuda_graphs.CUDAGraphRunner.fill writes.
Check your work:  make check EX=ch10.1
"""

from __future__ import annotations

import torch


def pick_graph_size(num_seqs: int, captured_sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs sequences (sizes may come in any order);
    None when num_seqs is larger than every captured size (the engine then runs eagerly)."""
    raise NotImplementedError("TODO: min of the sizes >= num_seqs, or None")


def pad_decode_batch(token_ids: list[int], positions: list[int], block_tables: list[list[int]], graph_size: int,
                     block_size: int, scratch_block: int, max_blocks: int) -> dict[str, torch.Tensor]:
    """n decoding sequences (one new token each) -> the graph's static inputs for batch size graph_size >= n.

    Returns int64 tensors:
      "input_ids"    (graph_size,)             the tokens, then 0 for padding rows
      "positions"    (graph_size,)             the positions, then 0
      "slot_mapping" (graph_size,)             block_tables[s][p // block_size] * block_size + p % block_size,
                                               then scratch_block * block_size for padding rows
      "block_tables" (graph_size, max_blocks)  each table padded on the right with scratch_block;
                                               padding rows are all scratch_block
    Raise ValueError if graph_size < n.
    """
    raise NotImplementedError("TODO: build the padded lists, then torch.tensor them")
