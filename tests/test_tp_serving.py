"""Tensor-parallel serving (mlsys/engine/tp.py): N real ranks over gloo, each with 1/N of every layer and of the
KV heads, must give the tokens of one process.

Oracles: the TP=1 engine, and transformers' own greedy generate on the same Llama / Qwen2 weights (random init,
saved with save_pretrained, nothing downloaded); the bytes of each rank's KV pool against the heads it holds.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest
import torch

from mlsys.engine import LLM, Engine, EngineConfig, SamplingParams
from mlsys.engine.tp import WorkerDied, check_tp, shard_model
from mlsys.server import ServerThread, create_app

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]
PROMPTS = ['{"name": "ada", ', '{"name": "linus", "age": 2', 'x']


@pytest.fixture(scope="class")
def tp2(small_model):
    """One TP=2 engine on the book's GPT, for the tests of one class (starting ranks costs a second). A process
    holds one tensor-parallel engine at a time (its ranks are this process's one process group), so the engine
    lives as long as that class's tests run, and no longer."""
    eng = Engine(small_model, config=EngineConfig(tensor_parallel_size=2))
    yield eng
    eng.close()


class TestOneTP2Engine:
    def test_tp_engine_equals_one_process_on_the_book_gpt(self, small_model, tp2):
        """N = 2 here; N = 4 runs on Llama below (and in tp_serving.py's smoke run)."""
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        want = Engine(small_model).generate(PROMPTS, params)
        one = Engine(small_model).stats()["kv_cache_bytes"]
        got = tp2.generate(PROMPTS, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert tp2.stats()["kv_cache_bytes"] * 2 == one  # each rank: half of the heads' K and V
        sampled = tp2.generate(PROMPTS[:1], SamplingParams(max_tokens=20, temperature=1.0, seed=3, n=2))
        alone = [Engine(small_model).generate(PROMPTS[:1], SamplingParams(max_tokens=20, temperature=1.0, seed=s))[0]
                 for s in (3, 4)]
        assert [o.token_ids for o in sampled] == [o.token_ids for o in alone]

    def test_tp_server_streams_the_one_process_answer(self, small_model, tp2):
        want = Engine(small_model).generate(PROMPTS[:1], SamplingParams(max_tokens=16))[0].text
        with ServerThread(create_app(tp2)) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            ask = dict(model="mlsys-small", prompt=PROMPTS[0], max_tokens=16, temperature=0)
            plain = client.completions.create(**ask).choices[0].text
            streamed = "".join(c.choices[0].text for c in client.completions.create(**ask, stream=True) if c.choices)
        assert plain == streamed == want


def build_llama(folder, kind: str, kv_heads: int):
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=kv_heads, max_position_embeddings=128, tie_word_embeddings=False)
    if kind == "qwen2":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg)).eval()
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(folder)
    hf.generation_config.eos_token_id = None
    return hf


@pytest.mark.parametrize("kind, kv_heads, size", [("llama", 2, 2), ("llama", 2, 4), ("qwen2", 1, 2)],
                         ids=["llama-kv-split", "llama-kv-replicated", "qwen2-mqa-bias"])
