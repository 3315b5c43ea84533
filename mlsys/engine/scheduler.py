"""Which requests run in the next step, and how many tokens each computes.

Iteration-level ("continuous") batching, from Orca ("Orca: A Distributed
Serving System for Transformer-Based Generative Models", OSDI 2022,
https://www.usenix.org/conference/osdi22/presentation/yu): the batch is
re-formed at every step. A request that finishes leaves at once and a waiting
one takes its place in the very next step, instead of the whole batch waiting
for its longest member ("static" batching, kept here for comparison: a batch is
formed when nothing is running and runs until all its requests finish).

Each step the scheduler fills a token budget (`max_num_batched_tokens`), at
most `max_num_seqs` sequences, in the style of vLLM's v1 scheduler:

1. RUNNING sequences first, oldest first: each asks for its
   `num_new_tokens` (1 while decoding; the rest of its prompt while
   prefilling, cut to what the budget has left = chunked prefill), and gets
   blocks for them.
2. If the pool cannot supply those blocks, the scheduler PREEMPTS the newest
   running sequence and retries. Preemption by recompute: the victim's blocks
   are freed, its `num_computed_tokens` drops to 0 and it goes to the front of
   the waiting queue. Its tokens (prompt and everything generated so far) are
   kept; when it is admitted again it prefills them all in one go and carries
   on exactly where it stopped. Recomputing a prefill is cheap next to decoding
   (one batched pass instead of one step per token), which is why vLLM prefers
   it to swapping blocks out to CPU memory; with prefix caching on, the
   victim's full blocks stay cached and most of the recompute is a cache hit.
   The newest goes first because it has the least work to lose, and the
   oldest requests keep making progress, so the system cannot livelock.
3. WAITING sequences are admitted in arrival order while budget, seats and
   blocks last (not in a step that had to preempt: memory is tight).
   Admission first looks the prompt up in the prefix cache.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from mlsys.engine.block_manager import BlockManager
from mlsys.engine.request import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0  # scheduled tokens that were not a plain one-token decode


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 scheduling: str = "continuous"):
        if scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {scheduling!r}")
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.scheduling = scheduling
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # --8<-- [start:schedule]
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # 1-2. running sequences, oldest first; preempt the newest when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_new_tokens, budget)
            while not self.bm.allocate_slots(seq, n):
                victim = self.running.pop()  # the newest running sequence
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:  # while-else: runs only if the loop got seq its blocks without preempting seq itself
                out.scheduled.append((seq, n))
                budget -= n
                i += 1
        # 3. admit waiting sequences. Static: only into an empty engine, a whole batch of
        #    max_num_seqs at once (members the budget cannot serve now prefill in later steps)
        static = self.scheduling == "static"
        may_admit = not out.preempted and (not static or not self.running)
        while may_admit and self.waiting and (budget > 0 or static):
            seq = self.waiting[0]
            if len(self.running) + 1 + len(seq.forks) > self.max_num_seqs:  # n > 1: seats for its siblings too
                break
            num_cached = self.bm.match_prefix(seq)  # adopts cached blocks, or 0
            seq.num_computed_tokens = num_cached
            n = min(seq.num_new_tokens, budget)
            if not self.bm.allocate_slots(seq, n):
                self.bm.free(seq)  # give the adopted prefix back; try again next step
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self._admit(seq, num_cached)
            if n:
                out.scheduled.append((seq, n))
                budget -= n
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        out.num_prefill_tokens = sum(n for s, n in out.scheduled if not self._is_decode(s, n))
        return out

    @staticmethod
    def _is_decode(seq: Sequence, n: int) -> bool:  # one token: the one sampled last step
        return n == 1 and bool(seq.output_token_ids) and seq.num_computed_tokens == seq.num_tokens - 1
    # --8<-- [end:schedule]

    def _admit(self, seq: Sequence, num_cached: int) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.bm.prefix_hit_tokens += num_cached
        self.bm.prefix_query_tokens += seq.num_tokens
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = time.perf_counter()
            seq.metrics.num_cached_prompt_tokens = num_cached

    # --8<-- [start:preempt]
    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop the KV cache, keep the tokens, queue it first."""
        self.bm.free(seq)  # full blocks stay in the prefix cache when it is on
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
    # --8<-- [end:preempt]

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence from wherever it is; free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
