"""Chapter 8 mechanisms against their oracles: the FLOP and byte formulas of a step (torch's flop counter, a
brute-force count of the causal mask, the sizes of the real tensors), the serving metrics (numpy), the engine vs
transformers on a batch, the benchmark loop for both schedulers, and the traced request (its stage times against
separately measured step times, its call counts against the forward passes that ran)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from conftest import load_script, scripts_dir, smoke_run
from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.model import GPT, GPTConfig
from mlsys.serving_metrics import format_summary, request_latencies, serving_summary

CH08 = scripts_dir(8)


@pytest.fixture(scope="module")
def pvd():
    return load_script(CH08 / "prefill_vs_decode.py")


# --------------------------------------------------------------------------------------- FLOPs and bytes
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_step_flops_equal_torch_flop_counter(pvd, preset):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset)).eval()
    pvd.check_flop_formula(model)  # useful FLOPs + the masked scores SDPA's math backend computes == the counter
    cfg = model.config
    # a mixed step the way the engine runs it: a 5-token prefill (15 causal pairs), two decodes; only the last
    # row of each sequence reaches the head
    assert pvd.step_flops(cfg, [5, 1, 1], [5, 9, 30], 3) == (
        2 * 12 * cfg.n_layer * cfg.n_embd**2 * 7 + 4 * cfg.n_layer * cfg.n_embd * (15 + 9 + 30)
        + 2 * cfg.n_embd * cfg.vocab_size * 3)


@pytest.mark.parametrize("q, k", [(1, 1), (1, 40), (7, 7), (240, 240), (5, 12), (16, 100)])
def test_attention_pairs_count_the_causal_mask(pvd, q, k):
    """Brute force: new token i sits at absolute position k - q + i and sees every key at a position <= its own."""
    allowed = sum(1 for i in range(q) for key in range(k) if key <= k - q + i)
    assert pvd.attention_pairs(q, k) == allowed
    if q == k:
        assert allowed == k * (k + 1) // 2  # a prefill: L(L+1)/2, not L^2


def test_about_two_flops_per_parameter_per_token(pvd, small_model):
    small = small_model
    cfg = small.config
    linear_weights = sum(m.weight.numel() for m in small.h.modules() if isinstance(m, torch.nn.Linear))
    per_token = pvd.step_flops(cfg, [1], [0], 0)  # one token, no attention, no head
    assert per_token == 2 * linear_weights
    total = sum(p.numel() for p in small.parameters())
    assert 0.9 < per_token / (2 * total) < 1.0  # the rest of the parameters are embeddings, biases, norms
    # the lesson's P = 12 n_layer C^2 = 786,432 and P_all = 832,128 for this model
    assert linear_weights == 12 * cfg.n_layer * cfg.n_embd**2 == 786_432 and total == 832_128


def test_step_bytes_equal_the_sizes_of_the_real_tensors(pvd, small_model):
    small = small_model
    cfg, n_params = small.config, sum(p.numel() for p in small.parameters())
    weights = sum(p.numel() * p.element_size() for p in small.parameters())
    for batch, ctx in [(1, 10), (4, 64), (16, 200)]:
        cache = small.new_kv_cache(batch, ctx + 1)  # a decode step reads ctx positions and writes one
        kv_read = sum(c.k[:, :, :ctx].nbytes + c.v[:, :, :ctx].nbytes for c in cache)
        kv_write = sum(c.k[:, :, :1].nbytes + c.v[:, :, :1].nbytes for c in cache)
        assert pvd.step_bytes(n_params, cfg, [1] * batch, [ctx] * batch) == weights + kv_read + kv_write
    # decode intensity grows with the batch (weights shared), prefill intensity with the prompt
    ai = [pvd.step_flops(cfg, [1] * b, [65] * b, b) / pvd.step_bytes(n_params, cfg, [1] * b, [65] * b)
          for b in (1, 8, 64)]
    assert ai[0] < 1 < ai[1] < ai[2]
    assert pvd.step_flops(cfg, [240], [240], 1) / pvd.step_bytes(n_params, cfg, [240], [0]) > 50 * ai[0]


# ------------------------------------------------------------------------------------------ serving metrics
def test_request_latencies_and_summary_equal_numpy():
    rng = np.random.default_rng(1)
    reqs = []
    for i in range(50):
        arrival = i * 0.03
        times = list(arrival + rng.uniform(0.01, 0.3) + np.cumsum(rng.exponential(0.02, size=rng.integers(1, 30))))
        reqs.append({"arrival": arrival, "token_times": times, "prompt_len": 5 + i})
    lat = request_latencies(1.0, [1.5, 1.75, 2.5])
    assert lat["ttft"] == 0.5 and lat["tpot"] == 0.5 and np.allclose(lat["itl"], [0.25, 0.75]) and lat["e2e"] == 1.5
    assert request_latencies(0.0, [0.2])["tpot"] is None
    s = serving_summary(reqs, duration=2.0)
    itl = np.concatenate([np.diff(r["token_times"]) for r in reqs]) * 1e3
    tpot = [(r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1) * 1e3
            for r in reqs if len(r["token_times"]) > 1]
    ttft = [(r["token_times"][0] - r["arrival"]) * 1e3 for r in reqs]
    assert s["p99_itl_ms"] == pytest.approx(np.percentile(itl, 99)) and s["mean_itl_ms"] == pytest.approx(itl.mean())
    assert s["median_tpot_ms"] == pytest.approx(np.median(tpot)) and s["p99_ttft_ms"] == pytest.approx(
        np.percentile(ttft, 99))
    n_out = sum(len(r["token_times"]) for r in reqs)
    assert s["output_throughput"] == pytest.approx(n_out / 2.0) and s["request_throughput"] == 25.0
    assert s["total_input_tokens"] == sum(5 + i for i in range(50))
    text = format_summary(s)
    for label in ("Successful requests:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Median TTFT (ms):", "P99 TPOT (ms):", "Mean ITL (ms):"):
        assert label in text
    assert text.splitlines()[0].startswith("=") and len(text.splitlines()[0]) == 50


# ------------------------------------------------------------------------------------------- the oracles
def test_engine_batch_equals_transformers_generate(small_model):
    vt = load_script(CH08 / "vs_transformers.py")
    from mlsys.data import Tokenizer, make_corpus
    from mlsys.model import to_hf_model

    tok = Tokenizer()
    prompts = torch.tensor([tok.encode(line[:12], bos=True) for line in make_corpus(6, seed=5).splitlines()])
    ours = vt.engine_greedy(Engine(small_model, config=EngineConfig(max_num_seqs=6)), prompts, 40)
    theirs = vt.hf_greedy(to_hf_model(small_model), prompts, 40)
    assert ours.shape == (6, 40) and torch.equal(ours, theirs)


def test_engine_batch_equals_transformers_generate_on_llama_weights(tmp_path):
    """--model llama: the engine serves the checkpoint folder the script writes; transformers' own greedy
    generate on the model that wrote it (called here, not through the script) must give the same tokens."""
    pytest.importorskip("transformers")
    vt = load_script(CH08 / "vs_transformers.py")
    from mlsys.data import Tokenizer, make_corpus

    ours, hf = vt.llama_pair(3, str(tmp_path))
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()
    assert type(hf).__name__ == "LlamaForCausalLM" and type(ours).__name__ == "Llama"
    assert hf.config.num_key_value_heads < hf.config.num_attention_heads  # grouped-query attention
    tok = Tokenizer()
    prompts = torch.tensor([tok.encode(line[:12], bos=True) for line in make_corpus(5, seed=7).splitlines()])
    with torch.no_grad():
        expected = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=40,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[:, prompts.size(1):]
    got = vt.engine_greedy(Engine(ours, config=EngineConfig(max_num_seqs=5)), prompts, 40)
    assert got.shape == expected.shape == (5, 40)
    assert len(set(expected.flatten().tolist())) > 3  # not a constant stream, which would match trivially
    assert torch.equal(got, expected)


def test_both_schedulers_serve_the_workload_and_continuous_needs_fewer_steps(small_model):
    bb = load_script(CH08 / "batching_bench.py")
    args = bb.Settings(num_requests=12, request_rate=math.inf, prompt_max=20, short_max=6, long_min=40,
                       long_max=48, long_fraction=0.25, max_num_seqs=4)
    work = bb.make_workload(args)
    assert work == bb.make_workload(args)  # seeded
    assert all(w.arrival == 0 for w in work) and sum(w.max_tokens >= 40 for w in work) >= 1
    runs = {mode: bb.run_mode(small_model, mode, work, args) for mode in ("static", "continuous")}  # self-checks
    for r in runs.values():
        assert r["summary"]["completed"] == 12
        assert r["summary"]["total_output_tokens"] == sum(w.max_tokens for w in work)
    assert runs["continuous"]["num_steps"] < runs["static"]["num_steps"]
    assert runs["continuous"]["mean_seqs_per_step"] > runs["static"]["mean_seqs_per_step"]
    for w in work:  # greedy: which scheduler ran it does not change the tokens
        assert runs["static"]["finals"][w.request_id].token_ids == runs["continuous"]["finals"][w.request_id].token_ids
    rows = {r["metric"]: r for r in bb.comparison(runs)}
    for key, _, better in bb.ROWS:  # the "better" column against the numbers themselves
        s, c = rows[key]["static"], rows[key]["continuous"]
        if better == "lower" and f"{s:.{bb.DECIMALS}f}" != f"{c:.{bb.DECIMALS}f}":
            assert rows[key]["better"] == ("continuous" if c < s else "static")
    poisson = bb.make_workload(bb.Settings(num_requests=2000, request_rate=50.0))
    gaps = np.diff([0.0] + [w.arrival for w in poisson])
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.1) and gaps.std() == pytest.approx(1 / 50, rel=0.15)


@pytest.mark.parametrize("budget", [64, 200])
def test_first_step_holds_the_prompts_that_fit_the_token_budget(small_model, budget):
    """The lesson's reading of the occupancy figure: the first step of a saturated run holds as many prompts as
    the step's token budget reaches (the last one as a partial prefill chunk), under either scheduler."""
    bb = load_script(CH08 / "batching_bench.py")
    args = bb.Settings(num_requests=10, prompt_max=40, short_max=5, long_min=6, long_max=8, max_num_seqs=8,
                       max_num_batched_tokens=budget)
    work = bb.make_workload(args)
    lengths = [len(w.prompt) + 1 for w in work[: args.max_num_seqs]]  # <bos> + characters
    fit = next((i + 1 for i in range(len(lengths)) if sum(lengths[: i + 1]) >= budget), len(lengths))
    for mode in ("static", "continuous"):
        assert bb.run_mode(small_model, mode, work, args)["first_step_seqs"] == fit


