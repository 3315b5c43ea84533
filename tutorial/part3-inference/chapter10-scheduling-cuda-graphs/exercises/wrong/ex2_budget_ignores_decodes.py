"""Mistake for ch10.2: the prompt gets the whole budget, forgetting the running decodes take one token each first."""

from __future__ import annotations


def plain_step_ms(stages: dict[str, float]) -> float:
    return sum(stages[k] for k in ("schedule", "prepare", "forward", "sample", "detokenize"))


def overlap_step_ms(stages: dict[str, float]) -> float:
    return max(stages["forward"], stages["schedule"] + stages["prepare"]) + stages["sample"] + stages["detokenize"]


def padded_rows(num_seqs: int, captured_sizes: list[int]) -> int:
    fitting = [s for s in captured_sizes if s >= num_seqs]
    return min(fitting) - num_seqs if fitting else 0


def prefill_steps(prompt_len: int, budget: int, num_decodes: int) -> int:
    return -(-prompt_len // budget)
