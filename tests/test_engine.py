"""The inference engine (mlsys.engine) against its oracles.

    PYTHONPATH=. .venv/bin/python -m pytest tests/test_engine.py -q     # ~15 s on 2 cores

Oracles: mlsys.model.generate (one prompt at a time, contiguous cache) and
Hugging Face GPT2LMHeadModel.generate with the same weights for greedy output;
GPT.forward without a cache for paged attention; a cold engine for prefix-cache
hits; an unconstrained engine for preemption; mlsys.model.generate with a
seeded generator for sampling; log_softmax of a plain GPT forward over prompt +
output for the sampled tokens' log-probs. Block accounting is checked after every step.
"""

import json
import random

import pytest
import torch

from mlsys.data import Tokenizer, make_corpus
from mlsys.engine import (
    BlockManager,
    BlockPool,
    Engine,
    EngineConfig,
    ModelRunner,
    RadixCache,
    SamplingParams,
    Sequence,
)
from mlsys.model import GPT, GPTConfig, generate, to_hf_model

TOK = Tokenizer()
LINES = make_corpus(40, seed=11).splitlines()
# prompts of different lengths, cut anywhere inside a record (lengths 3..57 characters + <bos>)
PROMPTS = [LINES[i][: 3 + (i * 11) % 55] for i in range(8)]


# Ops on a 128-wide model are too small to split across cores; one thread keeps the many tiny steps here from
# stalling on thread hand-offs when the machine is busy.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def small(small_model):  # conftest's trained `small` GPT
    return small_model


@pytest.fixture(scope="module")
def tiny(tiny_model):  # conftest's random `tiny` GPT, seed 0
    return tiny_model


