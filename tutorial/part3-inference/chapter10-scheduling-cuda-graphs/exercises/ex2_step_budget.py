"""Exercise ch10.2 — warm-up: what overlap, CUDA graphs and chunked prefill each cost or save per step.

A plain engine step runs its stages one after the other: schedule, prepare, forward, sample, detokenize (the
keys of Engine.last_step_timing). Overlap scheduling runs step N+1's schedule + prepare while step N's forward
computes, then samples and detokenizes step N before launching N+1, so in a steady state one step takes
max(forward, schedule + prepare) + sample + detokenize.
A decode batch of n sequences runs in the smallest captured graph size >= n (eagerly, with no padding, when
there is none); chunked prefill gives a prompt what the token budget leaves after the running decodes' one token
each, every step.
Check your work:  make check EX=ch10.2
"""

from __future__ import annotations


def plain_step_ms(stages: dict[str, float]) -> float:
    """One plain step: the five stages in sequence."""
    raise NotImplementedError("TODO: schedule + prepare + forward + sample + detokenize")


def overlap_step_ms(stages: dict[str, float]) -> float:
    """One overlapped step in a steady state: the next step's CPU work hides behind this step's forward."""
    raise NotImplementedError("TODO: max(forward, schedule + prepare) + sample + detokenize")


def padded_rows(num_seqs: int, captured_sizes: list[int]) -> int:
    """Padding rows of a decode batch of num_seqs in the smallest captured size that holds it (0 when eager)."""
    raise NotImplementedError("TODO: smallest size >= num_seqs, minus num_seqs; 0 when no size is large enough")


def prefill_steps(prompt_len: int, budget: int, num_decodes: int) -> int:
    """Steps a prompt of prompt_len tokens needs when num_decodes running decodes take one token of every step's
    budget first (num_decodes < budget)."""
    raise NotImplementedError("TODO: ceil(prompt_len / what the decodes leave of the budget)")
