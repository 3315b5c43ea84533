"""The OpenAI API features clients call every day, through the official `openai` client: n answers (plain and
streamed), top log-probs, and response_format (json_object, json_schema).

Oracles: the engine called directly with the same settings (n answers: separate n=1 runs with seeds seed+i,
nothing shared), and jsonschema for every structured answer.
"""

from __future__ import annotations

import json
from collections import defaultdict

import jsonschema
import openai
import pytest

from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.json_constrained import RECORD_SCHEMA
from mlsys.server import DEFAULT_MODEL_NAME, ServerThread, create_app

MODEL = DEFAULT_MODEL_NAME
PROMPT = '{"name": "ada", '
COMMON = dict(model=MODEL, max_tokens=15, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def client(small_model):
    app = create_app(Engine(small_model, config=EngineConfig(max_num_seqs=16, block_size=8)))
    with ServerThread(app, port=0) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def alone(model, prompt_ids, seed, **kw):
    """One answer from a fresh engine: what the i-th of n answers must equal (seed + i)."""
    params = SamplingParams(max_tokens=15, temperature=1.0, seed=seed, ignore_eos=True, **kw)
    return Engine(model).generate([prompt_ids], params)[0]


def test_n_answers_plain_and_streamed(small_model, client):
    want = [alone(small_model, PROMPT, 5 + i) for i in range(3)]
    plain = client.completions.create(prompt=PROMPT, n=3, **COMMON)
    assert [c.index for c in plain.choices] == [0, 1, 2]
    assert [c.text for c in plain.choices] == [w.text for w in want]
    assert plain.usage.completion_tokens == 45 and plain.usage.prompt_tokens == len(want[0].prompt_token_ids)
    texts, finish = defaultdict(str), {}
    for chunk in client.completions.create(prompt=PROMPT, n=3, stream=True, **COMMON):
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert [texts[i] for i in range(3)] == [w.text for w in want] and set(finish.values()) == {"length"}


def test_n_chat_answers_streamed_each_open_with_the_role(small_model, client):
    messages = [{"role": "user", "content": PROMPT}]
    want = [alone(small_model, PROMPT, 5 + i) for i in range(2)]
    chunks = list(client.chat.completions.create(messages=messages, n=2, stream=True,
                                                 stream_options={"include_usage": True}, **COMMON))
    roles, texts = defaultdict(list), defaultdict(str)
    for chunk in chunks:
        for c in chunk.choices:
            roles[c.index] += [c.delta.role] if c.delta.role else []
            texts[c.index] += c.delta.content or ""
    assert dict(roles) == {0: ["assistant"], 1: ["assistant"]}
    assert [texts[0], texts[1]] == [w.text for w in want]
    assert chunks[-1].usage.completion_tokens == 30 and not chunks[-1].choices
    plain = client.chat.completions.create(messages=messages, n=2, **COMMON)
    assert [c.message.content for c in plain.choices] == [w.text for w in want]


def test_top_logprobs_completions_and_chat(small_model, client):
    want = alone(small_model, PROMPT, 5, logprobs=True, top_logprobs=3)
    tok = Engine(small_model).tokenizer
    plain = client.completions.create(prompt=PROMPT, logprobs=3, **COMMON).choices[0].logprobs
    assert len(plain.top_logprobs) == 15
    for got, top in zip(plain.top_logprobs, want.top_logprobs):
        assert got == pytest.approx({tok.decode([t]): lp for t, lp in top.items()}, abs=1e-4)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], logprobs=True,
                                          top_logprobs=3, **COMMON).choices[0].logprobs.content
    for entry, top in zip(chat, want.top_logprobs):
        assert [a.token for a in entry.top_logprobs] == [tok.decode([t]) for t in top]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(list(top.values()), abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-9  # the best alternative is at least as likely


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "enum": ["ada", "grace", "linus"]},
                                           "age": {"type": "integer", "minimum": 18, "maximum": 99},
                                           "langs": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                     "minItems": 1, "maxItems": 3}}}


@pytest.mark.parametrize("schema", [RECORD_SCHEMA, SCHEMA], ids=["record", "people"])
def test_json_schema_answers_always_validate(client, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "{"}]
    for seed in range(3):
        out = client.chat.completions.create(model=MODEL, messages=messages, n=3, temperature=1.0, seed=seed,
                                             max_completion_tokens=90, response_format=fmt)
        for c in out.choices:
            jsonschema.validate(json.loads(c.message.content), schema)
    texts = defaultdict(str)
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, n=2, temperature=1.0, seed=9,
                                                max_completion_tokens=90, response_format=fmt, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for text in texts.values():
        jsonschema.validate(json.loads(text), schema)
    plain = client.completions.create(model=MODEL, prompt="x", max_tokens=90, temperature=1.0, seed=1,
                                      extra_body={"response_format": fmt})  # vLLM's completions take it too
    jsonschema.validate(json.loads(plain.choices[0].text), schema)


def test_json_object_mode_gives_an_object(client):
    for seed in range(4):
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "{"}], seed=seed,
                                             temperature=1.0, response_format={"type": "json_object"},
                                             max_completion_tokens=60)
        assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_an_impossible_schema_is_a_400(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": -5}}}
    with pytest.raises(openai.BadRequestError, match="response_format cannot be enforced"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "{"}],
                                       response_format=fmt)