def test_tp_llm_equals_transformers_on_gqa_checkpoints(tmp_path, kind, kv_heads, size):
    """K/V heads split over the ranks (2 over 2), replicated (2 heads, 4 ranks: each holds the one its query heads
    read), and one K/V head with qkv bias (Qwen2): greedy tokens equal transformers.generate."""
    hf = build_llama(tmp_path, kind, kv_heads)
    ids = [[1, 5, 9, 13, 2, 7], [3, 3, 8]]
    llm = LLM(model=str(tmp_path), tensor_parallel_size=size)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(max_tokens=12, ignore_eos=True))
        for p, out in zip(ids, outs):
            want = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
            assert out.outputs[0].token_ids == want
        model = llm.engine.model
        assert model.config.n_kv_head == max(1, kv_heads // size) and model.config.n_head == 4 // size
    finally:
        llm.engine.close()


def test_sharding_rules():
    from mlsys.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32)
    model = Llama(cfg)
    check_tp(cfg, 8)  # 2 K/V heads, 8 ranks: each K/V head on 4 ranks
    with pytest.raises(ValueError, match="must divide the 8 attention heads"):
        check_tp(cfg, 3)
    with pytest.raises(ValueError, match=r"must divide the MLP width \(75\)"):   # the review's case: 75 // 2
        check_tp(LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=75, num_hidden_layers=1,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32), 2)
    check_tp(LlamaConfig(vocab_size=33, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32), 2)  # odd vocab: ok
    with pytest.raises(ValueError, match="key/value heads"):
        check_tp(LlamaConfig(vocab_size=32, hidden_size=96, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=32), 2)
    for rank in range(4):  # the K/V head a rank keeps is the one its query heads read
        block = shard_model(model, rank, 4).blocks[0]
        a = model.blocks[0].self_attn
        D, kv = 8, (rank * 2) // 4  # ranks 0, 1 read K/V head 0; ranks 2, 3 head 1
        assert torch.equal(block.wk, a.k_proj.weight[kv * D : (kv + 1) * D])
        assert torch.equal(block.wq, a.q_proj.weight[rank * 2 * D : (rank + 1) * 2 * D])


def test_a_dead_worker_ends_the_engine_with_its_name_and_leaves_no_process(small_model):
    eng = Engine(small_model, config=EngineConfig(tensor_parallel_size=2))
    pids = [p.pid for p in eng.runner.group.procs]
    try:
        app = create_app(eng)
        with ServerThread(app) as server:
            assert httpx.post(f"{server.url}/v1/completions", json={"model": "mlsys-small", "prompt": "{",
                                                                    "max_tokens": 4}, timeout=30).status_code == 200
            os.kill(pids[0], signal.SIGKILL)
            r = httpx.post(f"{server.url}/v1/completions", json={"model": "mlsys-small", "prompt": "{",
                                                                 "max_tokens": 4}, timeout=30)
            assert r.status_code in (500, 503)
            front = app.state.async_engine
            deadline = time.monotonic() + 10
            while front.dead is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert isinstance(front.dead, WorkerDied) and "rank 1" in str(front.dead)
            assert "SIGKILL" in str(front.dead)
            r = httpx.post(f"{server.url}/v1/completions", json={"model": "mlsys-small", "prompt": "{",
                                                                 "max_tokens": 4}, timeout=30)
            assert r.status_code == 503  # refused at once from now on
    finally:
        eng.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture(scope="module")
def tp_serving_smoke(tmp_path_factory):
    """One `tp_serving.py --smoke` run (TP 1 and 2, batch 4): its JSON results and its figure folder."""
    from conftest import run_json, scripts_dir

    plots = tmp_path_factory.mktemp("tp_serving_figures")
    return run_json(tmp_path_factory, scripts_dir(10) / "tp_serving.py", "--smoke", "--plot-dir", plots), plots


def test_tp_profile_counts_the_bytes_each_step_reduces(tp_serving_smoke):
    """tp_serving.py --smoke (batch 4): two all-reduces per layer of the 4 layers, each of 4 tokens x 128 floats:
    8 calls and 8 * 4 * 128 * 4 = 16384 bytes per decode step (worked out by hand), and half the KV per rank."""
    r, _ = tp_serving_smoke
    one, two = r["runs"]
    assert (one["tp"], two["tp"]) == (1, 2)
    assert two["all_reduces_per_step"] == 8 and two["bytes_per_step"] == 16384
    assert one["bytes_per_step"] == 0 and two["kv_bytes_per_rank"] * 2 == one["kv_bytes_per_rank"]


