"""Checker for ch10.3 — your plan against the engine's own scheduler (every step's scheduled tokens, recorded
from mlsys.engine running a random-init tiny GPT), and the measured trade-off against the engine's record."""

from __future__ import annotations

from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.exercises import task
from mlsys.model import GPT, GPTConfig

# short decoders first, then long prompts arriving behind them
WORKLOADS = [([3, 3, 40, 2, 30], [12, 10, 3, 8, 4]), ([50, 2, 2], [2, 6, 6]),
             ([5, 9, 33, 4, 4, 20], [4, 1, 5, 9, 2, 3])]


def engine_plan(prompt_lens: list[int], output_lens: list[int], budget: int, seats: int) -> list[dict[int, int]]:
    engine = Engine(GPT(GPTConfig.preset("tiny")), config=EngineConfig(
        max_num_batched_tokens=budget, max_num_seqs=seats, block_size=4))
    index = {engine.add_request([3 + (7 * i + j) % 40 for j in range(p)],
                                SamplingParams(max_tokens=o, ignore_eos=True)): i
             for i, (p, o) in enumerate(zip(prompt_lens, output_lens))}
    log, schedule = [], engine.scheduler.schedule

    def recording():
        out = schedule()
        log.append({index[s.request_id]: n for s, n in out.scheduled})
        return out

    engine.scheduler.schedule = recording
    while engine.has_unfinished():
        engine.step()
    return [s for s in log if s]


@task("plan: equals the engine's scheduler step for step (budgets 4 .. 64, 2 and 3 seats)")
def check_plan(ex) -> None:
    for prompts, outputs in WORKLOADS:
        for budget, seats in [(64, 3), (16, 3), (7, 2), (4, 3)]:
            want = engine_plan(prompts, outputs, budget, seats)
            got = [dict(s) for s in ex.plan(list(prompts), list(outputs), budget, seats)]
            bad = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]), None)
            where = (f"first difference at step {bad + 1}: got {got[bad]}, engine {want[bad]}" if bad is not None
                     else f"{len(got)} steps, engine {len(want)}")
            assert got == want, f"prompts {prompts}, outputs {outputs}, budget {budget}, {seats} seats: {where}"


def _truth(steps: list[dict[int, int]], prompts: list[int]) -> tuple[list[int], int]:
    done, first, worst = [0] * len(prompts), [0] * len(prompts), 0
    for s, step in enumerate(steps, 1):
        decoding = [i for i in step if done[i] >= prompts[i]]
        if decoding:
            worst = max(worst, sum(step.values()))
        for i, k in step.items():
            done[i] += k
            first[i] = first[i] or (s if done[i] >= prompts[i] else 0)
    return first, worst


@task("first_token_steps: the step at which each prompt's last token is scheduled, read from the engine's schedule")
def check_first_token(ex) -> None:
    for prompts, outputs in WORKLOADS:
        for budget in (64, 8):
            steps = engine_plan(prompts, outputs, budget, 3)
            first, _ = _truth(steps, prompts)
            got_first = list(ex.first_token_steps(steps, list(prompts)))
            assert got_first == first, f"prompts {prompts}, budget {budget}: first tokens {got_first}, want {first}"


@task("worst_decode_step: the most tokens of any step that carries a decode, read from the engine's schedule")
def check_worst_decode(ex) -> None:
    for prompts, outputs in WORKLOADS:
        for budget in (64, 8):
            steps = engine_plan(prompts, outputs, budget, 3)
            _, worst = _truth(steps, prompts)
            got_worst = ex.worst_decode_step(steps, list(prompts))
            assert got_worst == worst, f"prompts {prompts}, budget {budget}: worst step {got_worst}, want {worst}"


@task("plan: measured on your plan, a smaller budget shrinks the decoders' worst step and delays the long prompt")
def check_tradeoff(ex) -> None:
    # the measures are the engine's (_truth, the oracle of the two tasks above), not your own two functions, so a
    # wrong first_token_steps or worst_decode_step does not fail this task
    prompts, outputs = [3, 3, 3, 48], [5, 20, 20, 2]  # the long prompt gets a seat while two others decode
    rows = []
    for budget in (64, 16, 8):
        steps = [dict(s) for s in ex.plan(prompts, outputs, budget, 3)]
        first, worst = _truth(steps, prompts)
        rows.append((budget, worst, first[3]))
    worst = [r[1] for r in rows]
    ttft = [r[2] for r in rows]
    assert worst[0] > worst[1] > worst[2], f"(budget, worst decode step, long prompt's first step): {rows}"
    assert ttft[0] < ttft[1] < ttft[2], f"(budget, worst decode step, long prompt's first step): {rows}"