def test_decode_timing_measures_pure_decode_steps(pvd, small_model):
    engine = Engine(small_model, config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=256))
    steps = []
    step = engine.step

    def recorded_step():
        out = step()
        steps.append(dict(engine.last_step_timing))
        return out

    engine.step = recorded_step
    prompts = [[1, *range(10 + i, 30 + i)] for i in range(4)]
    t = pvd.decode_time(engine, prompts, reps=3)
    assert t["repeats"] == 3 and 0 < t["best_s"] <= t["median_s"]
    assert steps[0]["num_batched_tokens"] == sum(map(len, prompts))  # one step prefilled all four
    assert [(s["num_seqs"], s["num_batched_tokens"]) for s in steps[1:5]] == [(4, 4)] * 4  # warm-up + 3 timed
    assert t["best_s"] == min(s["forward"] for s in steps[2:5])
    engine.check_invariants()


@pytest.mark.parametrize("best, median", [
    ((10.0, 15.0), (10.5, 16.0)),  # 1.5x the time for 2x the tokens: rose
    ((10.0, 25.0), (11.0, 27.0)),  # 2.5x: fell
    ((5.1, 3.65), (10.2, 17.0)),  # 0.72x and 1.67x: a load outlier, yet both below 2x: rose
    ((10.0, 12.0), (10.0, 30.0)),  # 1.2x vs 3x: one below 2x, one above: cannot tell
    ((25.2, 121.2), (32.0, 60.2)),  # a reader's 4.81x and 1.88x, both slower: cannot tell whether it paid off
    ((10.0, 22.0), (10.0, 50.0)),  # 2.2x and 5x: far apart, but both say fell
    ((10.0, 11.0), (10.0, 19.0)),  # 1.1x vs 1.9x: rose
])
def test_last_doubling_sentence_from_synthetic_timings(pvd, best, median):
    """Tokens per second rise when the step time grows by less than the batch (here 2x). The sentence names a
    direction only when the best and the median ratio agree on it; otherwise it says the run cannot tell (a
    reader's run, 4.81x and 1.88x, was called "no direction" although both ratios said the step got slower)."""
    prev = dict(batch=32, ms=best[0], median_ms=median[0])
    last = dict(batch=64, ms=best[1], median_ms=median[1])
    sentence = pvd.doubling_verdict(prev, last)
    rose = [b / a < 2 for a, b in (best, median)]
    if rose[0] == rose[1]:
        assert sentence.endswith(f"so tokens per second {'rose' if rose[0] else 'fell'} at the largest batch")
    else:
        assert "cannot tell whether the larger batch paid off" in sentence and "rose" not in sentence
        assert "fell" not in sentence
    assert "direction" not in sentence and "longer" not in sentence
    assert f"{best[1] / best[0]:.2f}x the step time" in sentence