def test_tp_shards_picture_is_the_real_shards(tp_serving_smoke, small_model):
    """tp_shards.png's data (JSON "shards", TP=2 in the smoke run) against shard_model's own slices of layer 0: each
    rank's tile has the shape of its real weight (q, k, v and the MLP's up projection cut by rows of (out, in), the two
    output projections by columns), the tiles follow each other rank by rank and cover the dense weight, and the dense
    weight at a rank's tile is that rank's weight."""
    r, plots = tp_serving_smoke
    shards, dense = r["shards"], small_model.blocks[0]
    C = small_model.config.n_embd
    full = {"q": dense.attn.c_attn.weight[:C], "k": dense.attn.c_attn.weight[C : 2 * C],
            "v": dense.attn.c_attn.weight[2 * C :], "attn out": dense.attn.c_proj.weight,
            "MLP up": dense.mlp.c_fc.weight, "MLP down": dense.mlp.c_proj.weight}
    assert list(shards) == list(full) and (plots / "tp_shards.png").exists()
    for rank in range(2):
        b = shard_model(small_model, rank, 2).blocks[0]
        for name, w in zip(full, (b.wq, b.wk, b.wv, b.wo, b.up[0].weight, b.down.weight)):
            m = shards[name]
            assert m["shape"] == list(full[name].shape)
            cols = name in ("attn out", "MLP down")
            assert m["split"] == ("columns" if cols else "rows")
            n = w.shape[1] if cols else w.shape[0]
            assert m["ranks"][rank] == [rank * n, (rank + 1) * n]
            assert m["ranks"][-1][1] == full[name].shape[1 if cols else 0]
            lo, hi = m["ranks"][rank]
            assert torch.equal(full[name][:, lo:hi] if cols else full[name][lo:hi], w)


def test_tp_step_picture_shows_two_all_reduces_per_layer(tp_serving_smoke, small_model):
    """The traced decode step's picture against the model's definition and gloo's own events in the trace file. Oracle
    1: the dense model's row-parallel projections, counted by name (each block's attn.c_proj and mlp.c_proj:
    under TP each ends in one all-reduce), in module order: the drawn all-reduces are one per projection,
    labelled L0 attn, L0 MLP, L1 attn, ... Oracle 2: the trace's gloo:all_reduce events inside the drawn step,
    the fastest of those traced (recorded by gloo, not by the script): as many, each of (batch, hidden) floats,
    and each starting inside one drawn all-reduce box."""
    import json

    r, plots = tp_serving_smoke
    pic = r["traced_step"]
    projections = [name for name, m in small_model.named_modules()
                   if isinstance(m, torch.nn.Linear) and name.endswith("c_proj")]
    assert len(projections) == 2 * small_model.config.n_layer
    want = [f"L{name.split('.')[1]} {'attn' if '.attn.' in name else 'MLP'}" for name in projections]
    drawn = [s for s in pic["spans"] if s["kind"] == "all-reduce"]
    assert [s["label"] for s in drawn] == want and pic["all_reduces"] == len(want)

    events = json.loads((plots / "tp_step.trace.json").read_text())["traceEvents"]
    step = min((e for e in events if e.get("name") == "decode step"), key=lambda e: e["dur"])  # the one drawn
    inside = [e for e in events if e.get("name") == "gloo:all_reduce" and step["ts"] <= e["ts"] <= step["ts"]
              + step["dur"]]
    assert len(inside) == len(projections)
    assert all(e["args"]["Input Dims"] == [[4, small_model.config.n_embd]] for e in inside)  # batch 4 (smoke)
    starts_ms = [(e["ts"] - step["ts"]) / 1000 for e in inside]
    for box in drawn:
        assert sum(box["start"] - 1e-6 <= t <= box["end"] + 1e-6 for t in starts_ms) == 1, box
    assert 0 < pic["all_reduce_share"] <= pic["collective_share"] <= 1
    assert (plots / "tp_step.png").exists()