def run_all(engine: Engine, prompts, params, check=True):
    """Like engine.generate, but checks the invariants after every step."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if check:
            engine.check_invariants()
    return [final[i] for i in ids]


def greedy_reference(model, prompt: str, n: int) -> list[int]:
    ids = torch.tensor([TOK.encode(prompt, bos=True)])
    return generate(model, ids, n)[0, ids.size(1) :].tolist()


# ------------------------------------------------------------------ greedy oracles


N_GREEDY = 40


@pytest.fixture(scope="module")
def greedy_refs(small):
    """mlsys.model.generate, one prompt at a time with a contiguous cache."""
    return [greedy_reference(small, p, N_GREEDY) for p in PROMPTS]


@pytest.mark.parametrize("block_size, budget", [(4, 24), (16, 512)])  # 24: prompts of up to 58 get chunked
def test_batched_greedy_equals_one_at_a_time_generate(small, greedy_refs, block_size, budget):
    engine = Engine(small, config=EngineConfig(block_size=block_size, max_num_batched_tokens=budget))
    outs = run_all(engine, PROMPTS, SamplingParams(max_tokens=N_GREEDY, ignore_eos=True))
    for p, out, ref in zip(PROMPTS, outs, greedy_refs):
        assert out.token_ids == ref, p
        assert out.finish_reason == "length" and len(out.token_ids) == N_GREEDY
    s = engine.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"] and s["num_used_blocks"] == 0


def test_greedy_equals_hugging_face_generate(small):
    hf = to_hf_model(small)
    n = 30
    outs = Engine(small).generate(PROMPTS[:5], SamplingParams(max_tokens=n, ignore_eos=True))
    for p, out in zip(PROMPTS[:5], outs):
        ids = torch.tensor([TOK.encode(p, bos=True)])
        with torch.no_grad():
            hf_ids = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 pad_token_id=TOK.pad_id)[0, ids.size(1) :].tolist()
        # HF stops at <eos>; ours was told to ignore it: equal up to where HF stopped
        assert hf_ids == out.token_ids[: len(hf_ids)]
        assert len(hf_ids) == n or hf_ids[-1] == TOK.eos_id


# ------------------------------------------------------------------ paged attention


def test_paged_attention_equals_contiguous_forward(tiny):
    """Ragged steps (prefill, chunked prefill, decode mixed) through scattered blocks of 4
    give the logits of a plain full forward, at every position."""
    bs, gen = 4, torch.Generator().manual_seed(0)
    runner = ModelRunner(tiny, num_blocks=64, block_size=bs)
    lengths = [13, 9, 21]
    seqs = [torch.randint(3, TOK.vocab_size, (L,), generator=gen).tolist() for L in lengths]
    free = torch.randperm(64, generator=gen).tolist()  # non-contiguous physical blocks
    tables = [[free.pop() for _ in range(-(-L // bs))] for L in lengths]
    # step plan: (new tokens per sequence); sums to each length, mixing prefill and decode
    plan = [[5, 9, 1], [3, 0, 7], [1, 0, 6], [1, 0, 4]] + [[1, 0, 1]] * 3
    done = [0, 0, 0]
    got = [[] for _ in seqs]
    num_groups = []
    for chunk in plan:
        active = [i for i, n in enumerate(chunk) if n]
        m = runner.prepare([done[i] for i in active], [seqs[i][done[i] : done[i] + chunk[i]] for i in active],
                           [tables[i] for i in active], [True] * len(active))
        num_groups.append(len(m.groups))
        logits = runner.execute(m, all_logits=True)  # (N, V)
        for i, rows in zip(active, logits.split([chunk[i] for i in active])):
            got[i].append(rows)
            done[i] += chunk[i]
    assert done == lengths and set(num_groups) == {1, 2}  # both the one-rectangle and the bucketed path ran
    for seq, rows in zip(seqs, got):
        full, _ = tiny(torch.tensor([seq]))  # (1, L, V)
        torch.testing.assert_close(torch.cat(rows), full[0], atol=1e-5, rtol=0)


def test_split_by_shape_buckets_only_when_padding_dominates():
    split = ModelRunner.split_by_shape
    assert split([1] * 16, [4] * 16) == [list(range(16))]  # uniform decodes: one rectangle
    groups = split([1] * 13 + [1] * 3, [4] * 13 + [14] * 3)  # three long contexts among short ones
    assert sorted(map(sorted, groups)) == [list(range(13)), [13, 14, 15]]
    assert split([1] * 15 + [50], [4] * 16)[1] == [15]  # a prefill among decodes gets its own group
    assert split([1, 1], [3, 4]) == [[0, 1]]  # small savings are not worth a second launch


# ------------------------------------------------------------------ prefix cache


def test_radix_tree_split_match_and_lru_eviction():
    pool = BlockPool(num_blocks=8, block_size=2)
    tree = RadixCache(pool)
    a = [pool.allocate() for _ in range(3)]
    assert tree.insert([1, 2, 3, 4, 5, 6], a) == a
    assert tree.match_prefix([1, 2, 3, 4, 9, 9, 9]) == a[:2]  # partial: splits the edge after 2 blocks
    assert sorted(len(n.blocks) for n in tree._nodes()) == [1, 2]
    b = [a[0], a[1], pool.allocate()]
    for x in a[:2]:
        pool.incref(x)
    assert tree.insert([1, 2, 3, 4, 7, 7], b) == b  # a sibling of [5, 6] under the shared [1..4]
    assert tree.match_prefix([1, 2, 3]) == a[:1]  # only full blocks match
    tree.check_invariants()
    for x in a + b:
        pool.decref(x)  # all unreferenced now: 4 cached blocks, 4 free
    assert (pool.num_free, pool.num_used, pool.num_cached_unused) == (4, 0, 4)
    tree.match_prefix([1, 2, 3, 4, 7, 7])  # touch the [7, 7] branch: [5, 6] is least recent
    pool.incref(b[2])  # a running sequence reads the [7, 7] block: it must survive eviction
    assert tree.evict(1) == 1 and not pool.in_cache[a[2]] and pool.in_cache[b[2]]
    assert tree.evict(10) == 0  # [1..4] has an in-use child, [7, 7] is in use: nothing evictable
    pool.decref(b[2])
    assert tree.evict(10) == 3 and pool.num_free == 8
    tree.check_invariants()


def test_eviction_takes_the_unreferenced_tail_of_a_leaf():
    pool = BlockPool(num_blocks=4, block_size=2)
    tree = RadixCache(pool)
    a = [pool.allocate() for _ in range(3)]
    tree.insert([1, 2, 3, 4, 5, 6], a)  # one edge of 3 blocks
    pool.decref(a[1]), pool.decref(a[2])  # its holder keeps only the first block
    assert tree.evict(5) == 2 and pool.in_cache[a[0]] and pool.num_free == 3
    assert tree.match_prefix([1, 2, 3, 4]) == a[:1]
    tree.check_invariants()


def test_prefix_cache_full_and_partial_hits_match_cold_runs(small):
    cold = Engine(small, config=EngineConfig(block_size=4))
    warm = Engine(small, config=EngineConfig(block_size=4, enable_prefix_caching=True))
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    base = LINES[0][:31]  # 31 chars + <bos> = 32 tokens: a whole number of blocks
    other = base[:13] + "x" * 10  # shares the first 3 full blocks (12 tokens + <bos> = 13 > 12)
    prompts = [base, base, other]
    ref = cold.generate(prompts, sp)
    outs = [run_all(warm, [p], sp)[0] for p in prompts]
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    hits = [o.metrics.num_cached_prompt_tokens for o in outs]
    # a full hit keeps the last block to compute (logits for the first token; no write into a shared block)
    assert hits == [0, 28, 12]
    s = warm.stats()
    assert s["prefix_hit_tokens"] == 40 and s["num_used_blocks"] == 0 and s["num_cached_blocks"] > 0
    warm.check_invariants()


def test_prefix_cache_shares_blocks_between_running_requests(small):
    """Same prompt in one batch: once the first request's blocks are cached, later ones adopt them."""
    eng = Engine(small, config=EngineConfig(block_size=4, enable_prefix_caching=True, max_num_batched_tokens=40))
    prompt = LINES[3][:39]  # 40 tokens: the first request fills the budget alone
    outs = run_all(eng, [prompt] * 3, SamplingParams(max_tokens=8, ignore_eos=True))
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert outs[0].token_ids == greedy_reference(small, prompt, 8)
    assert [o.metrics.num_cached_prompt_tokens for o in outs] == [0, 36, 36]