def test_traced_request_stages_against_the_steps_that_ran(small_model):
    rl = load_script(CH08 / "request_lifecycle.py")
    engine = Engine(small_model)
    walls, forwards = [], []
    step, execute = engine.step, engine.runner.execute

    def timed_step():
        start = time.perf_counter()
        out = step()
        walls.append((time.perf_counter() - start) * 1e3)
        return out

    def timed_execute(*a, **kw):
        start = time.perf_counter()
        out = execute(*a, **kw)
        forwards.append((time.perf_counter() - start) * 1e3)
        return out

    engine.step, engine.runner.execute = timed_step, timed_execute
    tr = rl.trace_request(engine, '{"name": "ken", ', SamplingParams(max_tokens=10, ignore_eos=True))
    kinds = [s["kind"] for s in tr["steps"]]
    assert kinds == ["prefill"] + ["decode"] * 9 and tr["steps"][0]["tokens"] == 17  # <bos> + 16 characters
    assert all(s["tokens"] == 1 for s in tr["steps"][1:])
    assert "".join(s["new_text"] for s in tr["steps"]) == tr["final"].text
    assert all(c.startswith(b"data: {") and c.endswith(b"\n\n") for c in tr["chunks"])
    # one row per step that ran, one forward pass per step: counted outside the engine
    assert len(tr["steps"]) == len(walls) == len(forwards) == 10
    eps = 1e-6  # ms: float rounding of perf_counter differences
    for row, wall, fwd in zip(tr["steps"], walls, forwards):
        stages = [row[k] for k in rl.STAGES]
        assert min(stages) >= 0 and sum(stages) <= wall + eps  # the stages are disjoint parts of the step
        assert row["forward"] + eps >= fwd  # the forward stage contains the forward pass
    table = {r["stage"]: r for r in rl.stage_table(tr)}
    assert table["prefill: forward"]["calls"] == 1 and table["decode: forward"]["calls"] == 9
    assert table["stream (SSE chunks)"]["calls"] == len(tr["chunks"]) == 10
    assert table["decode: forward"]["ms"] >= sum(forwards[1:]) - eps


