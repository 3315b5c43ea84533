"""Chapter 8 server (mlsys.server) over real HTTP: the official openai client against uvicorn in a thread.

Oracles: the engine's own greedy output (Engine.generate on a separate engine, no HTTP) for every completion,
streamed or not; the engine's block accounting (stats, check_invariants) after disconnects and a 64-client
load test; the OpenAI error shape for every validation case.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest
import torch

from mlsys.data import make_corpus
from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.server import DEFAULT_MODEL_NAME, ServerThread, create_app, parse_completion_request
from mlsys.weights import load_pretrained

MODEL = DEFAULT_MODEL_NAME
PROMPTS = [line[: 6 + 5 * i] for i, line in enumerate(make_corpus(8, seed=3).splitlines())]


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from more; keeps the test quiet on 2 cores
    yield load_pretrained("small")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def served(model):
    engine = Engine(model, config=EngineConfig(max_num_seqs=32))
    app = create_app(engine)
    with ServerThread(app, port=0) as server:
        yield server, engine, app.state.async_engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0].url}/v1", api_key="x", max_retries=0)


def reference(model, prompts, max_tokens, ignore_eos=False):
    """The oracle: a separate engine, no HTTP, same greedy decoding."""
    return Engine(model).generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))


def wait_until_idle(engine: Engine, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["num_running"] == s["num_waiting"] == s["num_used_blocks"] == 0:
            return s
        time.sleep(0.02)  # waiting for the server thread to notice and abort
    raise AssertionError(f"engine still busy after {timeout} s: {engine.stats()}")


# ---------------------------------------------------------------------------------------------- completions
@pytest.mark.timeout(60)
def test_completions_equal_engine_greedy_streamed_or_not(model, served, client):
    refs = reference(model, PROMPTS[:3], 24)
    for prompt, ref in zip(PROMPTS[:3], refs):
        plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert plain.object == "text_completion" and plain.model == MODEL
        assert plain.choices[0].text == ref.text
        assert plain.choices[0].finish_reason == ref.finish_reason
        assert plain.usage.prompt_tokens == len(ref.prompt_token_ids) == len(prompt) + 1  # + <bos>
        assert plain.usage.completion_tokens == len(ref.token_ids)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
        assert chunks[-1].usage.completion_tokens == len(ref.token_ids) and not chunks[-1].choices
    wait_until_idle(served[1])


@pytest.mark.timeout(60)
def test_token_id_prompt_and_seeded_sampling(model, served, client):
    ids = served[1].tokenizer.encode(PROMPTS[4], bos=True)
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert plain.choices[0].text == reference(model, [PROMPTS[4]], 10)[0].text
    a, b = (client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=20, temperature=1.0, seed=7,
                                      extra_body={"top_k": 5}).choices[0].text for _ in range(2))  # fmt: skip
    want = Engine(model).generate([PROMPTS[5]], SamplingParams(max_tokens=20, temperature=1.0, top_k=5, seed=7))
    assert a == b == want[0].text


@pytest.mark.timeout(60)
def test_sse_wire_format(served):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served[0].url}/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"  # every event ends with a blank line
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(p["object"] == "text_completion" and p["choices"][0]["index"] == 0 for p in payloads)
    assert [p["choices"][0]["finish_reason"] for p in payloads][-1] == "length"
    assert len({p["id"] for p in payloads}) == 1


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{served[0].url}/health").json()
    assert health["status"] == "ok" and health["num_total_blocks"] == served[1].stats()["num_total_blocks"]


# ----------------------------------------------------------------------------------------------- validation
BAD = [  # (body, status, words the message must contain)
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    ({"prompt": "abc"}, 400, "missing required argument 'model'"),
    ({"model": MODEL}, 400, "missing required argument 'prompt'"),
    ({"model": "gpt-4", "prompt": "abc"}, 404, "does not exist"),
    ({"model": MODEL, "prompt": ""}, 400, "'prompt' is empty"),
    ({"model": MODEL, "prompt": []}, 400, "'prompt' is empty"),
    ({"model": MODEL, "prompt": 5}, 400, "must be a string or a list of token ids"),
    ({"model": MODEL, "prompt": "ABC"}, 400, "not in the alphabet"),
    ({"model": MODEL, "prompt": [1, 999]}, 400, "token ids must lie in"),
    ({"model": MODEL, "prompt": ["a", "b"]}, 400, "batched prompts are not supported"),
    ({"model": MODEL, "prompt": "a" * 256}, 400, "maximum context length is 256"),
    ({"model": MODEL, "prompt": "abc", "max_tokens": 0}, 400, "between 1 and 252"),
    ({"model": MODEL, "prompt": "abc", "max_tokens": 253}, 400, "between 1 and 252"),
    ({"model": MODEL, "prompt": "abc", "max_tokens": "8"}, 400, "'max_tokens' must be an integer"),
    ({"model": MODEL, "prompt": "abc", "max_tokens": 2.5}, 400, "'max_tokens' must be an integer"),
    ({"model": MODEL, "prompt": "abc", "temperature": -1}, 400, "'temperature' must be a number in [0, 2]"),
    ({"model": MODEL, "prompt": "abc", "temperature": "hot"}, 400, "'temperature' must be a number"),
    ({"model": MODEL, "prompt": "abc", "stream": "yes"}, 400, "'stream' must be true or false"),
    ({"model": MODEL, "prompt": "abc", "stream_options": {"include_usage": True}}, 400, "only allowed when"),
    ({"model": MODEL, "prompt": "abc", "n": 2}, 400, "n=2 is not supported"),
    ({"model": MODEL, "prompt": "abc", "top_k": 0}, 400, "'top_k' must be a positive integer"),
    ({"model": MODEL, "prompt": "abc", "foo": 1}, 400, "unrecognized request argument 'foo'"),
]


@pytest.mark.parametrize("body, status, words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_get_a_clear_4xx(served, body, status, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{served[0].url}/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"


def test_openai_client_raises_the_matching_errors(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="davinci", prompt="abc", max_tokens=3)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="abc", max_tokens=1000)


def test_validation_needs_no_server(model):
    engine = Engine(model)
    req = parse_completion_request(b'{"model": "m", "prompt": "ab", "max_tokens": 3, "temperature": 0}', engine, "m")
    assert req.prompt_ids == [engine.tokenizer.bos_id, *engine.tokenizer.encode("ab")]
    assert (req.params.max_tokens, req.params.temperature, req.stream) == (3, 0.0, False)
    assert parse_completion_request(b'{"model": "m", "prompt": "ab"}', engine, "m").params.max_tokens == 16


# ----------------------------------------------------------------------------------------------- disconnects
@pytest.mark.timeout(60)
def test_client_leaving_mid_stream_frees_its_sequence_and_blocks(served):
    server, engine, front = served
    aborted = front.num_aborted
    generated = engine.stats()["num_generated_tokens"]
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:  # three events in: the request is running and holds KV blocks
                during = engine.stats()
                break
    assert during["num_running"] == 1 and during["num_used_blocks"] >= 1
    after = wait_until_idle(engine)
    assert front.num_aborted == aborted + 1
    assert after["num_free_blocks"] == after["num_total_blocks"]
    assert after["num_generated_tokens"] - generated < 200  # it stopped early
    engine.check_invariants()


@pytest.mark.timeout(60)
def test_client_leaving_a_plain_request_aborts_it(served):
    server, engine, front = served
    aborted = front.num_aborted
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 220, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.3))
    wait_until_idle(engine)
    assert front.num_aborted == aborted + 1
    engine.check_invariants()


# ------------------------------------------------------------------------------------------------ load test
async def one_stream(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    text, usage, done, reasons = [], None, False, []
    async with http.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text.append(chunk["choices"][0]["text"])
                    reasons.append(chunk["choices"][0]["finish_reason"])
                usage = chunk.get("usage", usage)
    return {"text": "".join(text), "usage": usage, "done": done, "reason": reasons[-1]}


@pytest.mark.timeout(120)
def test_64_concurrent_streaming_clients(model, served):
    server, engine, _ = served
    rng = random.Random(0)
    jobs = [(PROMPTS[i % 8], rng.randint(4, 24)) for i in range(64)]
    refs = Engine(model, config=EngineConfig(max_num_seqs=64)).generate(
        [p for p, _ in jobs], [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in jobs])
    steps_before = engine.stats()["num_steps"]

    async def main() -> list[dict]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            url = f"{server.url}/v1/completions"
            return await asyncio.gather(*(one_stream(http, url, p, n) for p, n in jobs))

    results = asyncio.run(main())
    for (prompt, n), res, ref in zip(jobs, results, refs):
        assert res["done"] and res["reason"] == "length"
        assert res["usage"]["completion_tokens"] == n == len(ref.token_ids)
        assert res["usage"]["prompt_tokens"] == len(prompt) + 1
        assert res["text"] == ref.text
    steps = engine.stats()["num_steps"] - steps_before
    assert steps < sum(n for _, n in jobs) / 4, f"{steps} steps: the clients were not batched together"
    after = wait_until_idle(engine)
    assert after["num_free_blocks"] == after["num_total_blocks"]
    engine.check_invariants()
