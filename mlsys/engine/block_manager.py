"""Paged KV memory: a pool of fixed-size blocks and one block table per sequence.

PagedAttention ("Efficient Memory Management for Large Language Model Serving
with PagedAttention", https://arxiv.org/abs/2309.06180) stores keys and values
the way an OS stores a process's memory: in fixed-size pages (blocks of
`block_size` token positions) that need not be contiguous. A sequence's block
table maps its logical block i (positions i*bs .. i*bs+bs-1) to a physical
block id; memory is taken one block at a time as the sequence grows, so the
only waste is the unfilled tail of each sequence's last block.

    sequence A  positions 0..9, bs=4   block table [5, 2, 7]     pool: |0|1|2|3|4|5|6|7|...
    sequence B  positions 0..5         block table [0, 3]              B B A B . A . A

Every physical block is in exactly one of three states, so
free + used + cached == num_blocks always holds:

* free:   on the free list, reference count 0;
* used:   reference count > 0 (how many running sequences' tables hold it);
* cached: reference count 0 but kept by the prefix cache (radix_cache.py) for a
          later request with the same prefix; evicted (LRU) only when the free
          list runs dry.

Parallel sampling (n answers to one prompt) shares blocks between sequences
copy-on-write, as the PagedAttention paper does: after the prompt's prefill,
`fork` gives each sibling the same block table (each block's count goes up by
n - 1), so the prompt's K/V is stored once. Full blocks are only ever read.
The last, partly filled block is written by every sibling's next token, so the
first sibling to write into a shared one gets a private copy first
(`allocate_slots` takes a fresh block and queues (source, copy) in
`pending_copies`; the engine copies the K/V rows before the step's forward).

    after fork (n=3, bs=4, prompt of 6)     A: [7, 3]  B: [7, 3]  C: [7, 3]    refcounts 7:3, 3:3
    each writes position 6 (block 3)        A: [7, 9]  B: [7, 4]  C: [7, 3]    7:3, 9:1, 4:1, 3:1
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from mlsys.engine.radix_cache import RadixCache

if TYPE_CHECKING:
    from mlsys.engine.request import Sequence


# --8<-- [start:pool]
class BlockPool:
    """Reference-counted physical blocks: ids 0..num_blocks-1; the tensors live in the model runner."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.in_cache = [False] * num_blocks  # held by the prefix cache
        self.free_list: deque[int] = deque(range(num_blocks))
        self.num_cached_unused = 0  # in_cache and ref_count == 0: evictable
        self.evictor: RadixCache | None = None  # set when prefix caching is on

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached_unused

    @property
    def num_available(self) -> int:  # what an allocation may take: free now, or after eviction
        return self.num_free + self.num_cached_unused

    def allocate(self) -> int:
        if not self.free_list and self.evictor is not None:
            self.evictor.evict(1)
        if not self.free_list:
            raise RuntimeError("out of KV blocks (the scheduler should have checked)")
        block = self.free_list.popleft()
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:  # another sequence shares a cached block
        if self.ref_counts[block] == 0 and self.in_cache[block]:
            self.num_cached_unused -= 1  # no longer evictable
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"block {block} freed twice"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.in_cache[block]:
                self.num_cached_unused += 1  # keep its K/V for a later prefix hit
            else:
                self.free_list.append(block)
# --8<-- [end:pool]

    def mark_cached(self, block: int) -> None:
        """The prefix cache now indexes this (full, in-use) block."""
        assert self.ref_counts[block] > 0 and not self.in_cache[block]
        self.in_cache[block] = True

    def release_cached(self, block: int) -> None:
        """The prefix cache evicts this unreferenced block: back to the free list."""
        assert self.in_cache[block] and self.ref_counts[block] == 0, f"evicting block {block} in use"
        self.in_cache[block] = False
        self.num_cached_unused -= 1
        self.free_list.append(block)


