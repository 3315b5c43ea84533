"""Mistake for ch09.1: negative positions are not refused (Python's negative indexing silently wraps)."""

from __future__ import annotations

import torch


def slot_of(position: int, block_table: list[int], block_size: int) -> int:
    block, offset = divmod(position, block_size)
    if block >= len(block_table):
        raise IndexError(f"position {position} has no block in a table of {len(block_table)} blocks")
    return block_table[block] * block_size + offset


def slot_mapping(starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int) -> list[int]:
    return [slot_of(start + i, table, block_size)
            for start, n, table in zip(starts, lengths, block_tables) for i in range(n)]


def blocks_to_append(num_tokens: int, table_len: int, num_new: int, block_size: int) -> int:
    return max(0, -(-(num_tokens + num_new) // block_size) - table_len)


def gather_kv(pool: torch.Tensor, block_table: list[int], length: int) -> torch.Tensor:
    blocks = pool[torch.tensor(block_table, dtype=torch.long)]  # (num_table_blocks, block_size, H, D)
    return blocks.flatten(0, 1)[:length]  # (length, H, D)
