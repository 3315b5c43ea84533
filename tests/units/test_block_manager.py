"""mlsys.engine.block_manager against plain oracles: a hand-kept allocator (a FIFO list of free ids and a dict of
counts), ceil division for how many blocks positions need, and the PagedAttention copy-on-write example."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from mlsys.engine.block_manager import BlockManager, BlockPool


def seq(tokens, computed=0):
    return SimpleNamespace(token_ids=list(tokens), num_computed_tokens=computed, block_table=[], num_inserted_blocks=0)


def test_pool_against_a_hand_kept_free_list_and_counts() -> None:
    rng = random.Random(0)
    pool = BlockPool(8, 4)
    free, counts = list(range(8)), {}
    for _ in range(400):
        op = rng.choice(["alloc", "incref", "decref"])
        if op == "alloc":
            if not free:
                with pytest.raises(RuntimeError):
                    pool.allocate()
                continue
            b = pool.allocate()
            assert b == free.pop(0), "first free block, FIFO"
            counts[b] = 1
        elif op == "incref" and counts:
            b = rng.choice(sorted(counts))
            pool.incref(b)
            counts[b] += 1
        elif op == "decref" and counts:
            b = rng.choice(sorted(counts))
            pool.decref(b)
            counts[b] -= 1
            if counts[b] == 0:
                del counts[b]
                free.append(b)
        assert list(pool.free_list) == free
        assert pool.ref_counts == [counts.get(b, 0) for b in range(8)]
        assert pool.num_free == len(free) and pool.num_used == len(counts) and pool.num_available == len(free)
    fresh = BlockPool(2, 4)
    with pytest.raises(AssertionError, match="freed twice"):
        fresh.decref(0)


@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_allocate_slots_gives_ceil_blocks_and_takes_nothing_when_short(block_size: int) -> None:
    bm = BlockManager(10, block_size)
    s, total = seq(range(40)), 0
    for step in (1, 2, block_size, 5, 1, 7):
        want = -(-(total + step) // block_size)  # ceil
        if want > 10:
            before = (list(s.block_table), list(bm.pool.free_list))
            assert bm.blocks_needed(s, step) == want - len(s.block_table)
            assert bm.allocate_slots(s, step) is False
            assert (s.block_table, list(bm.pool.free_list)) == before
            break
        assert bm.blocks_needed(s, step) == want - len(s.block_table)
        assert bm.allocate_slots(s, step) is True
        total += step
        s.num_computed_tokens = total
        assert len(s.block_table) == want and len(set(s.block_table)) == want
        assert bm.pool.num_free == 10 - want
        bm.check_invariants([s])
    assert bm.blocks_needed(s, 0) == 0
    bm.free(s)
    assert s.block_table == [] and bm.pool.num_free == 10 and bm.pool.ref_counts == [0] * 10
    bm.check_invariants([])


def test_fork_then_copy_on_write_as_in_the_pagedattention_example() -> None:
    """n=3, bs=4, prompt of 6: all share [b0, b1]; each sibling writing position 6 (in b1) gets a private copy,
    except the last holder, who writes b1 itself. The full block b0 stays shared."""
    bm = BlockManager(8, 4)
    a = seq(range(6))
    assert bm.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    b0, b1 = a.block_table
    b, c = seq(range(6), 6), seq(range(6), 6)
    a.num_inserted_blocks = 1  # say the prefix cache indexed b0: a child sharing it has it indexed too
    bm.fork(a, b)
    assert b.num_inserted_blocks == 1
    bm.fork(a, c)
    assert bm.pool.ref_counts[b0] == 3 and bm.pool.ref_counts[b1] == 3
    assert b.block_table == [b0, b1] and b.block_table is not a.block_table
    copies = []
    for s in (a, b, c):
        assert bm.blocks_needed(s, 1) == (1 if bm.pool.ref_counts[b1] > 1 else 0)
        assert bm.allocate_slots(s, 1)
        copies.append(s.block_table[1])
        assert s.block_table[0] == b0
    assert copies[2] == b1 and len(set(copies)) == 3
    assert bm.pending_copies == [(b1, copies[0]), (b1, copies[1])] and bm.num_cow_copies == 2
    assert [bm.pool.ref_counts[x] for x in (b0, *copies)] == [3, 1, 1, 1]
    bm.check_invariants([a, b, c])
    # a sequence past its shared block does not copy: the write lands in a new block
    d = seq(range(8), 8)
    bm.fork(a, d)
    d.block_table = d.block_table[:1]
    bm.pool.decref(copies[0])
    d.num_computed_tokens = 4
    assert bm.blocks_needed(d, 1) == 1  # block index 1 absent: grow by one, no copy
    for s in (a, b, c, d):
        bm.free(s)
    assert bm.pool.num_free == 8


def test_prefix_caching_reuses_full_blocks_and_keeps_them_after_free() -> None:
    """Prompt of 9 tokens, bs 4: two full blocks get cached; a second prompt with the same first 8 tokens reuses
    both (8 tokens, hand count); freed blocks stay cached (evictable), and the accounting still adds up."""
    bm = BlockManager(6, 4, enable_prefix_caching=True)
    a = seq(range(9))
    assert bm.match_prefix(a) == 0 and bm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    assert a.num_inserted_blocks == 2
    bm.free(a)
    assert bm.pool.num_cached_unused == 2 and bm.pool.num_free == 4 and bm.pool.num_available == 6
    bm.check_invariants([])
    b = seq([*range(8), 99, 98])
    assert bm.match_prefix(b) == 8 and bm.pool.num_cached_unused == 0
    bm.check_invariants([b])
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        BlockPool(0, 4).allocate()
    bad = seq(range(4), 4)
    bad.block_table = [5]
    with pytest.raises(AssertionError, match=r"^refcounts differ from the block tables$"):
        bm.check_invariants([bad])


def test_the_pool_refuses_to_cache_or_evict_a_block_in_the_wrong_state() -> None:
    """The prefix cache may index only a block a sequence holds and has not indexed yet, and may evict only a cached
    block nobody reads: the pool's own asserts are the last guard against a cache that frees a block in use."""
    pool = BlockPool(4, 2)
    b = pool.allocate()
    pool.mark_cached(b)
    with pytest.raises(AssertionError):
        pool.mark_cached(b)  # indexed twice
    with pytest.raises(AssertionError, match=f"evicting block {b} in use"):
        pool.release_cached(b)  # still read by its sequence
    pool.decref(b)  # the sequence finished: cached, unreferenced
    with pytest.raises(AssertionError):
        pool.mark_cached(b)  # nobody holds it: nothing to index
    pool.release_cached(b)
    assert pool.num_free == 4
    with pytest.raises(AssertionError, match=f"evicting block {b} in use"):
        pool.release_cached(b)  # no longer cached
    free = pool.allocate()
    pool.decref(free)
    with pytest.raises(AssertionError):
        pool.mark_cached(free)  # a free block (count 0) cannot be indexed


