"""Exercise ch09.1 — block tables: where does token position p of a sequence keep its K and V?

A paged KV pool holds num_blocks blocks of block_size token slots each; slot s of the flat pool is row
s // block_size, column s % block_size of the (num_blocks, block_size, ...) tensor. A sequence's block table
lists its physical blocks in logical order: position p lives in logical block p // block_size, at offset
p % block_size. Your functions must give exactly the slots the engine (mlsys.engine.ModelRunner) writes.
Check your work:  make check EX=ch09.1
"""

from __future__ import annotations

import torch


def slot_of(position: int, block_table: list[int], block_size: int) -> int:
    """The flat pool slot of `position`: block_table[position // block_size] * block_size + position % block_size.

    Raise IndexError when the table has no block for that position (position < 0 or past the last block).
    """
    raise NotImplementedError("TODO: logical block = position // block_size, offset = position % block_size")


def slot_mapping(starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int) -> list[int]:
    """The slots of one packed step: sequence s computes `lengths[s]` tokens at positions starts[s], starts[s]+1, ...

    Return one slot per token, sequence 0's tokens first, then sequence 1's, and so on (N = sum(lengths) slots).
    """
    raise NotImplementedError("TODO: slot_of for every (sequence, position) in packed order")


def blocks_to_append(num_tokens: int, table_len: int, num_new: int, block_size: int) -> int:
    """How many blocks a sequence holding `num_tokens` tokens in a table of `table_len` blocks must add before it
    can store `num_new` more tokens (0 when the last block still has room)."""
    raise NotImplementedError("TODO: ceil((num_tokens + num_new) / block_size) - table_len, never negative")


def gather_kv(pool: torch.Tensor, block_table: list[int], length: int) -> torch.Tensor:
    """The first `length` positions of a sequence, read out of `pool` (num_blocks, block_size, H, D) through its
    block table, as one contiguous (length, H, D) tensor (what a contiguous KV cache would hold)."""
    raise NotImplementedError("TODO: index the pool by the table, flatten the blocks, keep the first length rows")