# ------------------------------------------------------------------ preemption


def test_preemption_by_recompute_completes_every_request_identically(small):
    sp = SamplingParams(max_tokens=50, ignore_eos=True)
    prompts = PROMPTS[:6]
    ref = Engine(small).generate(prompts, sp)
    for caching in (False, True):
        # 26 blocks of 4 hold one 100-token sequence; six requests need ~2x that at their peak
        cfg = EngineConfig(block_size=4, num_blocks=26, max_model_len=100, enable_prefix_caching=caching)
        eng = Engine(small, config=cfg)
        outs = run_all(eng, prompts, sp)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        assert eng.stats()["num_preemptions"] > 0
        assert sum(o.metrics.num_preemptions for o in outs) == eng.stats()["num_preemptions"]


# ------------------------------------------------------------------ invariants


def test_randomized_workload_keeps_block_accounting(small):
    rng = random.Random(0)
    eng = Engine(small, config=EngineConfig(block_size=4, num_blocks=40, max_model_len=96, max_num_seqs=6,
                                            max_num_batched_tokens=48, enable_prefix_caching=True))
    pool = eng.block_manager.pool
    stems = [LINES[i][: rng.randint(5, 40)] for i in range(5)]  # shared stems -> prefix hits
    live, finished = set(), 0
    for _ in range(250):
        if rng.random() < 0.3:
            prompt = rng.choice(stems) + LINES[rng.randrange(40)][: rng.randint(0, 10)]
            sp = SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0.0, 1.0]),
                                top_k=rng.choice([None, 5]), seed=rng.randrange(100))
            live.add(eng.add_request(prompt, sp))
        if live and rng.random() < 0.03:
            eng.abort(rng.choice(sorted(live)))
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
                finished += 1
        eng.check_invariants()
        assert pool.num_free + pool.num_used + pool.num_cached_unused == pool.num_blocks
    while eng.has_unfinished():
        finished += sum(o.finished for o in eng.step())
        eng.check_invariants()
    s = eng.stats()
    assert finished > 40 and s["prefix_hit_tokens"] > 0 and s["num_preemptions"] > 0 and s["num_evicted_blocks"] > 0
    assert s["num_used_blocks"] == 0 and all(c == 0 for c in pool.ref_counts)
    eng.block_manager.prefix_cache.evict(pool.num_blocks)  # nothing in use: everything can go
    assert pool.num_free == pool.num_blocks