def cached_pool(num_blocks: int, cached_prompts: list[list[int]], block_size: int = 4) -> BlockManager:
    """A manager whose prefix cache holds each prompt's full blocks, every sequence finished (cached, unused)."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    for tokens in cached_prompts:
        s = seq(tokens)
        assert bm.match_prefix(s) == 0 and bm.allocate_slots(s, len(tokens))
        s.num_computed_tokens = len(tokens)
        bm.cache_full_blocks(s)
        bm.free(s)
    return bm


def test_a_shortfall_evicts_exactly_the_blocks_missing() -> None:
    """6 blocks: four one-block prompts are cached (unused), 2 blocks stay free. A sequence needing 3 blocks takes
    the 2 free ones and evicts exactly 1 cached block (the cache evicts whole nodes, here one block each)."""
    bm = cached_pool(6, [list(range(k, k + 4)) for k in (0, 100, 200, 300)])
    assert bm.pool.num_free == 2 and bm.pool.num_cached_unused == 4
    s = seq(range(500, 512))
    assert bm.allocate_slots(s, 12)
    assert len(s.block_table) == 3 and bm.pool.num_cached_unused == 3 and bm.pool.num_free == 0
    bm.check_invariants([s])


def test_the_pool_evicts_one_cached_block_per_allocation() -> None:
    bm = cached_pool(2, [list(range(4)), list(range(100, 104))])  # both blocks cached (one node each), none free
    assert bm.pool.num_free == 0 and bm.pool.num_cached_unused == 2
    bm.pool.allocate()
    assert bm.pool.num_cached_unused == 1  # one evicted for the one block asked for
    with pytest.raises(RuntimeError) as err:
        BlockPool(0, 4).allocate()
    assert str(err.value) == "out of KV blocks (the scheduler should have checked)"


def test_a_copy_on_write_that_also_grows_gets_both_blocks() -> None:
    """bs 4, a prompt of 6 (blocks b0 full, b1 half), forked: the child writing 4 more tokens fills b1's last 2
    slots (a private copy of b1) and 2 slots of a new block: 3 blocks, one of them copied."""
    bm = BlockManager(8, 4)
    a = seq(range(6))
    assert bm.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    child = seq(range(6), 6)
    bm.fork(a, child)
    assert bm.allocate_slots(child, 4)
    assert len(child.block_table) == 3 and child.block_table[0] == a.block_table[0]
    assert len({*child.block_table, *a.block_table}) == 4 and bm.num_cow_copies == 1
    bm.check_invariants([a, child])


def test_a_prompt_one_token_past_cached_blocks_reuses_them_all() -> None:
    """9 tokens, bs 4: (9 - 1) // 4 = 2 blocks may be reused (the 9th token is computed): 8 tokens."""
    bm = cached_pool(6, [list(range(8))])
    assert bm.match_prefix(seq(range(9))) == 8
    bm2 = cached_pool(6, [list(range(8))])
    assert bm2.match_prefix(seq(range(8))) == 4  # all 8 cached, but the last token must be computed