class BlockManager:
    """Grows, shares and frees the block tables of sequences."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size)
        self.prefix_cache = None
        if enable_prefix_caching:
            self.prefix_cache = RadixCache(self.pool)
            self.pool.evictor = self.prefix_cache
        self.prefix_hit_tokens = 0  # tokens served from the cache at admission (counted by the scheduler)
        self.prefix_query_tokens = 0  # tokens looked up at admission
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write: (source, copy) to do before the forward
        self.num_cow_copies = 0  # blocks copied so far

    def _shared_write_block(self, seq: Sequence, num_new_tokens: int) -> int | None:
        """Index in seq's table of a block that the next tokens would write while another sequence holds it."""
        i = seq.num_computed_tokens // self.block_size
        if num_new_tokens and i < len(seq.block_table) and self.pool.ref_counts[seq.block_table[i]] > 1:
            return i
        return None

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so that positions up to num_computed + num_new - 1 have a home (plus one copy when the
        first of them falls in a shared block)."""
        total = seq.num_computed_tokens + num_new_tokens
        grow = max(0, -(-total // self.block_size) - len(seq.block_table))
        return grow + (self._shared_write_block(seq, num_new_tokens) is not None)

    # --8<-- [start:allocate]
    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give `seq` room for `num_new_tokens` more K/V rows; False (nothing taken) if the pool is short."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.pool.num_available:
            return False
        if need > self.pool.num_free:  # take the shortfall from the prefix cache in one LRU pass
            self.pool.evictor.evict(need - self.pool.num_free)
        shared = self._shared_write_block(seq, num_new_tokens)
        if shared is not None:  # copy-on-write: a private copy of the block this sequence writes next
            src, dst = seq.block_table[shared], self.pool.allocate()
            self.pending_copies.append((src, dst))
            self.pool.decref(src)
            seq.block_table[shared] = dst
            self.num_cow_copies += 1
            need -= 1
        seq.block_table += [self.pool.allocate() for _ in range(need)]
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (reference counts + 1); writes copy first."""
        for block in parent.block_table:
            self.pool.incref(block)
        child.block_table = list(parent.block_table)
        child.num_inserted_blocks = parent.num_inserted_blocks

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; cached blocks stay for reuse, the rest go back."""
        for block in reversed(seq.block_table):
            self.pool.decref(block)
        seq.block_table = []
        seq.num_inserted_blocks = 0
    # --8<-- [end:allocate]

    # --8<-- [start:prefix]
    def match_prefix(self, seq: Sequence) -> int:
        """At admission: adopt cached blocks for the prompt's prefix; returns tokens reused.

        A full hit still leaves the last token (its whole block) to compute: the
        step needs that position's logits to sample the first new token, and a
        shared cached block must never be written.
        """
        if self.prefix_cache is None:
            return 0
        tokens = seq.token_ids
        usable = (len(tokens) - 1) // self.block_size * self.block_size  # keep >= 1 token to compute
        blocks = self.prefix_cache.match_prefix(tokens[:usable])
        for b in blocks:
            self.pool.incref(b)
        seq.block_table = list(blocks)
        seq.num_inserted_blocks = len(blocks)
        return len(blocks) * self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """After a step: index the sequence's newly completed blocks in the prefix cache."""
        if self.prefix_cache is None:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_inserted_blocks:
            return
        tree_blocks = self.prefix_cache.insert(seq.token_ids[: num_full * self.block_size], seq.block_table[:num_full])
        for i, (ours, theirs) in enumerate(zip(seq.block_table[:num_full], tree_blocks)):
            if ours != theirs:  # someone cached the same tokens first: share theirs, free ours
                self.pool.incref(theirs)
                self.pool.decref(ours)
                seq.block_table[i] = theirs
        seq.num_inserted_blocks = num_full
    # --8<-- [end:prefix]

    def check_invariants(self, live: list[Sequence]) -> None:
        """Refcounts equal table occurrences; free + used + cached == total; nothing leaked."""
        pool = self.pool
        expected = [0] * pool.num_blocks
        for seq in live:
            assert len(seq.block_table) * self.block_size >= seq.num_computed_tokens, f"short table {seq}"
            for b in seq.block_table:
                expected[b] += 1
        assert expected == pool.ref_counts, "refcounts differ from the block tables"
        free = set(pool.free_list)
        assert len(free) == len(pool.free_list), "a block is on the free list twice"
        for b in range(pool.num_blocks):
            in_free = b in free
            assert not (in_free and (pool.ref_counts[b] or pool.in_cache[b])), f"free block {b} is in use/cached"
            assert in_free or pool.ref_counts[b] or pool.in_cache[b], f"block {b} leaked"
        cached_unused = sum(1 for b in range(pool.num_blocks) if pool.in_cache[b] and pool.ref_counts[b] == 0)
        assert cached_unused == pool.num_cached_unused, "evictable count drifted"
        assert pool.num_free + pool.num_used + pool.num_cached_unused == pool.num_blocks
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants()
        else:
            assert not any(pool.in_cache)
