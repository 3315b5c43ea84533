"""Reference solution for ch10.3 — the token-budget scheduler and its trade-off (see ../ex3_chunked_schedule.py)."""

from __future__ import annotations


def plan(prompt_lens: list[int], output_lens: list[int], budget: int, max_num_seqs: int) -> list[dict[int, int]]:
    n = len(prompt_lens)
    computed, generated = [0] * n, [0] * n
    waiting, running = list(range(n)), []
    steps = []
    while waiting or running:
        left, step = budget, {}
        for i in running:  # oldest first
            if left == 0:
                break
            todo = prompt_lens[i] + generated[i] - computed[i]  # rest of the prompt, or the 1 sampled token
            step[i] = min(todo, left)
            left -= step[i]
        while waiting and len(running) < max_num_seqs and left > 0:
            i = waiting.pop(0)
            running.append(i)
            step[i] = min(prompt_lens[i], left)
            left -= step[i]
        for i, k in step.items():
            computed[i] += k
            if computed[i] == prompt_lens[i] + generated[i]:  # reached the end: sample one token
                generated[i] += 1
                if generated[i] == output_lens[i]:
                    running.remove(i)
        steps.append(step)
    return steps


def first_token_steps(steps: list[dict[int, int]], prompt_lens: list[int]) -> list[int]:
    done, first = [0] * len(prompt_lens), [0] * len(prompt_lens)
    for s, step in enumerate(steps, 1):
        for i, k in step.items():
            done[i] += k
            if not first[i] and done[i] >= prompt_lens[i]:
                first[i] = s
    return first


def worst_decode_step(steps: list[dict[int, int]], prompt_lens: list[int]) -> int:
    done, worst = [0] * len(prompt_lens), 0
    for step in steps:
        if any(done[i] >= prompt_lens[i] for i in step):  # someone decodes in this step
            worst = max(worst, sum(step.values()))
        for i, k in step.items():
            done[i] += k
    return worst