def test_lifecycle_kv_snapshots_hold_whole_blocks(small_model):
    """request_lifecycle.py's KV figure: after every step each running sequence holds exactly the blocks its cached
    tokens need (ceil(tokens / block_size)), and the traced request's table only grows."""
    mod = load_script(CH08 / "request_lifecycle.py")
    engine = Engine(small_model, config=EngineConfig(max_num_seqs=3))
    engine.add_request('{"name": "', SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    tr = mod.trace_request(engine, '{"name": "ada", "age": ', SamplingParams(max_tokens=30))
    bs = engine.config.block_size
    for snap in tr["kv"]:
        for tokens, table in snap.values():
            assert len(table) == -(-tokens // bs), (tokens, table)
    mine = [snap[tr["rid"]][1] for snap in tr["kv"] if tr["rid"] in snap]
    assert all(a == b[: len(a)] for a, b in zip(mine, mine[1:]))


# ------------------------------------------------------------------------------------ pictures vs oracles
def test_flat_batch_picture_against_the_requests(small_model, tmp_path):
    """flat_batch.png, drawn from the runner's real prepare call: one cell per token; the step holds the traced
    prompt plus one decode per background request (counted from the prompts), positions are where each
    sequence stands, and every slot is block_table[p // B] * B + p % B of that sequence's table."""
    from types import SimpleNamespace

    from mlsys.data import Tokenizer, make_corpus

    rl = load_script(CH08 / "request_lifecycle.py")
    background, prompt = 3, '{"name": "ada", '
    engine = rl.busy_engine(small_model, background, seed=0)
    batches = rl.record_flat_batches(engine)
    tr = rl.trace_request(engine, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    batch = next(b for b in batches if tr["rid"] in b["request_ids"])
    B = engine.config.block_size
    cells = rl.draw_flat_batch(batch, tr["rid"], B, SimpleNamespace(plot_dir=str(tmp_path)))
    assert (tmp_path / "flat_batch.png").exists()
    # independent of the engine: prompt lengths of the requests, and where 1 prefill + 2 decode steps left them
    lines = make_corpus(background, seed=0).splitlines()
    want = {}  # request -> positions computed in this step
    for i, line in enumerate(lines):
        n = 1 + len(line[: 10 + 3 * i])  # <bos> + characters
        want[i] = [n + 2]  # the prefill sampled position n, two decodes computed n and n + 1: now n + 2
    want["traced"] = list(range(1 + len(Tokenizer().encode(prompt))))
    assert len(cells) == sum(map(len, want.values())) == len(want["traced"]) + background
    by_seq: dict[str, list[dict]] = {}
    for c in cells:
        by_seq.setdefault(c["request_id"], []).append(c)
    assert sorted(len(v) for v in by_seq.values()) == sorted(len(v) for v in want.values())
    assert [c["position"] for c in by_seq[tr["rid"]]] == want["traced"]
    assert sorted(c["position"] for rid, cs in by_seq.items() if rid != tr["rid"] for c in cs) == sorted(
        p for k, ps in want.items() if k != "traced" for p in ps)
    for rid, cs in by_seq.items():
        table = batch["block_tables"][batch["request_ids"].index(rid)]
        assert [c["slot"] for c in cs] == [table[c["position"] // B] * B + c["position"] % B for c in cs]



def test_default_neighbours_decode_three_positions_apart(small_model):
    """The lesson says the default run's background decodes sit at positions three apart in the traced request's
    prefill step (their prompts are three characters apart in length). Read here from the positions the runner
    really packed, at the default --background and --seed."""
    rl = load_script(CH08 / "request_lifecycle.py")
    args = rl.Settings()
    engine = rl.busy_engine(small_model, args.background, args.seed)
    batches = rl.record_flat_batches(engine)
    tr = rl.trace_request(engine, args.prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    batch = next(b for b in batches if tr["rid"] in b["request_ids"])
    starts = [p for rid, p, n in zip(batch["request_ids"], batch["starts"], batch["chunk_sizes"])
              if rid != tr["rid"] and n == 1]
    assert len(starts) == args.background
    assert [b - a for a, b in zip(starts, starts[1:])] == [3] * (args.background - 1)

def simulate_scheduler(work: list[tuple[int, int]], seats: int, budget: int, static: bool,
                       seated: list | None = None) -> list[list]:
    """Plain-Python scheduler: (prompt tokens, max_tokens) per request, all waiting at t = 0; per step the
    (request, tokens) computed, and (into `seated`) the requests holding a seat. Running first (oldest first),
    then admission while seats and budget last (static: only into an empty batch, a whole batch at once); a
    request leaves after sampling max_tokens."""
    need = [p for p, _ in work]  # tokens still to compute before the next sample
    made, waiting, running, steps = [0] * len(work), list(range(len(work))), [], []
    while waiting or running:
        left, step = budget, []
        for r in running:
            n = min(need[r], left)
            if n:
                step.append((r, n))
                left -= n
        if not static or not running:
            while waiting and len(running) < seats and (left > 0 or static):
                r = waiting.pop(0)
                running.append(r)
                n = min(need[r], left)
                if n:
                    step.append((r, n))
                    left -= n
        if seated is not None:
            seated.append(list(running))
        for r, n in step:
            need[r] -= n
            if need[r] == 0:  # the chunk reached the end: one token sampled
                made[r] += 1
                need[r] = 1
        running = [r for r in running if made[r] < work[r][1]]
        steps.append(step)
    return steps


def test_seats_animation_against_a_plain_scheduler(small_model):
    """seats.gif: the per-step batches of the real scheduler (both modes) equal a plain-Python simulation from
    the requests' prompt lengths and max_tokens; tokens per step = the sum of its chunks and never exceed the
    budget; the drawn cells are exactly those chunks, one seat per request at a time, plus a "wait" cell for every
    request that holds a seat in a step that computes nothing for it (static step 0: r2 and r3, seated with the
    batch, beyond the token budget)."""
    bb = load_script(CH08 / "batching_bench.py")
    work = [(chars + 1, n) for chars, n in bb.SEAT_DEMO]  # + <bos>
    num_steps = {}
    for mode in ("static", "continuous"):
        steps, held = bb.seat_demo(small_model, mode)
        seated_want = []
        want = simulate_scheduler(work, bb.SEAT_DEMO_SEATS, bb.SEAT_DEMO_BUDGET, static=mode == "static",
                                  seated=seated_want)
        assert [[(f"r{r}", n) for r, n in s] for s in want] == steps, mode
        assert [[f"r{r}" for r in s] for s in seated_want] == held, mode
        assert all(sum(n for _, n in s) <= bb.SEAT_DEMO_BUDGET for s in steps)
        assert sum(n for s in steps for _, n in s) == sum(p + t - 1 for p, t in work)  # every token but the last
        cells = bb.seat_cells(steps, bb.SEAT_DEMO_SEATS, {f"r{i}": p for i, (p, _) in enumerate(work)}, held)
        computed = [c for c in cells if c["kind"] != "wait"]
        assert [(c["request_id"], c["tokens"]) for c in computed] == [x for s in steps for x in s]
        waits = [(c["step"], c["request_id"]) for c in cells if c["kind"] == "wait"]
        assert waits == [(i, f"r{r}") for i, (s, h) in enumerate(zip(want, seated_want))
                         for r in h if r not in dict(s)]
        assert all(c["tokens"] == 0 for c in cells if c["kind"] == "wait")
        for i in range(len(steps)):
            seats = [c["seat"] for c in cells if c["step"] == i]
            assert len(seats) == len(set(seats)) and max(seats) < bb.SEAT_DEMO_SEATS
            assert len(seats) == len(held[i])  # every seated request has its cell, waiting or computing
        prefill = sum(c["tokens"] for c in cells if c["kind"] == "prefill")
        assert prefill == sum(p for p, _ in work)
        if mode == "static":  # the picture the lesson describes: r2 and r3 seated at step 0, computing nothing
            assert [r for i, r in waits if i == 0] == ["r2", "r3"]
        num_steps[mode] = len(steps)
    assert num_steps["continuous"] < num_steps["static"] <= 16


@pytest.mark.parametrize("best, median, load", [
    ([10.0, 12.0, 20.0, 42.2], [10.0, 13.0, 21.0, 49.0], 1.0),  # 2.11x and 2.33x for 2x, an idle machine: shown
    ([10.0, 12.0, 20.0, 42.2], [10.0, 13.0, 21.0, 49.0], 3.0),  # the same rows, load above the 2 cores: doubt
    ([10.0, 12.0, 20.0, 62.4], [10.0, 13.0, 21.0, 48.1], 7.5),  # a reader's 3.12x and 2.29x at load 7.5: doubt
    ([10.0, 12.0, 20.0, 62.4], [10.0, 13.0, 21.0, 48.1], 0.5),  # the ratios disagree by 36%: doubt, even idle
    ([10.0, 12.0, 20.0, 38.0], [10.0, 13.0, 21.0, 45.0], 7.5),  # 1.9x and 2.14x: one below 2x, so not shown
    ([10.0, 10.0, 25.0, 50.0], [10.0, 10.0, 24.0, 45.0], 1.0),  # last doubling 2x and 1.88x; from the peak at B=16: 5x
    ([10.0, 10.0, 25.0, 38.0], [10.0, 10.0, 24.0, 45.0], 1.0),  # from the peak at B=16, 3.8x and 4.5x: not shown
    ([1.0, 10.0, 20.0, 41.0], [1.0, 10.0, 20.0, 39.0], 1.0),  # peak at B=8; last doubling mixed, from the peak: shown
    ([10.0, 10.0, 25.0, 80.0], [10.0, 10.0, 30.0, 75.0], 1.0),  # last doubling 3.2x vs 2.5x; from the peak: shown
    ([10.0, 16.0, 24.0, 30.0], [10.0, 16.0, 24.0, 30.0], 9.0),  # tokens per second rising all along: not shown
])
def test_memory_side_sentence_from_synthetic_timings(pvd, best, median, load):
    """"The decode times show/do not show the memory side" is generated from the rows: the step time grew by more
    than the batch ratio by the fastest repetitions and by the medians, from the batch before the largest or from
    the batch of the most tokens per second to the largest. Load can do that too, so "show" needs the two ratios
    within 25% of each other and a load average at most the core count; otherwise "may show ... or only the
    machine's load". A reader's default run printed "show the memory side" for 3.12x and 2.29x at a load average
    of 7.5 on 2 cores, in a setting where the lesson says the model sits in the CPU's caches."""
    batches, cores = [8, 16, 32, 64], 2
    rows = [dict(batch=b, ms=t, median_ms=m, tokens_per_s=b / t * 1e3) for b, t, m in zip(batches, best, median)]
    peak = int(np.argmax(np.array(batches) / np.array(best)))
    grew, clean = [], []
    for i in sorted({len(batches) - 2, peak} - {len(batches) - 1}):
        k, rb, rm = batches[-1] / batches[i], best[-1] / best[i], median[-1] / median[i]
        if rb > k and rm > k:
            grew.append((i, k, rb, rm))
            if load <= cores and max(rb, rm) / min(rb, rm) <= 1.25:
                clean.append((i, k, rb, rm))
    sentence = pvd.memory_side(rows, load, cores)
    if clean or grew:
        i, k, rb, rm = (clean or grew)[0]
        head = "show the memory side: " if clean else "may show the memory side, or only the machine's load: "
        assert sentence.startswith(f"{head}from B={batches[i]} to B=64, {k:g}x the sequences took {rb:.2f}x the step "
                                   "time")
        assert f"{rm:.2f}x by the medians" in sentence
        if not clean:  # the doubt is named: the load, the disagreeing ratios, or both
            assert ("exceeded the 2 cores" in sentence) == (load > cores)
            assert ("differ by more than 25%" in sentence) == (max(rb, rm) / min(rb, rm) > 1.25)
    else:  # names every batch compared with the largest, and no "span" a reader must decode
        assert sentence.startswith("do not show the memory side: from B=32")
        assert "span" not in sentence
        for i in {len(batches) - 2, peak} - {len(batches) - 1}:
            assert f"B={batches[i]}" in sentence


@pytest.mark.parametrize("times_ms", [
    [1.0, 1.5, 2.0, 3.0],  # tokens/s still rising at the longest length (a reader's run: the peak was L = 240)
    [1.0, 1.2, 3.0, 9.0],  # the peak in the middle, the longest well below it
    [0.2, 1.0, 3.0, 9.0],  # the peak at the shortest length
    [1.0, 2.0, 4.0, 8.0],  # a tie all along: the first of equals is the peak
    [1.0],  # one length only
])
def test_prefill_peak_sentence_says_middle_only_strictly_inside(pvd, times_ms):
    """The sentence after "the most at" calls the peak a middle length only when it lies strictly between the
    shortest and the longest length measured, and never compares the longest length with itself (a reader's run
    printed "a middle length: ... at L = 240, and 1.00x that at L = 240", with 240 the longest)."""
    lens = [8, 16, 32, 64][: len(times_ms)]
    rows = [dict(prompt_len=n, ms=t, tokens_per_s=n / t * 1e3) for n, t in zip(lens, times_ms)]
    rate = np.array(lens) / np.array(times_ms)
    peak, last = int(np.argmax(rate)), len(lens) - 1
    sentence = pvd.prefill_peak_sentence(rows)
    assert ("a middle length" in sentence) == (0 < peak < last)
    assert ("longest length measured" in sentence) == (peak == last > 0)
    assert ("shortest length measured" in sentence) == (peak == 0 < last)
    assert sentence.count(f"L = {lens[-1]}") == 1  # the longest length is named once: never set against itself
    assert f"L = {lens[peak]} (" in sentence
    if peak < last:
        assert sentence.endswith(f"got {rate[-1] / rate[peak]:.2f}x that")
    else:
        assert "x that" not in sentence


def test_roofline_shows_counted_intensity_and_timed_flops(pvd, monkeypatch, tmp_path):
    """roofline.png: the roof is min(peak, bandwidth x intensity), bent at peak / bandwidth. A reader took dots
    drawn on the roof for a measurement that fit it perfectly, so no step may sit on the roof by construction: each
    is a tick on the x-axis at its counted intensity, and a hollow marker at the FLOP/s it reached, recomputed here
    as its FLOPs over its fastest time."""
    saved = []
    monkeypatch.setattr(pvd.plot, "save", lambda fig, args, name: saved.append((fig, name)) or tmp_path / name)
    prefill = [dict(prompt_len=n, intensity=i, gflop=g, ms=t) for n, i, g, t in
               [(8, 2.0, 0.01, 2.0), (64, 30.0, 0.1, 4.0), (240, 90.0, 0.4, 8.0)]]
    decode = [dict(batch=b, intensity=i, gflop=g, ms=t) for b, i, g, t in [(1, 0.5, 0.002, 0.5), (64, 5.0, 0.1, 5.0)]]
    peak, bandwidth = 40e9, 2e9  # ridge at 20 FLOPs per byte
    pvd.draw_roofline(prefill, decode, peak, bandwidth, None)
    (fig, name), = saved
    ax = fig.axes[0]
    roof, ridge, prefill_ticks, decode_ticks, prefill_timed, decode_timed = ax.get_lines()
    assert name == "roofline" and list(ridge.get_xdata()) == [20.0, 20.0]
    x, y = roof.get_xdata(), roof.get_ydata()
    assert list(x) == [0.25, 20.0, 180.0] and list(y) == pytest.approx([0.5, 40.0, 40.0])  # GFLOP/s
    for ticks, timed, rows in ((prefill_ticks, prefill_timed, prefill), (decode_ticks, decode_timed, decode)):
        assert list(ticks.get_xdata()) == list(timed.get_xdata()) == [r["intensity"] for r in rows]
        assert list(ticks.get_ydata()) == [0.0] * len(rows)  # on the x-axis: axes coordinates, not GFLOP/s
        assert ticks.get_transform() == ax.get_xaxis_transform()
        assert list(timed.get_ydata()) == pytest.approx([1e3 * r["gflop"] / r["ms"] for r in rows])  # GFLOP/s
        assert timed.get_markerfacecolor() == "none" and "timed" in timed.get_label()


def test_prefill_and_decode_sentences_follow_the_rows(smoke_cache):
    """The lesson quotes prefill_medians_agree (does the prefill peak sit at the same prompt length by the median
    times as by the best ones?) and decode_range_word (is a token at the largest batch cheaper than at B = 1?):
    both recomputed here from the rows' lengths, batches and times (tokens per second = tokens / time)."""
    proc = smoke_run(smoke_cache, CH08 / "prefill_vs_decode.py")
    assert proc["code"] == 0, proc["stderr"]
    res = proc["json"]["results"]
    prefill, decode = res["prefill"], res["decode"]
    best = max(prefill, key=lambda r: r["prompt_len"] / r["ms"])["prompt_len"]
    by_median = max(prefill, key=lambda r: r["prompt_len"] / r["median_ms"])["prompt_len"]
    text = res["prefill_medians_agree"]
    if best == by_median:
        assert text == "the medians peak at the same length"
    else:
        assert text.startswith(f"the medians peak at L = {by_median} instead")
    rates = [r["prompt_len"] / r["ms"] for r in prefill]
    peak = rates.index(max(rates))
    assert ("a middle length" in res["prefill_peak_sentence"]) == (0 < peak < len(rates) - 1)
    assert res["prefill_peak_sentence"].count(f"L = {prefill[-1]['prompt_len']}") == 1
    cheaper = decode[-1]["batch"] / decode[-1]["ms"] > decode[0]["batch"] / decode[0]["ms"]
    assert res["decode_range_word"] == ("cheaper" if cheaper else "no cheaper")
    # the intensity bullet: growth over the decode rows, and the formula B (W + k) / (W + B k) it quotes
    first, last, w = decode[0], decode[-1], res["weights_mib"]
    k = first["kv_mib"] / first["batch"]  # one sequence's KV MiB
    assert res["decode_intensity_growth"] == pytest.approx(last["intensity"] / first["intensity"])
    assert res["decode_batch_growth"] == last["batch"] / first["batch"]
    assert res["kv_share_per_seq"] == pytest.approx(k / w) and res["kv_equals_weights_batch"] == pytest.approx(w / k)
    b = last["batch"] / first["batch"]
    assert res["decode_intensity_growth"] == pytest.approx(b * (w + first["batch"] * k) / (w + last["batch"] * k),
                                                           rel=1e-6)
    # the old sentence, "rises roughly in proportion to B", is wrong once B k is not small next to W
    assert res["decode_intensity_growth"] < b
    # "a long prefill is compute-bound from L = ... on": every length from there on is above the ridge
    ridge, lengths = res["ridge_flops_per_byte"], [r["prompt_len"] for r in prefill]
    above = [r["intensity"] > ridge for r in prefill]
    if any(above):
        first = above.index(True)
        assert all(above[first:]), above
        assert res["prefill_compute_bound_from"] == f"from L = {lengths[first]} tokens on"
    else:
        assert res["prefill_compute_bound_from"].startswith("at none of the lengths measured")
    # "B = ... sequences raised that to ... FLOPs per byte, <decode_last_vs_ridge>": the largest batch's side
    below = decode[-1]["intensity"] <= ridge
    assert res["decode_last_vs_ridge"] == ("below the ridge: memory-bound" if below else
                                           "above the ridge: compute-bound")


def test_static_won_names_the_rows_where_static_batching_did_better(smoke_cache):
    """The lesson quotes static_won, the metrics static batching won: recomputed from the printed comparison's
    values and every run's values, with the direction of each metric written here (throughputs higher, latencies
    lower is better): a win needs every static run to beat every continuous one."""
    proc = smoke_run(smoke_cache, CH08 / "batching_bench.py")
    assert proc["code"] == 0, proc["stderr"]
    res = proc["json"]["results"]
    higher = {"request throughput (req/s)": "request_throughput", "output throughput (tok/s)": "output_throughput"}
    lower = {"median TTFT (ms)": "median_ttft_ms", "p99 TTFT (ms)": "p99_ttft_ms", "mean TPOT (ms)": "mean_tpot_ms",
             "median ITL (ms)": "median_itl_ms", "p99 ITL (ms)": "p99_itl_ms"}
    rows = {r["label"]: (r["static"], r["continuous"]) for r in res["rows"]}
    assert set(higher) | set(lower) <= set(rows)
    printed = {label: (f"{s:.2f}", f"{c:.2f}") for label, (s, c) in rows.items()}  # the table's 2 decimals
    runs = {mode: res[mode]["runs"] for mode in ("static", "continuous")}

    def every_run_beats(label: str) -> bool:
        key = higher.get(label) or lower[label]
        sv, cv = ([r[key] for r in runs[m]] for m in ("static", "continuous"))
        return min(sv) > max(cv) if label in higher else max(sv) < min(cv)

    won = [label for label in rows if label in higher or label in lower
           if printed[label][0] != printed[label][1] and every_run_beats(label)]
    assert res["static_won"] == (", ".join(won) or "none")


@pytest.mark.parametrize("static_runs, continuous_runs, expect", [
    ([1221.3, 820.0, 780.0], [1042.8, 1000.0, 990.0], "within noise"),  # a reader's 0.85x: the runs overlap
    ([1000.0, 990.0, 950.0], [1310.0, 1300.0, 1200.0], "continuous"),  # every continuous run above every static
    ([1000.0, 990.0, 950.0], [940.0, 900.0, 930.0], "static"),
    ([1000.0, 990.0, 950.0], [1310.0, 1300.0, 990.0], "within noise"),  # one continuous run at the static top
])
def test_better_column_needs_every_run_to_win(static_runs, continuous_runs, expect):
    """A reader's run printed "static" in the better column of both throughput rows, and 0.85x, under load; a
    rerun gave 1.83x. Rule written here: a scheduler is better only when every one of its runs beat every run of
    the other; otherwise the row is within noise, and the throughput sentence says so. The values shown are each
    scheduler's first run (its fastest)."""
    bb = load_script(CH08 / "batching_bench.py")
    results = _bench_results({"output_throughput": static_runs[0]}, {"output_throughput": continuous_runs[0]})
    base = {key: 10.0 for key, _, better in bb.ROWS if better}
    runs = {"static": [{**base, "output_throughput": v} for v in static_runs],
            "continuous": [{**base, "output_throughput": v} for v in continuous_runs]}
    rows = bb.comparison(results, runs)
    row = next(r for r in rows if r["metric"] == "output_throughput")
    if min(continuous_runs) > max(static_runs):
        want = "continuous"
    elif min(static_runs) > max(continuous_runs):
        want = "static"
    else:
        want = "within noise"
    assert row["better"] == want == expect
    sentence, short = bb.throughput_sentence(rows, runs)
    assert sentence.startswith(f"continuous batching's output throughput was "
                               f"{continuous_runs[0] / static_runs[0]:.2f}× the static one")
    if want == "within noise":
        assert "within noise" in sentence and "within noise" in short
        assert "higher" not in sentence + short and "lower" not in sentence + short
    else:
        word = "higher" if want == "continuous" else "lower"
        assert f"{word} in every run" in sentence and short == f"{word} throughput in every run"
    assert bb.win_counts(rows)["static_wins"] == (want == "static")


def _bench_results(static: dict, continuous: dict, durations=(2.89, 2.81)) -> dict:
    """Hand-made results of the two schedulers: every scored metric at 10.0 unless given, plus the run durations."""
    keys = [key for key, _, better in load_script(CH08 / "batching_bench.py").ROWS if better]
    return {mode: {"summary": {**dict.fromkeys(keys, 10.0), **given}, "duration": d, "num_steps": 100,
                   "mean_seqs_per_step": 2.0}
            for mode, given, d in (("static", static, durations[0]), ("continuous", continuous, durations[1]))}


def test_rows_equal_as_printed_are_ties_not_wins():
    """A reader's run printed "mean TPOT (ms) 1.1 1.1 continuous": values that print the same are a tie, and a
    tie is nobody's win (static_won, continuous_wins). Hand-made rows, one of each kind."""
    bb = load_script(CH08 / "batching_bench.py")
    results = _bench_results({"mean_tpot_ms": 1.1317, "median_itl_ms": 0.947, "p99_ttft_ms": 218.8,
                              "output_throughput": 1432.3},
                             {"mean_tpot_ms": 1.1291, "median_itl_ms": 0.968, "p99_ttft_ms": 5.19,
                              "output_throughput": 1473.9})
    rows = {r["metric"]: r for r in bb.comparison(results)}
    assert rows["mean_tpot_ms"]["better"] == "tie"  # 1.13 and 1.13 as printed
    assert rows["median_itl_ms"]["better"] == "static"  # 0.95 < 0.97
    assert rows["p99_ttft_ms"]["better"] == "continuous"
    assert rows["output_throughput"]["better"] == "continuous"  # higher is better
    assert rows["num_steps"]["better"] == "-"  # listed, not scored
    ties = [r["label"] for r in rows.values() if r["better"] == "tie"]  # the untouched 10.0 rows and TPOT
    counts = bb.win_counts(list(rows.values()))
    assert counts == {"continuous_wins": 2, "static_wins": 1, "static_won": "median ITL (ms)",
                      "ties": ", ".join(ties), "noise": "none",
                      "static_won_sentence": "static batching won 1 of the 7 rows the script scores: the median "
                                             "ITL row"}
    assert "mean TPOT (ms)" in counts["ties"]


def test_wait_verdict_follows_the_p99_ttft_row_and_the_durations():
    """The lesson's sentence on the Poisson run: a static p99 TTFT far above the continuous one with durations
    within 10% (the captured run: 219 vs 5 ms, 2.89 vs 2.81 s) must not claim a growing queue; a static run that
    lasts much longer does fall behind; a flipped TTFT row says so."""
    bb = load_script(CH08 / "batching_bench.py")
    close = bb.wait_verdict(_bench_results({"p99_ttft_ms": 218.8}, {"p99_ttft_ms": 5.19}))
    assert close.startswith("the p99 TTFT row shows static batching making arrivals wait (42.2×")
    assert "within about 3% of each other" in close and "neither server fell far behind" in close
    behind = bb.wait_verdict(_bench_results({"p99_ttft_ms": 900.0}, {"p99_ttft_ms": 5.0}, durations=(4.2, 2.8)))
    assert "lasted 1.50× as long as the continuous one: it fell behind" in behind
    flipped = bb.wait_verdict(_bench_results({"p99_ttft_ms": 4.0}, {"p99_ttft_ms": 5.0}))
    assert flipped.startswith("the p99 TTFT row is lower under static batching")
    assert "making arrivals wait" not in flipped
    tie = bb.wait_verdict(_bench_results({"p99_ttft_ms": 5.001}, {"p99_ttft_ms": 5.0}))
    assert tie.startswith("the p99 TTFT row is a tie")
    noise = bb.wait_verdict(_bench_results({"p99_ttft_ms": 9.0}, {"p99_ttft_ms": 5.0}), better="within noise")
    assert noise.startswith("the p99 TTFT row is within noise") and "making arrivals wait" not in noise


@pytest.mark.parametrize("static_med, cont_med, p99", [
    (45.4, 3.6, 370.9),  # a reader's run: far below its own p99, yet 12.6x the continuous median
    (5.36, 4.1, 131.0),  # a quiet machine: about as soon as continuous
    (438.6, 6.0, 1151.3),  # a busy one
    (7.9, 4.0, 60.0), (8.1, 4.0, 60.0),  # either side of twice the continuous median
])
def test_median_verdict_compares_the_static_median_with_the_continuous_one(static_med, cont_med, p99):
    """The Poisson paragraph's sentence on the static median TTFT. Rule written here: the continuous median is
    the first-token time of an arrival that did not wait for a batch to drain, so a static median at least twice
    it means at least half the arrivals waited; below that, at least half got their first token within twice it.
    Comparing the median with its own p99 (an older rule) said "most arrivals did not wait" for a reader's
    45.4 ms median against a continuous 3.6 ms, the opposite of what the numbers show."""
    bb = load_script(CH08 / "batching_bench.py")
    text = bb.median_verdict(_bench_results({"median_ttft_ms": static_med, "p99_ttft_ms": p99},
                                            {"median_ttft_ms": cont_med}))
    waited = static_med / cont_med >= 2
    assert text.startswith(f"static batching's median TTFT ({static_med:.1f} ms) is ")
    assert f"({cont_med:.1f} ms)" in text and f"{p99:.1f} ms" in text
    if waited:
        assert f"is {static_med / cont_med:.1f}× the continuous one" in text
        assert "at least half the arrivals waited behind a running batch" in text
        assert "not only the tail" not in text  # a reader found the old clause hard to parse
    else:
        assert "is under 2× the continuous one" in text
        assert "at least half the arrivals got their first token within 2× the continuous median" in text
        assert "waited behind" not in text
    assert "did not wait" not in text and "idle" not in text and "sequences per step" not in text


def test_each_verdict_weighs_only_its_own_pair():
    """The engine against the plain loop is judged by those two implementations' runs alone: transformers' noisy
    runs (a median 37% above its best) must not blur a clear 0.70x. Hand-made timings from a reader's run:
    engine best 0.504 s, median 0.59 s; plain loop 0.353 s, 0.36 s."""
    vt = load_script(CH08 / "vs_transformers.py")
    times = {"transformers generate": {"best_s": 0.40, "median_s": 0.548},
             "mlsys.model.generate": {"best_s": 0.353, "median_s": 0.36},
             "mlsys.engine": {"best_s": 0.504, "median_s": 0.59}}
    ratio, spread, verdict = vt.pair_verdict(times, "mlsys.model.generate")
    assert verdict == "the engine is slower: the other's median run beat the engine's best run"
    assert ratio == pytest.approx(0.353 / 0.504) and spread == pytest.approx(0.59 / 0.504 - 1)
    # against transformers the runs overlap (0.504 < 0.548) and the best runs are 0.79x apart: undecided
    ratio, spread, verdict = vt.pair_verdict(times, "transformers generate")
    assert spread == pytest.approx(0.548 / 0.40 - 1)
    assert verdict.startswith("undecided")


@pytest.mark.parametrize("engine, other", [
    ((0.3849, 0.4282), (0.1534, 0.2726)),  # a reader's Llama run: 0.40x, once called "about equal"
    ((0.2096, 0.2636), (0.4198, 0.50)),  # a reader's 2.00x: the runs do not overlap, so "faster" is measured
    ((0.30, 0.50), (0.163, 0.40)),  # 0.54x with overlapping runs: undecided, not "about equal"
    ((0.150, 0.160), (0.145, 0.158)),  # 0.97x, overlapping: about equal
    ((0.159, 0.172), (0.139, 0.149)),  # 0.87x, the engine's fastest run slower than the loop's median: slower
    ((0.100, 0.140), (0.108, 0.112)),  # 1.08x, overlapping: about equal
])
def test_vs_transformers_verdict_is_about_equal_only_near_one_and_within_the_spread(engine, other):
    """Rule written here: one implementation is faster only when its median run beat the other's best run (their
    typical runs do not overlap); overlapping runs are "about equal" when the best runs lie within 10% of each
    other, and undecided otherwise. The old rule (|ratio - 1| <= spread) called a reader's 0.40x "about equal"."""
    vt = load_script(CH08 / "vs_transformers.py")
    times = {"mlsys.engine": {"best_s": engine[0], "median_s": engine[1], "repeats": 5},
             "other": {"best_s": other[0], "median_s": other[1], "repeats": 5}}
    ratio, _, verdict = vt.pair_verdict(times, "other")
    assert ratio == pytest.approx(other[0] / engine[0])
    if engine[1] < other[0]:
        assert verdict == "the engine is faster: its median run beat the other's best run"
    elif other[1] < engine[0]:
        assert verdict == "the engine is slower: the other's median run beat the engine's best run"
    elif abs(ratio - 1) <= 0.10:
        assert verdict.startswith("about equal")
    else:
        assert verdict.startswith("undecided")
    if verdict.startswith("about equal"):
        assert 0.9 <= ratio <= 1.1


def test_the_lesson_lists_every_verdict_vs_transformers_can_print():
    """The lesson's sentence on the verdicts (from "Each ratio's verdict reads only" to "This run:") must name in
    backticks exactly the heads (the part before the colon) of the strings `compare` returns. Timings are built
    here for each case of the rule: medians that do not overlap the other's best (either way), overlapping runs
    with best runs 5% and 30% apart, and too few runs."""
    vt = load_script(CH08 / "vs_transformers.py")
    cases = [({"best_s": 1.0, "median_s": 1.1}, {"best_s": 1.5, "median_s": 1.6}, 5),  # engine faster
             ({"best_s": 1.5, "median_s": 1.6}, {"best_s": 1.0, "median_s": 1.1}, 5),  # engine slower
             ({"best_s": 1.0, "median_s": 1.5}, {"best_s": 1.05, "median_s": 1.5}, 5),  # overlap, 5% apart
             ({"best_s": 1.0, "median_s": 2.0}, {"best_s": 1.3, "median_s": 2.0}, 5),  # overlap, 30% apart
             ({"best_s": 1.0, "median_s": 1.1}, {"best_s": 1.5, "median_s": 1.6}, 2)]  # two runs each
    printed = {vt.compare(engine, other, repeats) for engine, other, repeats in cases}
    assert len(printed) == len(cases)  # every case reached a different branch
    lesson = (CH08.parent / "README.md").read_text(encoding="utf-8")
    sentence = lesson.split("Each ratio's verdict reads only", 1)[1].split("This run:", 1)[0]
    listed = set(sentence.split("`")[1::2]) - {"--reps"}
    assert listed == {verdict.split(":")[0] for verdict in printed}


def test_vs_transformers_runs_the_implementations_in_rounds():
    """A slow spell of the machine must hit all three implementations, not the one that happened to be running:
    one warm-up round, then every round runs each implementation once, in the same order."""
    vt = load_script(CH08 / "vs_transformers.py")
    calls = []
    runs = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times = vt.interleaved(runs, 4)
    assert calls == ["a", "b", "c"] * 5
    assert set(times) == {"a", "b", "c"} and all(t["repeats"] == 4 for t in times.values())
    assert all(t["best_s"] <= t["median_s"] for t in times.values())
