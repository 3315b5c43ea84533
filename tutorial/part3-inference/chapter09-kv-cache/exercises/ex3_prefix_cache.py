"""Exercise ch09.3 — extend: prefix caching in whole blocks, then an eviction policy, measured.

A prefix cache keys each FULL block of a prompt by every token up to the end of that block (the radix tree's
path from the root, or vLLM's chain of block hashes): block j of `tokens` is keyed by tuple(tokens[:(j+1)*bs]).
Requests are served one after another. For each prompt, in order:

  1. hit: the longest run of leading blocks whose keys are cached, but never past (len(prompt) - 1) // bs
     blocks: the last prompt token is always computed, because its logits give the first new token;
  2. store: every full block of the prompt (len(prompt) // bs keys) is now cached: add the missing keys and
     mark all of them used now;
  3. evict: while more than capacity_blocks keys are cached, drop one. "lru" drops the least recently used key
     (last hit or stored); "fifo" the key cached the longest ago (a hit does not refresh it). Ties (keys of the
     same prompt and time) go deepest key first, so a prefix outlives the blocks that extend it.

With capacity_blocks=None nothing is evicted, and the hits must equal what mlsys.engine reuses
(RequestMetrics.num_cached_prompt_tokens with enable_prefix_caching=True).
Check your work:  make check EX=ch09.3
"""

from __future__ import annotations


def block_keys(tokens: list[int], block_size: int) -> list[tuple[int, ...]]:
    """The key of each full block of `tokens`: tuple(tokens[:(j + 1) * block_size]) for every full block j."""
    raise NotImplementedError("TODO: one key per full block, each the whole prefix up to that block's end")


def cache_hits(prompts: list[list[int]], block_size: int, capacity_blocks: int | None = None,
               policy: str = "lru") -> list[int]:
    """Tokens each prompt reuses from the cache (a multiple of block_size), following the three rules above."""
    raise NotImplementedError("TODO: per prompt: count leading cached keys, store all, evict by the policy")
