"""Mistake for ch08.3: a static batch is taken to last as long as its last member, not its longest."""

from __future__ import annotations


def static_finish_steps(output_lens: list[int], max_num_seqs: int) -> list[int]:
    out, start = [], 0  # start: steps taken by the batches before this one
    for b in range(0, len(output_lens), max_num_seqs):
        batch = output_lens[b : b + max_num_seqs]
        out += [start + n for n in batch]
        start += batch[-1]
    return out


def continuous_finish_steps(output_lens: list[int], max_num_seqs: int) -> list[int]:
    finish = [0] * len(output_lens)
    waiting = list(range(len(output_lens)))
    running: dict[int, int] = {}  # request -> tokens still to produce
    step = 0
    while waiting or running:
        step += 1
        while waiting and len(running) < max_num_seqs:  # seats freed last step are refilled now
            i = waiting.pop(0)
            running[i] = output_lens[i]
        for i in list(running):
            running[i] -= 1
            if running[i] == 0:
                finish[i] = step
                del running[i]
    return finish


def seat_occupancy(output_lens: list[int], max_num_seqs: int, finish_steps: list[int]) -> float:
    return sum(output_lens) / (max(finish_steps) * max_num_seqs)
