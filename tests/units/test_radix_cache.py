"""mlsys.engine.radix_cache against a brute-force prefix index: a dict from every cached full-block prefix (a tuple
of tokens) to the block holding its last block of tokens, first insert wins. The longest cached prefix of a prompt
is found by trying k = 1, 2, .. blocks; eviction order is checked on a hand-made scenario (least recently used
leaf first, its parent only once it has become a leaf)."""

from __future__ import annotations

import random

import pytest

from mlsys.engine.block_manager import BlockPool
from mlsys.engine.radix_cache import RadixCache

BS = 2


def cache(num_blocks: int = 400) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks, BS)
    rc = RadixCache(pool)
    pool.evictor = rc
    return pool, rc


def put(pool: BlockPool, rc: RadixCache, tokens: list[int]) -> list[int]:
    """Insert like a finished request: fresh blocks, cached, then released (duplicates of cached ones freed)."""
    ours = [pool.allocate() for _ in range(len(tokens) // BS)]
    theirs = rc.insert(tokens, ours)
    for b in ours:
        pool.decref(b)
    return theirs


def test_match_and_insert_against_a_dict_of_prefixes() -> None:
    rng = random.Random(0)
    pool, rc = cache()
    index: dict[tuple[int, ...], int] = {}
    for _ in range(60):
        tokens = [rng.randint(0, 1) for _ in range(BS * rng.randint(1, 5))]
        free_before = pool.num_free
        got = put(pool, rc, tokens)
        want = []
        for k in range(1, len(tokens) // BS + 1):
            want.append(index.setdefault(tuple(tokens[: k * BS]), got[k - 1]))
        assert got == want
        assert pool.num_free == free_before - (len(index) - (400 - free_before))  # only new prefixes take blocks
        query = [rng.randint(0, 1) for _ in range(rng.randint(0, 12))]
        expect = []
        for k in range(1, len(query) // BS + 1):
            if tuple(query[: k * BS]) not in index:
                break
            expect.append(index[tuple(query[: k * BS])])
        assert rc.match_prefix(query) == expect, query
        assert sorted(rc.cached_blocks()) == sorted(index.values())
        rc.check_invariants()
    assert pool.num_cached_unused == len(index)
    assert rc.evict(10 ** 6) == len(index) and rc.cached_blocks() == [] and pool.num_free == 400
    assert rc.num_evicted_blocks == len(index)


def test_eviction_takes_the_least_recently_used_leaf_then_its_parent() -> None:
    pool, rc = cache(20)
    a = put(pool, rc, [1, 1, 2, 2])        # root - [1 1] - [2 2]
    b = put(pool, rc, [1, 1, 3, 3])        # splits nothing: [1 1] shared, new leaf [3 3]
    c = put(pool, rc, [5, 5, 6, 6, 7, 7])  # one leaf of 3 blocks
    assert a[0] == b[0] and len(set(a + b + c)) == 6
    assert rc.match_prefix([1, 1, 2, 2, 9]) == a  # touch a: b's leaf [3 3] and c are now older
    assert rc.evict(1) == 1 and rc.match_prefix([1, 1, 3, 3]) == [a[0]]  # b's leaf went first (oldest leaf: b)
    assert rc.evict(1) == 3 and rc.match_prefix([5, 5, 6, 6, 7, 7]) == []  # then c, a whole leaf at once
    assert rc.evict(2) == 2 and rc.cached_blocks() == []  # a's leaf, then its parent [1 1] once it is a leaf
    assert pool.num_free == 20 and rc.num_evicted_blocks == 6 and rc.evict(1) == 0


def test_a_referenced_prefix_is_never_evicted_and_splits_keep_it() -> None:
    pool, rc = cache(10)
    put(pool, rc, [4, 4, 5, 5, 6, 6])            # one 3-block leaf
    held = rc.match_prefix([4, 4, 5, 5, 0, 0])   # a running request reads the first 2 blocks: the edge splits
    for blk in held:
        pool.incref(blk)
    assert len(held) == 2
    assert rc.evict(10) == 1                     # only the unreferenced tail block can go
    assert rc.match_prefix([4, 4, 5, 5, 6, 6]) == held
    assert pool.num_available == 10 - 2
    for blk in held:
        pool.decref(blk)
    assert rc.evict(10) == 2 and pool.num_free == 10
    rc.check_invariants()


def test_allocation_evicts_when_the_free_list_is_dry() -> None:
    pool, rc = cache(3)
    put(pool, rc, [1, 1, 2, 2, 3, 3])
    assert pool.num_free == 0 and pool.num_available == 3
    b = pool.allocate()  # takes the evicted leaf's blocks (the whole 3-block leaf goes)
    assert rc.cached_blocks() == [] and pool.num_free == 2 and pool.ref_counts[b] == 1


def test_check_invariants_catches_a_corrupted_edge() -> None:
    """The checker the engine tests lean on must flag an edge whose tokens and blocks disagree in length."""
    pool, rc = cache(10)
    put(pool, rc, [1, 1, 2, 2])
    rc.check_invariants()
    node = next(iter(rc.root.children.values()))
    node.key = node.key + (9,)  # one token too many for its 2 blocks
    with pytest.raises(AssertionError, match="bad edge"):
        rc.check_invariants()


# ------------------------------------------------------------------------------------ LRU after a partial eviction
def test_a_partly_evicted_leaf_keeps_its_place_in_the_lru_order() -> None:
    """Leaf A (two blocks, older) and leaf B (newer). A sequence still reads A's first block, so evicting one block
    splits A and frees only its tail; the head left behind is as old as A was. Once nobody reads it, the next
    eviction must take that head (older) before B, by the order the requests came in."""
    pool, rc = cache(16)
    a = put(pool, rc, [1, 1, 2, 2])  # time 1
    b = put(pool, rc, [3, 3, 4, 4])  # time 2: more recent
    pool.incref(a[0])  # a running sequence reads A's head
    assert rc.evict(1) == 1 and sorted(rc.cached_blocks()) == sorted([a[0], *b])  # only A's tail went
    rc.check_invariants()
    pool.decref(a[0])
    assert rc.evict(1) == 1 and sorted(rc.cached_blocks()) == sorted(b)  # the old head before the newer leaf
    rc.check_invariants()


# ------------------------------------------------------------------------------------------- the invariant checker
def test_the_invariant_checker_names_each_corruption() -> None:
    """check_invariants is the oracle other tests lean on: each corruption planted here must be reported, by name."""
    pool, rc = cache(16)
    a = put(pool, rc, [1, 1, 2, 2])
    put(pool, rc, [1, 1, 3, 3])  # splits A: parent [1 1] with children [2 2] and [3 3]
    rc.check_invariants()

    pool.incref(a[1])  # a child's block read while its parent's last block is not
    with pytest.raises(AssertionError, match="^a block is read without its prefix$"):
        rc.check_invariants()
    pool.decref(a[1])

    long = put(pool, rc, [5, 5, 6, 6])  # one leaf of two blocks: the second read, the first not
    pool.incref(long[1])
    with pytest.raises(AssertionError, match="^a block is read without its prefix$"):
        rc.check_invariants()
    pool.decref(long[1])
    rc.check_invariants()

    parent = rc.root.children[(1, 1)]
    child = parent.children.pop((2, 2))
    parent.children[(9, 9)] = child  # keyed under the wrong first block
    with pytest.raises(AssertionError, match="^child keyed wrongly$"):
        rc.check_invariants()
    parent.children[(2, 2)] = parent.children.pop((9, 9))
    rc.check_invariants()

    stray = pool.allocate()
    pool.mark_cached(stray)  # the pool thinks it is cached; the tree has no such block
    with pytest.raises(AssertionError, match="^pool marks blocks cached that the tree lacks$"):
        rc.check_invariants()
