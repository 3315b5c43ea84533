"""Parallel sampling (n > 1, copy-on-write KV blocks), top log-probs and structured output inside the engine.

Oracles: n separate n=1 runs with seeds seed+i, each in a fresh engine with nothing shared (the forked siblings
must draw exactly their tokens); a brute-force count of the distinct blocks in the live block tables (the
sharing the pool reports); log_softmax + topk of a plain GPT forward over the whole sequence, no cache (the
alternatives); jsonschema (every structured answer), and the unconstrained engine (requests without a schema
in the same batch are untouched by the masks).
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from mlsys.data import Tokenizer, make_corpus
from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.engine.overlap import OverlapEngine
from mlsys.json_constrained import RECORD_SCHEMA

TOK = Tokenizer()
LINES = make_corpus(20, seed=3).splitlines()
PROMPT = LINES[0][:37]  # 38 tokens with <bos>: the last of its blocks is partly filled for block sizes 4 and 16

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def step_all(engine: Engine, watch=None) -> dict:
    """Run to completion, checking the block accounting after every step; {(request id, index): final}."""
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id, out.index] = out
        engine.check_invariants()
        if watch is not None:
            watch(engine)
    return final


@pytest.mark.parametrize("block_size,caching,num_blocks", [(4, False, None), (16, True, None), (4, False, 30)])
def test_n_siblings_draw_the_tokens_of_separate_seeded_runs(small_model, block_size, caching, num_blocks):
    """n=4 forked from one prefill = four independent requests with seeds 7..10, including under prefix caching
    and under preemption (30 blocks of 4 cannot hold four 38+40-token sequences)."""
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7, n=4, ignore_eos=True, logprobs=True)
    eng = Engine(small_model, config=EngineConfig(block_size=block_size, enable_prefix_caching=caching,
                                                  num_blocks=num_blocks, max_num_seqs=8, max_model_len=96))
    rid = eng.add_request(PROMPT, params)
    final = step_all(eng)
    assert sorted(final) == [(rid, i) for i in range(4)]
    for i in range(4):
        alone = Engine(small_model, config=EngineConfig(block_size=block_size)).generate(
            [PROMPT], SamplingParams(max_tokens=40, temperature=1.0, seed=7 + i, ignore_eos=True, logprobs=True))[0]
        assert final[rid, i].token_ids == alone.token_ids
        assert final[rid, i].text == alone.text
        assert final[rid, i].logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    assert eng.stats()["num_used_blocks"] == 0
    if num_blocks:
        assert eng.stats()["num_preemptions"] > 0


def test_the_prompt_is_stored_once_and_the_shared_tail_block_is_copied(small_model):
    """After the fork the four tables share every prompt block; the pool's count of used blocks equals the
    number of distinct ids in the live tables (brute force), and it is the prompt's blocks plus one private
    block per sibling, against four times the prompt's blocks without sharing."""
    bs = 4
    eng = Engine(small_model, config=EngineConfig(block_size=bs))
    eng.add_request(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=1, n=4, ignore_eos=True))
    seen = []

    def watch(e):
        live = [s for s in e.scheduler.running]
        distinct = {b for s in live for b in s.block_table}
        assert e.block_manager.pool.num_used == len(distinct)
        seen.append((len(live), len(distinct), [list(s.block_table) for s in live]))

    step_all(eng, watch)
    prompt_blocks = -(-len(TOK.encode(PROMPT, bos=True)) // bs)  # 38 tokens -> 10 blocks, the last half full
    n_live, n_distinct, tables = seen[0]  # right after the prefill step: forked, nothing written yet
    assert n_live == 4 and n_distinct == prompt_blocks
    assert all(t == tables[0] for t in tables)
    n_live, n_distinct, tables = seen[1]  # each wrote position 38: the shared tail block copied for all but one
    assert n_distinct == prompt_blocks + 3
    assert len({t[-1] for t in tables}) == 4 and len({tuple(t[:-1]) for t in tables}) == 1
    assert eng.stats()["num_cow_copies"] == 3


def test_greedy_n_gives_n_equal_answers(small_model):
    eng = Engine(small_model)
    outs = eng.generate([PROMPT], SamplingParams(max_tokens=20, n=3))
    alone = Engine(small_model).generate([PROMPT], SamplingParams(max_tokens=20))[0]
    assert [o.index for o in outs] == [0, 1, 2] and len({o.request_id for o in outs}) == 1
    assert eng.counters["num_generated_tokens"] == 3 * 20  # one request of three answers, nothing more
    assert all(o.token_ids == alone.token_ids for o in outs)


def test_abort_ends_every_sibling_and_frees_every_block(small_model):
    eng = Engine(small_model, config=EngineConfig(block_size=4))
    rid = eng.add_request(PROMPT, SamplingParams(max_tokens=30, temperature=1.0, seed=2, n=3, ignore_eos=True))
    eng.step()  # prefill + fork
    eng.step()
    eng.abort(rid)
    outs = eng.step()
    assert sorted(o.index for o in outs if o.finish_reason == "abort") == [0, 1, 2]
    assert not eng.has_unfinished() and eng.stats()["num_used_blocks"] == 0
    eng.check_invariants()
    rid = eng.add_request(PROMPT, SamplingParams(max_tokens=30, n=2))  # aborted before its prefill: both report
    eng.abort(rid)
    assert sorted(o.index for o in eng.step()) == [0, 1]


def test_n_is_checked(small_model):
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        Engine(small_model, config=EngineConfig(max_num_seqs=2)).add_request("x", SamplingParams(n=3))
    with pytest.raises(ValueError, match="n > 1"):
        OverlapEngine(small_model).add_request("x", SamplingParams(n=2))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_top_logprobs_are_the_k_best_of_a_plain_forward(small_model, temperature):
    """At every generated position: the alternatives are torch.topk of log_softmax over a cache-free forward of
    prompt + output (divided by the temperature when sampling), and the sampled token's log-prob is its entry."""
    k = 5
    out = Engine(small_model).generate([PROMPT], SamplingParams(max_tokens=12, temperature=temperature, seed=4,
                                                                logprobs=True, top_logprobs=k))[0]
    ids = torch.tensor([out.prompt_token_ids + out.token_ids])
    with torch.no_grad():
        logits, _ = small_model(ids)
    P = len(out.prompt_token_ids)
    logp = torch.log_softmax(logits[0, P - 1 : P - 1 + len(out.token_ids)].double() / (temperature or 1.0), -1)
    assert len(out.top_logprobs) == len(out.token_ids)
    for t, (tok, top) in enumerate(zip(out.token_ids, out.top_logprobs)):
        values, best = torch.topk(logp[t], k)
        assert list(top) == best.tolist()
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-4)
        assert out.logprobs[t] == pytest.approx(logp[t, tok].item(), abs=1e-4)