def union_us(intervals):
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def test_tp_step_sublayer_compute_from_the_raw_trace(tp_serving_smoke):
    """The line's "median compute per sublayer", recomputed from the trace file's own events, not from the drawn
    boxes: for each sublayer, the time on rank 0's thread from the start of its first labelled region ("layer i
    attention", "layer i MLP") to the end of its last, less the time inside a ReduceFromTP (the all-reduce,
    an interval union); then the median over the
    2 * layers sublayers. A median over the pieces the all-reduce cuts a sublayer into would land on the short
    tails after each all-reduce."""
    import json
    import statistics

    r, plots = tp_serving_smoke
    pic = r["traced_step"]
    events = [e for e in json.loads((plots / "tp_step.trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    step = min((e for e in events if e.get("name") == "decode step"), key=lambda e: e["dur"])
    inside = [e for e in events if e["tid"] == step["tid"] and step["ts"] <= e["ts"]
              and e["ts"] + e["dur"] <= step["ts"] + step["dur"]]
    reduces = [(e["ts"], e["ts"] + e["dur"]) for e in inside if e["name"] == "ReduceFromTP"]
    want = {}
    for name in sorted({e["name"] for e in inside if e["name"].startswith("layer ")}):
        regions = [(e["ts"], e["ts"] + e["dur"]) for e in inside if e["name"] == name]
        a, b = min(r[0] for r in regions), max(r[1] for r in regions)  # first to last region: the glue between
        cut = [(max(a, c), min(b, d)) for c, d in reduces if max(a, c) < min(b, d)]  # its ops counts as its own
        i, part = name.split()[1:]
        want[f"L{i} {'attn' if part == 'attention' else part}"] = (b - a - union_us(cut)) / 1000
    assert len(want) == 2 * 4  # the small GPT's 4 layers
    got = pic["sublayer_compute_ms"]
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=2e-3), k
    assert pic["median_sublayer_compute_ms"] == pytest.approx(statistics.median(want.values()), abs=2e-3)
    assert pic["collective_ms"] == pytest.approx(pic["all_reduce_ms"] + pic["broadcast_ms"])


def test_tp_on_cuda_needs_one_gpu_per_rank(small_model):
    """The NCCL path's settings are checked before any rank starts: rank r runs on cuda:r."""
    with pytest.raises(ValueError, match="one GPU per rank"):
        EngineConfig(tensor_parallel_size=max(2, torch.cuda.device_count() + 1), device="cuda").resolve(small_model)
    with pytest.raises(ValueError, match="'cpu' \\(gloo\\) or 'cuda'"):
        EngineConfig(tensor_parallel_size=2, device="cuda:1").resolve(small_model)
    with pytest.raises(ValueError, match="CUDA graphs"):
        EngineConfig(tensor_parallel_size=2, cuda_graph_sizes=[1]).resolve(small_model)


def test_moved_keeps_the_batch_and_its_structure(small_model):
    """What rank 0 broadcasts on NCCL: the step's ModelInput with every tensor moved (here to the meta device, so
    a tensor left behind shows), None, ints and the group structure kept."""
    from mlsys.engine.tp import moved

    eng = Engine(small_model)
    m = eng.runner.prepare([0, 0], [[1, 2, 3, 4, 5], [6, 7]], [[0], [1]], [True, True])
    got = moved(m, "meta")
    assert type(got) is type(m) and len(got.groups) == len(m.groups)
    pairs = [(got, m)] + list(zip(got.groups, m.groups))
    for new, old in pairs:
        for name, value in vars(old).items():
            if isinstance(value, torch.Tensor):
                t = getattr(new, name)
                assert t.is_meta and t.shape == value.shape and t.dtype == value.dtype, name
            elif name != "groups":
                assert getattr(new, name) == value, name
    assert moved(m, "cpu").input_ids.tolist() == m.input_ids.tolist()


def test_tp_serving_cuda_without_enough_gpus_is_a_usage_error():
    if torch.cuda.device_count() >= 4:
        pytest.skip("this machine has the 4 GPUs --device cuda asks for")
    from conftest import run, scripts_dir

    proc = run([scripts_dir(10) / "tp_serving.py", "--device", "cuda"], timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "--device cuda needs 4 GPUs" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL tensor parallelism needs a GPU per rank (2+)")
def test_tp_on_nccl_equals_one_gpu(small_model):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = Engine(small_model, config=EngineConfig(device="cuda")).generate(PROMPTS, params)
    eng = Engine(small_model, config=EngineConfig(tensor_parallel_size=2, device="cuda"))
    try:
        got = eng.generate(PROMPTS, params)
    finally:
        eng.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
