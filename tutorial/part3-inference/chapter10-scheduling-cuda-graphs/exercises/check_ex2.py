"""Checker for ch10.2 — the overlap formula against a two-lane timeline simulated step by step, padding against
the engine's pick_graph_size, and prefill steps against the real engine's scheduler."""

from __future__ import annotations

import random

from mlsys.engine import Engine, EngineConfig, SamplingParams, cuda_graphs
from mlsys.exercises import task
from mlsys.model import GPT, GPTConfig

KEYS = ("schedule", "prepare", "forward", "sample", "detokenize")


def simulate_overlap(st: dict[str, float], steps: int = 50) -> float:
    """CPU lane and device lane: forward N on the device while the CPU schedules + prepares N+1; then the CPU
    samples and detokenizes N, and only then launches N+1. Returns the steady-state time between launches."""
    cpu_work = st["schedule"] + st["prepare"]
    launch = cpu_work  # step 0's inputs are prepared before anything runs
    launches = []
    for _ in range(steps):
        launches.append(launch)
        forward_done = launch + st["forward"]
        next_prepared = launch + cpu_work  # the CPU prepared step N+1 during forward N
        launch = max(forward_done, next_prepared) + st["sample"] + st["detokenize"]
    return launches[-1] - launches[-2]


def _cases() -> list[dict[str, float]]:
    rng = random.Random(0)
    cases = [dict(zip(KEYS, (0.2, 0.5, 3.0, 0.1, 0.2))), dict(zip(KEYS, (1.0, 2.5, 1.5, 0.3, 0.4)))]
    return cases + [dict(zip(KEYS, (rng.uniform(0, 2) for _ in KEYS))) for _ in range(20)]


@task("plain_step_ms: the five stages one after another, their sum")
def check_plain(ex) -> None:
    for st in _cases():
        got, want = ex.plain_step_ms(dict(st)), sum(st.values())
        assert abs(got - want) < 1e-9, f"stages {({k: round(v, 3) for k, v in st.items()})}: {got:.4f}, want {want:.4f}"


@task("overlap_step_ms: equals a simulated two-lane timeline (CPU prepares N+1 while the device runs N)")
def check_overlap(ex) -> None:
    for st in _cases():
        want = simulate_overlap(st)
        got = ex.overlap_step_ms(dict(st))
        assert abs(got - want) < 1e-9, f"stages {({k: round(v, 3) for k, v in st.items()})}: {got:.4f}, want {want:.4f}"


@task("padded_rows: equals pick_graph_size(n) - n from the engine, 0 when the batch runs eagerly")
def check_padding(ex) -> None:
    for sizes in ([1, 2, 4, 8, 16, 24, 32], [8, 1, 4, 2], [3]):
        for n in range(1, max(sizes) + 4):
            picked = cuda_graphs.pick_graph_size(n, sizes)
            want = 0 if picked is None else picked - n
            got = ex.padded_rows(n, sizes)
            assert got == want, f"padded_rows({n}, {sizes}) = {got}, want {want}"


def engine_prefill_steps(prompt_len: int, budget: int, num_decodes: int) -> int:
    engine = Engine(GPT(GPTConfig.preset("tiny")), config=EngineConfig(max_num_batched_tokens=budget, block_size=4))
    decoders = {engine.add_request([5, 6], SamplingParams(max_tokens=60, ignore_eos=True))
                for _ in range(num_decodes)}
    while decoders:  # the decoders' prefills, one token each sampled: from then on they decode
        decoders -= {o.request_id for o in engine.step() if o.token_ids}
    long = engine.add_request([7] * prompt_len, SamplingParams(max_tokens=1, ignore_eos=True))
    steps = 0
    while True:
        steps += 1
        if any(o.request_id == long and o.token_ids for o in engine.step()):
            return steps


@task("prefill_steps: equals the steps the engine's scheduler takes to prefill a prompt beside running decodes")
def check_chunks(ex) -> None:
    for prompt_len, budget, decodes in [(40, 16, 0), (40, 16, 3), (41, 8, 3), (9, 10, 1), (50, 64, 5), (30, 7, 6)]:
        want = engine_prefill_steps(prompt_len, budget, decodes)
        got = ex.prefill_steps(prompt_len, budget, decodes)
        assert got == want, f"prompt {prompt_len}, budget {budget}, {decodes} decodes: {got} steps, engine {want}"