def test_block_manager_never_overcommits():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = Sequence("a", list(range(10)), SamplingParams())
    assert bm.allocate_slots(seq, 10) and len(seq.block_table) == 3 and bm.pool.num_free == 0
    other = Sequence("b", [1], SamplingParams())
    assert not bm.allocate_slots(other, 1) and other.block_table == []  # refused, nothing taken
    bm.free(seq)
    assert bm.pool.num_free == 3
    bm.check_invariants([])


# ------------------------------------------------------------------ sampling, streaming, API


def test_seeded_sampling_is_reproducible_regardless_of_batch(small):
    sp = SamplingParams(max_tokens=30, temperature=0.9, top_k=8, seed=123, ignore_eos=True)
    prompt = PROMPTS[2]
    alone = Engine(small).generate([prompt], sp)[0].token_ids
    others = [SamplingParams(max_tokens=m, temperature=1.0, seed=s) for m, s in ((5, 1), (40, None), (12, 7))]
    crowd = Engine(small, config=EngineConfig(block_size=4)).generate(
        [PROMPTS[0], prompt, PROMPTS[5], PROMPTS[1]], [others[0], sp, others[1], others[2]])
    assert crowd[1].token_ids == alone
    ids = torch.tensor([TOK.encode(prompt, bos=True)])
    ref = generate(small, ids, 30, 0.9, top_k=8, generator=torch.Generator().manual_seed(123))
    assert alone == ref[0, ids.size(1) :].tolist()


def test_streaming_text_stop_reasons_and_abort(small):
    eng = Engine(small, config=EngineConfig(block_size=8))
    rid = eng.add_request('{"name": "ada", ', SamplingParams(max_tokens=200), request_id="r0")
    stop_at = TOK.encode(",")[0]
    rid2 = eng.add_request('{"name": "ken", ', SamplingParams(max_tokens=100, stop_token_ids=(stop_at,)))
    rid3 = eng.add_request('{"name": "john", ', SamplingParams(max_tokens=100))
    pieces, final = {}, {}
    for step in range(1000):
        if step == 3:
            eng.abort(rid3)  # frees its blocks at once
            assert eng.block_manager.pool.num_used == sum(len(s.block_table) for s in eng.scheduler.running)
        if not eng.has_unfinished():
            break
        for out in eng.step():
            pieces[out.request_id] = pieces.get(out.request_id, "") + out.new_text
            if out.finished:
                final[out.request_id] = out
        eng.check_invariants()
    a, b, c = final[rid], final[rid2], final[rid3]
    assert a.finish_reason == "stop" and a.token_ids[-1] == TOK.eos_id  # a record ends with <eos>
    assert a.text == pieces[rid] == TOK.decode(a.token_ids) and '"city": "london"' in a.text
    assert b.finish_reason == "stop" and b.token_ids[-1] == stop_at and b.text.endswith(",")
    assert c.finish_reason == "abort" and c.finished
    m = a.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    assert len(m.token_times) == len(a.token_ids)


