"""Checker for ch08.3 — your finish steps against the engine's own scheduler (mlsys.engine with a random-init
tiny GPT, static and continuous), and the measured occupancy against hand values."""

from __future__ import annotations

import random

from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.exercises import task
from mlsys.model import GPT, GPTConfig

WORKLOADS = [([5, 1, 9, 2, 3], 2), ([1, 1, 1, 1], 3), ([12, 2, 2, 2, 2, 2, 7, 1], 3), ([4, 8, 3, 6, 1, 5, 2], 4)]


def engine_finish_steps(output_lens: list[int], max_num_seqs: int, scheduling: str) -> list[int]:
    """Run the real engine and note the step in which each request finishes."""
    engine = Engine(GPT(GPTConfig.preset("tiny")),
                    config=EngineConfig(max_num_seqs=max_num_seqs, scheduling=scheduling, block_size=4))
    rng = random.Random(0)
    ids = [engine.add_request([rng.randrange(3, 40) for _ in range(4)], SamplingParams(max_tokens=n, ignore_eos=True))
           for n in output_lens]
    finish, step = {}, 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            if out.finished:
                finish[out.request_id] = step
    return [finish[i] for i in ids]


def _compare(finish_steps, scheduling: str) -> None:
    for lens, seats in WORKLOADS:
        want = engine_finish_steps(lens, seats, scheduling)
        got = list(finish_steps(list(lens), seats))
        assert got == want, f"{scheduling}, output_lens {lens}, max_num_seqs {seats}: got {got}, engine {want}"


@task("static_finish_steps: equals the engine's static scheduler, step for step")
def check_static(ex) -> None:
    _compare(ex.static_finish_steps, "static")


@task("continuous_finish_steps: equals the engine's continuous scheduler, step for step")
def check_continuous(ex) -> None:
    _compare(ex.continuous_finish_steps, "continuous")


@task("seat_occupancy: hand values, and continuous batching keeps more seats busy on a skewed workload")
def check_occupancy(ex) -> None:
    got = ex.seat_occupancy([5, 1, 9, 2, 3], 2, [5, 1, 14, 11, 14])
    assert abs(got - 20 / 28) < 1e-12, f"seat_occupancy([5, 1, 9, 2, 3], 2, [..., 14]) = {got}, want 20/28"
    lens = [30, 2, 3, 2, 4, 2, 3, 28, 2, 2, 3, 2]
    static = ex.seat_occupancy(lens, 4, engine_finish_steps(lens, 4, "static"))
    cont = ex.seat_occupancy(lens, 4, engine_finish_steps(lens, 4, "continuous"))
    assert cont > static + 0.1, f"occupancy continuous {cont:.2f} vs static {static:.2f}: expected a clear gain"
