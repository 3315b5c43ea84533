"""Exercise ch10.3 — extend: write the token-budget scheduler, then measure what the budget trades.

All requests arrive at once, in order; request i has a prompt of prompt_lens[i] tokens and generates exactly
output_lens[i] tokens. Each step has a budget of `budget` tokens and at most max_num_seqs running requests:

  1. running requests first, in the order they were admitted, while budget is left: each computes
     n = min(its tokens still to compute, budget) tokens (the rest of its prompt while prefilling, 1 when
     decoding); the budget shrinks by n;
  2. then waiting requests, in arrival order, are admitted while a seat is free and budget is left, computing
     min(prompt_len, budget) tokens.

A request whose step reaches the end of what it had to compute samples one token in that step (its first token
ends the prefill); it finishes, and leaves, when it has output_lens[i] tokens. This is mlsys.engine's scheduler
(chunked prefill through max_num_batched_tokens), and your plan must equal it step for step. Then measure the
trade: the largest step a decoding request has to wait through, against when each prompt's first token appears.
Check your work:  make check EX=ch10.3
"""

from __future__ import annotations


def plan(prompt_lens: list[int], output_lens: list[int], budget: int, max_num_seqs: int) -> list[dict[int, int]]:
    """One dict per step until every request has finished: request index -> tokens computed in that step
    (only the scheduled requests appear)."""
    raise NotImplementedError("TODO: simulate: running first (rest of prompt or 1), then admit, then sample")


def first_token_steps(steps: list[dict[int, int]], prompt_lens: list[int]) -> list[int]:
    """For each request, the 1-based step whose tokens complete its prompt (that step samples its first token)."""
    raise NotImplementedError("TODO: accumulate each request's tokens until they reach its prompt length")


def worst_decode_step(steps: list[dict[int, int]], prompt_lens: list[int]) -> int:
    """The most tokens batched into one step that also decodes for some request (a request past its prompt):
    the step time a decoding request's inter-token latency has to absorb. 0 if no step decodes."""
    raise NotImplementedError("TODO: a request decodes in a step when its prompt was complete before that step")