def test_static_batching_same_output_more_steps(small):
    sp = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (4, 40, 4, 4, 40, 4)]
    prompts = PROMPTS[:6]
    results = {}
    for mode in ("static", "continuous"):
        eng = Engine(small, config=EngineConfig(max_num_seqs=3, scheduling=mode))
        outs = run_all(eng, prompts, sp)
        results[mode] = ([o.token_ids for o in outs], eng.stats()["num_steps"])
    assert results["static"][0] == results["continuous"][0]
    # static: batch 1 (4, 40, 4) and batch 2 (4, 40, 4) each last 40 steps; continuous overlaps them
    assert results["static"][1] == 80 and results["continuous"][1] < 60


def test_load_weights_serves_the_new_model_and_drops_stale_prefixes(tiny):
    torch.manual_seed(1)
    other = GPT(GPTConfig.preset("tiny")).eval()
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    eng = Engine(tiny, config=EngineConfig(block_size=4, enable_prefix_caching=True))
    before = eng.generate([PROMPTS[4]], sp)[0].token_ids
    assert before == greedy_reference(tiny, PROMPTS[4], 10) and eng.stats()["num_cached_blocks"] > 0
    eng.load_weights(other.state_dict())
    assert eng.stats()["num_cached_blocks"] == 0  # K/V of the old weights must not be reused
    after = eng.generate([PROMPTS[4]], sp)[0]
    assert after.token_ids == greedy_reference(other, PROMPTS[4], 10)
    assert after.metrics.num_cached_prompt_tokens == 0
    eng.add_request("a")
    with pytest.raises(RuntimeError, match="in flight"):
        eng.load_weights(tiny.state_dict())