SCHEMAS = {
    "record": RECORD_SCHEMA,
    "object": {"type": "object"},
    "nested": {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {
        "type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}}},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_structured_answers_validate_and_leave_the_rest_of_the_batch_alone(small_model, name):
    """A batch mixing free requests with n=3 structured ones at temperature 1: every structured answer is a
    JSON document valid under the schema (jsonschema), whatever the budget, and the free requests produce the
    tokens they produce alone."""
    schema = SCHEMAS[name]
    free = [SamplingParams(max_tokens=30, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2)]
    eng = Engine(small_model, config=EngineConfig(block_size=8))
    min_len = eng.compile_schema(schema).min_length
    budgets = [min_len, min_len + 3, 80]
    ids = [eng.add_request(LINES[1][:10], sp) for sp in free]
    structured = [eng.add_request("{", SamplingParams(max_tokens=b, temperature=1.0, seed=b, n=3, json_schema=schema))
                  for b in budgets]
    final = step_all(eng)
    for rid, budget in zip(structured, budgets):
        for i in range(3):
            out = final[rid, i]
            assert len(out.token_ids) <= budget + 1  # the document, and <eos> when it closed early
            jsonschema.validate(json.loads(out.text), schema)
    for rid, sp in zip(ids, free):
        alone = Engine(small_model).generate([LINES[1][:10]], sp)[0]
        assert final[rid, 0].token_ids == alone.token_ids


def test_structured_output_is_refused_when_it_cannot_be_met(small_model):
    eng = Engine(small_model)
    with pytest.raises(ValueError, match="shortest document"):
        eng.add_request("{", SamplingParams(max_tokens=5, json_schema=RECORD_SCHEMA))
    with pytest.raises(ValueError, match="subset"):
        eng.add_request("{", SamplingParams(max_tokens=50, json_schema={"type": "string", "pattern": "a+"}))


def test_overlap_engine_structured_output_equals_the_plain_engine(small_model):
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, json_schema=RECORD_SCHEMA, logprobs=True,
                             top_logprobs=2) for s in range(3)]
    plain = Engine(small_model).generate(["{"] * 3, params)
    overlap = OverlapEngine(small_model)
    try:
        over = overlap.generate(["{"] * 3, params)
    finally:
        overlap.close()
    assert [o.token_ids for o in over] == [o.token_ids for o in plain]
    assert [o.top_logprobs for o in over] == [o.top_logprobs for o in plain]
    for o in plain:
        jsonschema.validate(json.loads(o.text), RECORD_SCHEMA)


def test_llm_groups_the_n_answers_of_each_prompt(small_model):
    """vLLM's shape: one RequestOutput per prompt, its n CompletionOutputs in .outputs, by index."""
    from mlsys.engine import LLM

    llm = LLM.__new__(LLM)  # the `small` weights already loaded by conftest, no second load
    llm.engine = Engine(small_model)
    outs = llm.generate([PROMPT, {"prompt_token_ids": [1, 5, 6]}],
                        [SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=3), SamplingParams(max_tokens=4)])
    assert [len(o.outputs) for o in outs] == [3, 1]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    for c in outs[0].outputs:
        alone = Engine(small_model).generate([PROMPT], SamplingParams(max_tokens=8, temperature=1.0, seed=3 + c.index))
        assert c.token_ids == alone[0].token_ids
