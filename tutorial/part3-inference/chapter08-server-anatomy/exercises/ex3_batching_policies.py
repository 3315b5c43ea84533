"""Exercise ch08.3 — extend: static against continuous batching, step by step.

All requests arrive at once, in order, with short prompts; request i generates exactly output_lens[i] tokens.
Every step, each running request computes one token (its first step is its prefill, which also produces its
first token), and at most max_num_seqs requests run in one step. A request that produces its last token in step
s leaves at the end of step s; its seat can be taken from step s + 1 on. Steps are numbered from 1.

  static:      a batch of (up to) max_num_seqs requests, in arrival order, is admitted only when nothing is
               running, and runs until all its members have finished;
  continuous:  every step, free seats are filled with the oldest waiting requests (Orca's iteration-level
               batching; mlsys.engine's default).

Your finish steps must equal what the engine's scheduler does (EngineConfig(scheduling="static" or
"continuous")). Then measure what the policy buys: the share of seat-steps that did useful work.
Check your work:  make check EX=ch08.3
"""

from __future__ import annotations


def static_finish_steps(output_lens: list[int], max_num_seqs: int) -> list[int]:
    """The step in which each request produces its last token under static batching."""
    raise NotImplementedError("TODO: batches of max_num_seqs; a batch lasts as long as its longest member")


def continuous_finish_steps(output_lens: list[int], max_num_seqs: int) -> list[int]:
    """The step in which each request produces its last token under continuous batching."""
    raise NotImplementedError("TODO: simulate steps: fill free seats from the queue, decrement, retire finished")


def seat_occupancy(output_lens: list[int], max_num_seqs: int, finish_steps: list[int]) -> float:
    """Useful share of the seats over the whole run: generated tokens / (steps taken * max_num_seqs)."""
    raise NotImplementedError("TODO: sum of output_lens over (last finish step * max_num_seqs)")