@pytest.mark.parametrize("corrupt, message", [
    (lambda pool: pool.free_list.append(pool.free_list[0]), "a block is on the free list twice"),
    (lambda pool: setattr(pool, "num_cached_unused", pool.num_cached_unused + 1), "evictable count drifted"),
])
def test_check_invariants_names_what_drifted(corrupt, message) -> None:
    bm = cached_pool(4, [list(range(4))])
    corrupt(bm.pool)
    with pytest.raises(AssertionError) as err:
        bm.check_invariants([])
    assert str(err.value) == message


def test_check_invariants_catches_a_free_block_still_counted_as_used() -> None:
    bm = BlockManager(4, 4)
    b = bm.pool.free_list[0]
    holder = seq(range(1))
    holder.block_table, bm.pool.ref_counts[b] = [b], 1  # a live sequence reads a block still on the free list
    with pytest.raises(AssertionError) as err:
        bm.check_invariants([holder])
    assert str(err.value) == f"free block {b} is in use/cached"


def test_a_step_that_completes_no_block_leaves_the_lru_order_alone() -> None:
    """A's block is cached before B's, so A's is the least recently used. A decode step of A that completes no new
    block must not count as a use: after both finish, evicting one block takes A's and keeps B's."""
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a, b = seq(range(5)), seq(range(100, 105))
    for s in (a, b):
        assert bm.match_prefix(s) == 0 and bm.allocate_slots(s, 5)
        s.num_computed_tokens = 5
        bm.cache_full_blocks(s)  # one full block each: A's first, then B's
    a.token_ids.append(5)
    assert bm.allocate_slots(a, 1)
    a.num_computed_tokens = 6
    bm.cache_full_blocks(a)  # still one full block: nothing new to index
    bm.free(a)
    bm.free(b)
    assert bm.prefix_cache.evict(1) == 1
    assert bm.match_prefix(seq([*range(4), 9, 9])) == 0  # A's block went
    assert bm.match_prefix(seq([*range(100, 104), 9, 9])) == 4  # B's stayed


def test_prefix_caching_is_off_unless_asked() -> None:
    bm = BlockManager(8, 4)
    a = seq(range(9))
    assert bm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    bm.free(a)
    assert bm.match_prefix(seq(range(9))) == 0 and bm.pool.num_free == 8 and not any(bm.pool.in_cache)
