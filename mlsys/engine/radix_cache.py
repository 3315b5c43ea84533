"""Prefix cache: a radix tree over token ids whose edges own KV-cache blocks.

Two requests that start with the same tokens (a shared system prompt, the same
few-shot examples, earlier turns of a chat) compute the same keys and values
for that prefix. SGLang's RadixAttention ("SGLang: Efficient Execution of
Structured Language Model Programs", https://arxiv.org/abs/2312.07104) keeps
those blocks after a request ends and indexes them by their tokens in a radix
tree, so a later request looks up its prompt and skips the matched part.

This tree works at full-block granularity: every edge holds a multiple of
`block_size` tokens and one physical block per `block_size` of them. A partial
block (the tail of a prompt) is never shared, so a shared block is always full
and never written again.

    root ─ [<bos>{"na|me": ] (blocks 3, 7) ─┬─ [ "ada|", "a] (block 9)    edge split at a block
                                            └─ [ "ken|", "a] (block 4)    boundary on partial match

Who may free a block? The pool's reference count says how many running
sequences read it. A tree node is *evictable* when it is a leaf and all its
blocks have reference count 0: nobody is reading it and no longer cached
prefix hangs below it (a sequence that holds a node's blocks holds all its
ancestors' blocks too, so locking is implied by the counts). Eviction takes
the least recently used evictable leaf first, returns its blocks to the free
list, and may expose its parent as the next candidate.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: block_manager imports this module, not the other way round
    from mlsys.engine.block_manager import BlockPool


class RadixNode:
    __slots__ = ("key", "blocks", "children", "parent", "last_access")

    def __init__(self, key: tuple[int, ...], blocks: list[int], parent: RadixNode | None):
        self.key = key  # token ids on the edge into this node, len == len(blocks) * block_size
        self.blocks = blocks  # physical block ids holding those tokens' K/V
        self.children: dict[tuple[int, ...], RadixNode] = {}  # keyed by the child's first block of tokens
        self.parent = parent
        self.last_access = 0


class RadixCache:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        self.root = RadixNode((), [], None)
        self._clock = itertools.count(1)  # logical time for LRU (ties broken by order)
        self.num_evicted_blocks = 0

    def _block_key(self, tokens, i: int) -> tuple[int, ...]:
        return tuple(tokens[i : i + self.block_size])

    # --8<-- [start:match]
    def match_prefix(self, tokens: list[int]) -> list[int]:
        """Blocks caching the longest full-block prefix of `tokens` (touches them for LRU)."""
        bs, node, blocks, i = self.block_size, self.root, [], 0
        now = next(self._clock)
        while i + bs <= len(tokens):
            child = node.children.get(self._block_key(tokens, i))
            if child is None:
                break
            k = self._num_matching_blocks(child.key, tokens, i)  # >= 1: the first block matched
            if k < len(child.blocks):
                child = self._split(child, k)  # only the matched part becomes a node we stand on
            child.last_access = now
            blocks += child.blocks
            node, i = child, i + len(child.key)
        return blocks

    def _num_matching_blocks(self, key, tokens, start: int) -> int:
        bs, k = self.block_size, 0
        while (k + 1) * bs <= len(key) and start + (k + 1) * bs <= len(tokens) and \
                tuple(key[k * bs : (k + 1) * bs]) == self._block_key(tokens, start + k * bs):
            k += 1
        return k

    def _split(self, child: RadixNode, k: int) -> RadixNode:
        """Cut `child`'s edge after k blocks; return the new upper node."""
        bs = self.block_size
        upper = RadixNode(child.key[: k * bs], child.blocks[:k], child.parent)
        upper.last_access = child.last_access
        child.parent.children[self._block_key(child.key, 0)] = upper
        child.key, child.blocks, child.parent = child.key[k * bs :], child.blocks[k:], upper
        upper.children[self._block_key(child.key, 0)] = child
        return upper
    # --8<-- [end:match]

    # --8<-- [start:insert]
    def insert(self, tokens: list[int], blocks: list[int]) -> list[int]:
        """Cache `blocks` (full, computed) under `tokens` (len == len(blocks) * block_size).

        Returns the tree's blocks for this prefix. Where the tree already held a
        block for the same tokens, that block is returned instead of ours: the
        caller switches to it and frees its own duplicate.
        """
        bs, node, out, i = self.block_size, self.root, [], 0
        assert len(tokens) == len(blocks) * bs
        now = next(self._clock)
        while i < len(tokens):
            child = node.children.get(self._block_key(tokens, i))
            if child is None:  # the rest is new: one leaf owns our remaining blocks
                leaf = RadixNode(tuple(tokens[i:]), list(blocks[i // bs :]), node)
                leaf.last_access = now
                node.children[self._block_key(tokens, i)] = leaf
                for b in leaf.blocks:
                    self.pool.mark_cached(b)
                return out + leaf.blocks
            k = self._num_matching_blocks(child.key, tokens, i)
            if k < len(child.blocks):
                child = self._split(child, k)
            child.last_access = now
            out += child.blocks
            node, i = child, i + len(child.key)
        return out
    # --8<-- [end:insert]

    # --8<-- [start:evict]
    def evict(self, num_blocks: int) -> int:
        """Free `num_blocks` or more unreferenced cached blocks (fewer if that is all there is),
        least recently used leaves first; returns how many were freed."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, _, node = heapq.heappop(heap)
            in_use = sum(self.pool.ref_counts[b] > 0 for b in node.blocks)  # a referenced head, if any
            if in_use:
                self._split(node, in_use)  # node keeps the unreferenced tail; its head stays cached
            for b in node.blocks:
                self.pool.release_cached(b)  # refcount is 0: straight to the free list
            freed += len(node.blocks)
            parent = node.parent
            del parent.children[self._block_key(node.key, 0)]
            if parent is not self.root and self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.num_evicted_blocks += freed
        return freed

    def _evictable(self, node: RadixNode) -> bool:
        """A leaf whose last block nobody reads (holders hold whole prefixes, so refcounts only
        fall along a path: the unreferenced blocks are the leaf's tail)."""
        return not node.children and self.pool.ref_counts[node.blocks[-1]] == 0
    # --8<-- [end:evict]

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def cached_blocks(self) -> list[int]:
        return [b for n in self._nodes() for b in n.blocks]

    def check_invariants(self) -> None:
        bs = self.block_size
        seen = set()
        refs = self.pool.ref_counts
        for n in self._nodes():
            assert n.blocks and len(n.key) == len(n.blocks) * bs, f"bad edge {n.key} {n.blocks}"
            path = ([n.parent.blocks[-1]] if n.parent.blocks else []) + n.blocks
            assert all(refs[a] >= refs[b] for a, b in zip(path, path[1:])), "a block is read without its prefix"
            assert n.parent.children.get(self._block_key(n.key, 0)) is n, "child keyed wrongly"
            for b in n.blocks:
                assert b not in seen, f"block {b} cached twice"
                assert self.pool.in_cache[b], f"tree block {b} not marked cached in the pool"
                seen.add(b)
        assert len(seen) == sum(self.pool.in_cache), "pool marks blocks cached that the tree lacks"
