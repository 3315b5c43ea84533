"""Chapter 8 mechanisms against their oracles: the FLOP and byte formulas of a step (torch's flop counter, the
sizes of the real tensors), the serving metrics (numpy), the engine vs transformers on a batch, the benchmark
loop for both schedulers, and the traced request."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import ROOT, load_script
from mlsys.engine import Engine, EngineConfig
from mlsys.model import GPT, GPTConfig
from mlsys.server import format_summary, request_latencies, serving_summary
from mlsys.weights import load_pretrained

CH08 = ROOT / "tutorial" / "part3-inference" / "chapter08-server-anatomy" / "scripts"


@pytest.fixture(scope="module")
def small():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_pretrained("small")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pvd():
    return load_script(CH08 / "prefill_vs_decode.py")


# --------------------------------------------------------------------------------------- FLOPs and bytes
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_step_flops_equal_torch_flop_counter(pvd, preset):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset)).eval()
    pvd.check_flop_formula(model)  # raises SelfCheckFailed on a mismatch
    cfg = model.config
    # a mixed step the way the engine runs it: only the last row of each sequence reaches the head
    assert pvd.step_flops(cfg, [5, 1, 1], [5, 9, 30], 3) == (
        2 * 12 * cfg.n_layer * cfg.n_embd**2 * 7 + 4 * cfg.n_layer * cfg.n_embd * (25 + 9 + 30)
        + 2 * cfg.n_embd * cfg.vocab_size * 3)  # fmt: skip


def test_about_two_flops_per_parameter_per_token(pvd, small):
    cfg = small.config
    linear_weights = sum(m.weight.numel() for m in small.h.modules() if isinstance(m, torch.nn.Linear))
    per_token = pvd.step_flops(cfg, [1], [0], 0)  # one token, no attention, no head
    assert per_token == 2 * linear_weights
    total = sum(p.numel() for p in small.parameters())
    assert 0.9 < per_token / (2 * total) < 1.0  # the rest of the parameters are embeddings, biases, norms


def test_step_bytes_equal_the_sizes_of_the_real_tensors(pvd, small):
    cfg, n_params = small.config, sum(p.numel() for p in small.parameters())
    weights = sum(p.numel() * p.element_size() for p in small.parameters())
    for batch, ctx in [(1, 10), (4, 64), (16, 200)]:
        cache = small.new_kv_cache(batch, ctx + 1)  # a decode step reads ctx positions and writes one
        kv_read = sum(c.k[:, :, :ctx].nbytes + c.v[:, :, :ctx].nbytes for c in cache)
        kv_write = sum(c.k[:, :, :1].nbytes + c.v[:, :, :1].nbytes for c in cache)
        assert pvd.step_bytes(n_params, cfg, [1] * batch, [ctx] * batch) == weights + kv_read + kv_write
    # decode intensity grows with the batch (weights shared), prefill intensity with the prompt
    ai = [pvd.step_flops(cfg, [1] * b, [65] * b, b) / pvd.step_bytes(n_params, cfg, [1] * b, [65] * b)
          for b in (1, 8, 64)]  # fmt: skip
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
            for r in reqs if len(r["token_times"]) > 1]  # fmt: skip
    ttft = [(r["token_times"][0] - r["arrival"]) * 1e3 for r in reqs]
    assert s["p99_itl_ms"] == pytest.approx(np.percentile(itl, 99)) and s["mean_itl_ms"] == pytest.approx(itl.mean())
    assert s["median_tpot_ms"] == pytest.approx(np.median(tpot)) and s["p99_ttft_ms"] == pytest.approx(
        np.percentile(ttft, 99))  # fmt: skip
    n_out = sum(len(r["token_times"]) for r in reqs)
    assert s["output_throughput"] == pytest.approx(n_out / 2.0) and s["request_throughput"] == 25.0
    assert s["total_input_tokens"] == sum(5 + i for i in range(50))
    text = format_summary(s)
    for label in ("Successful requests:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Median TTFT (ms):", "P99 TPOT (ms):", "Mean ITL (ms):"):  # fmt: skip
        assert label in text
    assert text.splitlines()[0].startswith("=") and len(text.splitlines()[0]) == 50


# ------------------------------------------------------------------------------------------- the oracles
def test_engine_batch_equals_transformers_generate(small):
    vt = load_script(CH08 / "vs_transformers.py")
    from mlsys.data import Tokenizer, make_corpus
    from mlsys.model import to_hf_model

    tok = Tokenizer()
    prompts = torch.tensor([tok.encode(line[:12], bos=True) for line in make_corpus(6, seed=5).splitlines()])
    ours = vt.engine_greedy(Engine(small, config=EngineConfig(max_num_seqs=6)), prompts, 40)
    theirs = vt.hf_greedy(to_hf_model(small), prompts, 40)
    assert ours.shape == (6, 40) and torch.equal(ours, theirs)


def test_both_schedulers_serve_the_workload_and_continuous_needs_fewer_steps(small):
    bb = load_script(CH08 / "batching_bench.py")
    args = bb.Settings(num_requests=12, request_rate=math.inf, prompt_max=20, short_max=6, long_min=40,
                       long_max=48, long_fraction=0.25, max_num_seqs=4)  # fmt: skip
    work = bb.make_workload(args)
    assert work == bb.make_workload(args)  # seeded
    assert all(w.arrival == 0 for w in work) and sum(w.max_tokens >= 40 for w in work) >= 1
    runs = {mode: bb.run_mode(small, mode, work, args) for mode in ("static", "continuous")}  # self-checks inside
    for mode, r in runs.items():
        assert r["summary"]["completed"] == 12 and r["summary"]["total_output_tokens"] == sum(w.max_tokens for w in work)
    assert runs["continuous"]["num_steps"] < runs["static"]["num_steps"]
    assert runs["continuous"]["mean_seqs_per_step"] > runs["static"]["mean_seqs_per_step"]
    for w in work:  # greedy: which scheduler ran it does not change the tokens
        assert runs["static"]["finals"][w.request_id].token_ids == runs["continuous"]["finals"][w.request_id].token_ids
    poisson = bb.make_workload(bb.Settings(num_requests=2000, request_rate=50.0))
    gaps = np.diff([0.0] + [w.arrival for w in poisson])
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.1) and gaps.std() == pytest.approx(1 / 50, rel=0.15)


def test_traced_request_stages(small):
    rl = load_script(CH08 / "request_lifecycle.py")
    from mlsys.engine import SamplingParams

    engine = Engine(small)
    tr = rl.trace_request(engine, '{"name": "ken", ', SamplingParams(max_tokens=10, ignore_eos=True))
    kinds = [s["kind"] for s in tr["steps"]]
    assert kinds == ["prefill"] + ["decode"] * 9 and tr["steps"][0]["tokens"] == 17  # <bos> + 16 characters
    assert all(s["tokens"] == 1 for s in tr["steps"][1:])
    assert "".join(s["new_text"] for s in tr["steps"]) == tr["final"].text
    assert all(c.startswith(b"data: {") and c.endswith(b"\n\n") for c in tr["chunks"])
    rows = rl.stage_table(tr)
    assert sum(r["share_%"] for r in rows) == pytest.approx(100)
    assert sum(r["calls"] for r in rows if r["stage"] == "decode: forward") == 9