def test_bad_settings_and_prompts_are_rejected(small):
    with pytest.raises(ValueError, match="num_blocks"):
        Engine(small, config=EngineConfig(block_size=16, num_blocks=3))
    with pytest.raises(ValueError, match="max_model_len"):
        Engine(small, config=EngineConfig(max_model_len=10_000))
    with pytest.raises(ValueError, match="scheduling"):
        Engine(small, config=EngineConfig(scheduling="fifo"))
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    eng = Engine(small, config=EngineConfig(max_model_len=32))
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("x" * 40)
    with pytest.raises(ValueError, match="alphabet"):
        eng.add_request("NOT LOWERCASE")
    eng.add_request("a", request_id="dup")
    with pytest.raises(ValueError, match="already"):
        eng.add_request("b", request_id="dup")
    out = eng.generate(['{"name": "'], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 32


def test_one_bad_prompt_in_a_list_leaves_nothing_queued(small):
    """generate([good, good, bad]) raises for the bad prompt and takes back the two queued before it (vLLM's
    LLM.generate does the same): the engine is idle, every block free, and the next call answers as a fresh
    engine does."""
    eng = Engine(small, config=EngineConfig(block_size=4))
    with pytest.raises(ValueError, match="alphabet"):
        eng.generate(['{"name": "', '{"age": ', "NOT LOWERCASE"], SamplingParams(max_tokens=4))
    assert not eng.has_unfinished() and not eng.scheduler.waiting and not eng.scheduler.running
    assert eng.block_manager.pool.num_available == eng.config.num_blocks
    again = eng.generate(['{"age": '], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    fresh = Engine(small, config=EngineConfig(block_size=4)).generate(
        ['{"age": '], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert again.token_ids == fresh.token_ids


# ------------------------------------------------------------------ log-probs


def forward_logprobs(model, out, temperature: float = 0.0, top_k: int | None = None) -> list[float]:
    """Oracle: one plain forward (no KV cache) over prompt + output; row t predicts token t + 1. The log-prob of
    each output token under the distribution sample_next draws from, recomputed in float64."""
    p, o = out.prompt_token_ids, out.token_ids
    with torch.no_grad():
        logits, _ = model(torch.tensor([p + o]))  # (1, T, V)
    rows = logits[0, len(p) - 1 : -1].double()  # (n, V): row j predicts o[j]
    if temperature > 0:
        rows = rows / temperature
        if top_k is not None:
            rows = rows.masked_fill(rows < torch.topk(rows, top_k).values[:, -1:], float("-inf"))
    return torch.log_softmax(rows, -1)[torch.arange(len(o)), torch.tensor(o)].tolist()


LOGPROB_CASES = {"greedy": (0.0, None), "temperature_0.7": (0.7, None), "top_k_5": (1.0, 5)}


@pytest.mark.parametrize("case", list(LOGPROB_CASES))
def test_logprobs_equal_log_softmax_of_a_plain_forward(small, case):
    temperature, top_k = LOGPROB_CASES[case]
    prompts = PROMPTS[:6]  # 4..58 tokens; a budget of 24 chunks the long prefills
    params = [SamplingParams(max_tokens=12 + 4 * i, temperature=temperature, top_k=top_k, seed=i, logprobs=True,
                             ignore_eos=True) for i in range(6)]
    params[4] = SamplingParams(max_tokens=20, temperature=temperature, top_k=top_k, seed=4)  # did not ask
    eng = Engine(small, config=EngineConfig(block_size=4, max_num_batched_tokens=24))
    outs = run_all(eng, prompts, params)
    assert outs[4].logprobs is None and len(outs[4].token_ids) == 20
    for i, out in enumerate(outs):
        if i == 4:
            continue
        assert len(out.logprobs) == len(out.token_ids) == 12 + 4 * i
        want = forward_logprobs(small, out, temperature, top_k)
        assert out.logprobs == pytest.approx(want, abs=1e-5), (case, i)
        assert all(lp <= 0 for lp in out.logprobs)
        if top_k is not None:  # renormalised over the k kept tokens: above the unfiltered log-prob
            unfiltered = forward_logprobs(small, out, temperature)
            assert all(a >= b - 1e-6 for a, b in zip(out.logprobs, unfiltered)) and out.logprobs != unfiltered


def test_logprobs_survive_preemption(small):
    prompts = PROMPTS[:6]
    params = [SamplingParams(max_tokens=50, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True,
                             logprobs=True) for i in range(6)]
    ref = Engine(small).generate(prompts, params)
    eng = Engine(small, config=EngineConfig(block_size=4, num_blocks=26, max_model_len=100))  # tight: preempts
    outs = run_all(eng, prompts, params)
    assert eng.stats()["num_preemptions"] > 0
    for out, r in zip(outs, ref):
        assert out.token_ids == r.token_ids and len(out.logprobs) == len(out.token_ids) == 50
        # tokens sampled before a preemption keep their log-probs; later ones come from recomputed K/V
        assert out.logprobs == pytest.approx(r.logprobs, abs=1e-5)
    for out, sp in zip(outs, params):
        assert out.logprobs == pytest.approx(forward_logprobs(small, out, sp.temperature), abs=1e-5)


def test_overlap_engine_gives_the_plain_engines_logprobs(small):
    from mlsys.engine.overlap import OverlapEngine

    params = [SamplingParams(max_tokens=10 + 5 * i, temperature=(0.0, 0.7, 1.0)[i % 3], top_k=5 if i % 3 == 2 else None,
                             seed=i, logprobs=i != 3) for i in range(6)]
    config = EngineConfig(block_size=4, max_num_batched_tokens=24)
    plain = Engine(small, config=config).generate(PROMPTS[:6], params)
    overlap = OverlapEngine(small, config=config)
    try:
        outs = overlap.generate(PROMPTS[:6], params)
    finally:
        overlap.close()
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.logprobs for o in outs] == [o.logprobs for o in plain]  # same logits, same ops: bitwise
    assert outs[3].logprobs is None and all(len(o.logprobs) == len(o.token_ids) for o in outs if o.logprobs)


@pytest.mark.gpu
def test_cuda_engine_matches_cpu(small):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    cpu = Engine(small).generate(PROMPTS, sp)
    gpu = Engine(small, config=EngineConfig(device="cuda", enable_prefix_caching=True)).generate(PROMPTS, sp)
    same = sum(a.token_ids == b.token_ids for a, b in zip(cpu, gpu))
    assert same >= len(PROMPTS) - 1  # TF32/GPU reductions may flip one near-tie argmax


# ------------------------------------------------------------------ one failing request
@pytest.mark.parametrize("where", ["sample", "detokenize"])
def test_a_failing_request_ends_alone_and_the_batch_goes_on(small, monkeypatch, where):
    """Inject a fault into one request of a running batch (its sampling, or its detokenizer three tokens in).
    That request ends with finish_reason "error" and the exception; every other request produces exactly the
    tokens it produces alone (greedy and seeded sampling), and no block leaks."""
    import mlsys.engine.engine as engine_module

    params = [SamplingParams(max_tokens=25, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=25, temperature=0.8, top_k=10, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=25, temperature=0, ignore_eos=True)]
    good = [PROMPTS[0], PROMPTS[3], PROMPTS[5]]
    alone = [Engine(small).generate([p], sp)[0].token_ids for p, sp in zip(good, params)]
    bad_prompt = PROMPTS[1]
    bad_ids = TOK.encode(bad_prompt, bos=True)
    eng = Engine(small, config=EngineConfig(block_size=4))
    if where == "sample":
        real = engine_module.sample

        def faulty(logits, seqs):
            if any(s.prompt_token_ids == bad_ids and len(s.output_token_ids) >= 2 for s in seqs):
                raise RuntimeError("injected sampling fault")
            return real(logits, seqs)

        monkeypatch.setattr(engine_module, "sample", faulty)
    ids = [eng.add_request(p, sp) for p, sp in zip(good[:2], params[:2])]
    bad = eng.add_request(bad_prompt, SamplingParams(max_tokens=25, temperature=0, ignore_eos=True))
    ids.append(eng.add_request(good[2], params[2]))
    if where == "detokenize":
        seq, calls = eng.requests[bad], []

        def broken_step(tokens, real=seq.detokenizer.step):
            calls.append(tokens)
            if len(calls) == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
            return real(tokens)

        seq.detokenizer.step = broken_step
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        eng.check_invariants()
    assert final[bad].finish_reason == "error" and "injected" in str(final[bad].error)
    assert [final[i].token_ids for i in ids] == alone
    assert eng.stats()["num_failed_requests"] == 1
    assert eng.block_manager.pool.num_free == eng.config.num_blocks
    if where == "sample":  # the offline helper raises, naming how many failed
        with pytest.raises(RuntimeError, match="1 of 2 requests failed"):
            eng.generate([bad_prompt, good[0]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))


@pytest.mark.gpu
def test_cuda_engine_samples_seeded_and_structured_rows_like_the_cpu(small):
    """Per-request generators live on the CPU: a seeded row on a CUDA engine is moved to the CPU to draw, and a
    structured-output mask built on the CPU is moved to the logits' device. Both must run, and draw what the CPU
    engine draws (the same generator, the same probabilities up to GPU rounding)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}}}
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.8, seed=4, json_schema=schema)]
    cpu = Engine(small).generate(PROMPTS[:2], params)
    gpu = Engine(small, config=EngineConfig(device="cuda")).generate(PROMPTS[:2], params)
    assert json.loads(gpu[1].text).keys() == {"ok", "n"}
    assert sum(a.token_ids == b.token_ids for a, b in zip(cpu, gpu)) >= 1  # TF32 may move one near-tie draw
