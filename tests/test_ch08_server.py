"""Chapter 8 server (mlsys.server) over real HTTP: the official openai client against uvicorn in a thread.

Oracles: the engine's own greedy output (Engine.generate on a separate engine, no HTTP) for every completion,
streamed or not; the engine's block accounting (stats, check_invariants) after disconnects and a 64-client
load test; the OpenAI error shape for every validation case. The event-loop and disconnect tests hold the
engine inside a forward pass with an Event the test controls (`Gate`), so they wait for conditions, never
for a length of time.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time

import httpx
import openai
import pytest

from mlsys.data import make_corpus
from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.json_constrained import RECORD_SCHEMA
from mlsys.server import DEFAULT_MODEL_NAME, ServerThread, create_app, parse_completion_request

MODEL = DEFAULT_MODEL_NAME
PROMPTS = [line[: 6 + 5 * i] for i, line in enumerate(make_corpus(8, seed=3).splitlines())]


@pytest.fixture(scope="module")
def served(small_model):
    engine = Engine(small_model, config=EngineConfig(max_num_seqs=32))
    app = create_app(engine)
    with ServerThread(app, port=0) as server:
        yield server, engine, app.state.async_engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0].url}/v1", api_key="x", max_retries=0)


class Gate:
    """Wraps the engine's forward pass. Armed, the next forward pass stops inside the step (the engine's lock
    held, as during a long step) until the test calls release(); `entered` tells the test it got there."""

    def __init__(self, engine: Engine) -> None:
        self.forward = engine.runner.execute
        engine.runner.execute = self
        self.armed, self.entered, self.released = False, threading.Event(), threading.Event()
        self.fail_next: Exception | None = None  # raise this from the next forward pass instead

    def __call__(self, *args, **kwargs):
        if self.fail_next is not None:
            err, self.fail_next = self.fail_next, None
            raise err
        if self.armed:
            self.armed = False
            self.entered.set()
            self.released.wait(60)  # bounded: a broken test must not hang the suite
        return self.forward(*args, **kwargs)

    def arm(self) -> None:
        self.entered.clear()
        self.released.clear()
        self.armed = True

    def release(self) -> None:
        self.released.set()


@pytest.fixture(scope="module")
def gated(small_model):
    engine = Engine(small_model, config=EngineConfig(max_num_seqs=8))
    gate = Gate(engine)
    app = create_app(engine)
    with ServerThread(app, port=0) as server:
        yield server, engine, app.state.async_engine, gate
        gate.release()


def reference(model, prompts, max_tokens, ignore_eos=False):
    """The oracle: a separate engine, no HTTP, same greedy decoding."""
    return Engine(model).generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))


def wait_for(condition, what: str, timeout: float = 30.0):
    """Poll until condition() is truthy (bounded); returns its value. A wait for another thread, not a timing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"gave up waiting for {what} after {timeout} s")


def wait_until_idle(engine: Engine) -> dict:
    def idle() -> dict | None:
        s = engine.stats()
        return s if s["num_running"] == s["num_waiting"] == s["num_used_blocks"] == 0 else None

    return wait_for(idle, "the engine to go idle")


def in_thread(fn):
    """Run fn() in a thread; returns (thread, result list that receives fn's return value or exception)."""
    out: list = []

    def target() -> None:
        try:
            out.append(fn())
        except Exception as err:
            out.append(err)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


# ---------------------------------------------------------------------------------------------- completions
@pytest.mark.timeout(60)
def test_completions_equal_engine_greedy_streamed_or_not(small_model, served, client):
    refs = reference(small_model, PROMPTS[:3], 24)
    for prompt, ref in zip(PROMPTS[:3], refs):
        plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert plain.object == "text_completion" and plain.model == MODEL
        assert plain.choices[0].text == ref.text
        assert plain.choices[0].finish_reason == ref.finish_reason
        assert plain.usage.prompt_tokens == len(ref.prompt_token_ids) == len(prompt) + 1  # + <bos>
        assert plain.usage.completion_tokens == len(ref.token_ids)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
        assert chunks[-1].usage.completion_tokens == len(ref.token_ids) and not chunks[-1].choices
    wait_until_idle(served[1])


@pytest.mark.timeout(60)
def test_token_id_prompt_and_seeded_sampling(small_model, served, client):
    ids = served[1].tokenizer.encode(PROMPTS[4], bos=True)
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert plain.choices[0].text == reference(small_model, [PROMPTS[4]], 10)[0].text
    a, b = (client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=20, temperature=1.0, seed=7,
                                      extra_body={"top_k": 5}).choices[0].text for _ in range(2))
    want = Engine(small_model).generate([PROMPTS[5]], SamplingParams(max_tokens=20, temperature=1.0, top_k=5, seed=7))
    assert a == b == want[0].text
    stopped = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=40, temperature=0,
                                        stop=[", ", "zzz"], extra_body={"ignore_eos": True}).choices[0]
    full = reference(small_model, [PROMPTS[5]], 40)[0].text
    assert ", " in full and stopped.text == full[: full.find(", ")] and stopped.finish_reason == "stop"
    chunks = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=40, temperature=0,
                                       stop=", ", stream=True)
    assert "".join(c.choices[0].text for c in chunks) == stopped.text
    nucleus = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=20, temperature=1.0, seed=7,
                                        top_p=0.8).choices[0].text
    want = Engine(small_model).generate([PROMPTS[5]], SamplingParams(max_tokens=20, temperature=1.0, top_p=0.8, seed=7))
    assert nucleus == want[0].text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("message, fitted", [("Give me a record.", "give me a record "),
                                             ("Café NAÏVE — {\"x\": 1}!", 'cafe naive   {"x": 1} '),
                                             ("Hello\n\nWorld ✓", "hello  world  ")])
def test_the_default_model_answers_any_chat_text_through_the_official_client(small_model, client, message,
                                                                             fitted):
    """The first chat message a reader types (capitals, a full stop, accents, a dash, a newline) is answered, not
    refused: the book template fits it to the character model's alphabet. The oracle is the engine completing
    the fitted text written by hand here, so the test also pins down what the fitting does."""
    want = reference(small_model, [fitted], 12, ignore_eos=True)[0]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": message}],
                                          max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == want.text
    assert chat.usage.prompt_tokens == len(want.prompt_token_ids)
    with pytest.raises(openai.BadRequestError, match="no character the model knows"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "数据 ✓"}], max_tokens=4)


@pytest.mark.timeout(60)
def test_chat_completions_plain_and_streamed_with_the_book_template(small_model, served, client):
    """The book's template prompts with the last user message: the chat answer is the completion of that text."""
    messages = [{"role": "system", "content": "ignored by the book's models"},
                {"role": "user", "content": [{"type": "text", "text": PROMPTS[4]}]}]
    want = reference(small_model, [PROMPTS[4]], 20, ignore_eos=True)[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                          extra_body={"ignore_eos": True})
    choice = chat.choices[0]
    assert chat.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == want.text and choice.finish_reason == "length"
    assert chat.usage.prompt_tokens == len(want.prompt_token_ids) and chat.usage.completion_tokens == 20
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices


@pytest.mark.timeout(60)
def test_logprobs_of_the_sampled_tokens_plain_streamed_and_chat(small_model, served, client):
    """logprobs=0 (completions) and logprobs=true (chat): each sampled token's log-prob, equal to the engine's."""
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=True, ignore_eos=True)
    want = Engine(small_model).generate([PROMPTS[3]], params)[0]
    common = dict(model=MODEL, max_tokens=12, temperature=0.8, seed=3, extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt=PROMPTS[3], logprobs=0, **common).choices[0]
    assert plain.text == want.text and "".join(plain.logprobs.tokens) == want.text
    assert plain.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-6)
    assert plain.logprobs.text_offset[0] == 0 and plain.logprobs.text_offset[1] == len(plain.logprobs.tokens[0])
    stream = client.completions.create(prompt=PROMPTS[3], logprobs=0, stream=True, **common)
    chunks = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    streamed = [lp for block in chunks for lp in block.token_logprobs]
    assert streamed == pytest.approx(want.logprobs, abs=1e-6)
    # text_offset counts from the start of the answer in every chunk, not from the chunk: oracle from the texts
    tokens = [t for block in chunks for t in block.tokens]
    assert [o for block in chunks for o in block.text_offset] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert len(chunks) > 1                                # several chunks, so a restart at 0 would show
    messages = [{"role": "user", "content": PROMPTS[3]}]
    chat = client.chat.completions.create(messages=messages, logprobs=True, **common).choices[0]
    assert [t.logprob for t in chat.logprobs.content] == pytest.approx(want.logprobs, abs=1e-6)
    assert "".join(t.token for t in chat.logprobs.content) == chat.message.content == want.text
    plain = client.completions.create(prompt=PROMPTS[3], **common).choices[0]
    assert plain.logprobs is None  # not asked for


BAD_CHAT = [
    ({"model": MODEL}, "missing required argument 'messages'"),
    ({"model": MODEL, "messages": []}, "'messages' must be a non-empty list"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "{"}]}, "'messages[0].role' must be one of"),
    ({"model": MODEL, "messages": [{"role": "system", "content": "{"}]}, "there is none"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 3}]}, "must be a string or a list of text parts"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "{"}], "n": 0}, "'n' must be an integer from 1"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "{"}], "n": 10_000}, "'n' must be an integer from 1"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "{"}], "response_format": {"type": "yaml"}},
     "'response_format' must be"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "{"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "a+"}}}},
     "response_format cannot be enforced"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "{"}], "max_completion_tokens": 5,
      "response_format": {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD_SCHEMA}}},
     "the shortest JSON document the schema allows has"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "{"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["a" * 20_000]}}}}, "exceeds 16384"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "{"}], "stop": ", ", "response_format": {
        "type": "json_schema", "json_schema": {"name": "record", "schema": RECORD_SCHEMA}}},
     "'stop' cannot be combined with a JSON response_format"),   # the review's case: stop ", " cut the JSON
    ({"model": MODEL, "messages": [{"role": "user", "content": "{"}], "prompt": "{"}, "unrecognized request"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "{"}], "max_completion_tokens": 0}, "between 1"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "{"}], "logprobs": 1}, "must be true or false"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "{"}], "top_logprobs": 3},
     "'top_logprobs' needs 'logprobs' to be true"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "{"}], "logprobs": True, "top_logprobs": 21},
     "'top_logprobs' must be an integer from 0 to 20"),
    ({"model": MODEL, "prompt": "{", "logprobs": 21}, "'logprobs' must be an integer from 0 to 20"),
    ({"model": MODEL, "prompt": "{", "best_of": 2}, "best_of=2 is not supported"),
]


@pytest.mark.parametrize("body, words", BAD_CHAT, ids=[str(i) for i in range(len(BAD_CHAT))])
def test_bad_chat_requests_get_a_clear_400(served, body, words):
    route = "chat/completions" if "messages" in body or "prompt" not in body else "completions"
    r = httpx.post(f"{served[0].url}/v1/{route}", json=body, timeout=30)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("bound", ['{"type": "number", "maximum": 1e400}', '{"type": "integer", "minimum": -Infinity}',
                                   '{"type": "string", "maxLength": 1e400}', '{"type": "number", "multipleOf": NaN}'])
def test_a_schema_with_an_infinite_bound_is_a_400_not_a_500(served, bound):
    """The probe's case: bounds Python's json reads as inf or nan (1e400, Infinity, NaN) crashed the schema
    compiler with a 500; the body is sent as raw bytes, since a JSON encoder would refuse to write them."""
    head = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "{"}]})[:-1]
    body = (head + ', "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": '
            + bound + "}}}").encode()
    r = httpx.post(f"{served[0].url}/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "not finite" in r.json()["error"]["message"], r.text


@pytest.mark.timeout(90)
def test_health_is_503_while_a_step_is_stuck_and_200_when_it_moves_again(small_model):
    """/health tells the truth: a request waits and the engine's forward is held (the Gate: a wedged step, as
    with a stopped tensor-parallel worker), so after the stall limit /health is 503 with a reason; released, it
    is 200 again, and an idle engine stays 200 however long it idles."""
    engine = Engine(small_model, config=EngineConfig(max_num_seqs=4))
    gate = Gate(engine)
    with ServerThread(create_app(engine, health_stall_s=0.3), port=0) as server:
        url = server.url
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        gate.arm()
        pending = threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",),
                                   kwargs={"json": {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4},
                                           "timeout": 60})
        pending.start()
        assert gate.entered.wait(30)
        sick = wait_for(lambda: (r := httpx.get(f"{url}/health", timeout=10)).status_code == 503 and r,
                        "/health to report the stuck step")
        assert sick.json()["status"] == "unhealthy" and "no engine step has finished" in sick.json()["reason"]
        gate.release()
        pending.join(60)
        wait_for(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200, "/health to recover")
        time.sleep(0.5)                       # idle past the stall limit: idling is not stalling
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200


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
    ({"model": MODEL, "prompt": "abc", "n": 2.0}, 400, "'n' must be an integer"),
    ({"model": MODEL, "prompt": "abc", "top_k": 0}, 400, "'top_k' must be a positive integer"),
    ({"model": MODEL, "prompt": "abc", "top_p": 0}, 400, "'top_p' must be a number in (0, 1]"),
    ({"model": MODEL, "prompt": "abc", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4 strings"),
    ({"model": MODEL, "prompt": "abc", "stop": [1]}, 400, "'stop' must be a string or a list"),
    ({"model": MODEL, "prompt": "abc", "top_p": 1.01}, 400, "'top_p' must be a number in (0, 1]"),
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


def test_validation_needs_no_server(small_model):
    engine = Engine(small_model)
    req = parse_completion_request(b'{"model": "m", "prompt": "ab", "max_tokens": 3, "temperature": 0}', engine, "m")
    assert req.prompt_ids == [engine.tokenizer.bos_id, *engine.tokenizer.encode("ab")]
    assert (req.params.max_tokens, req.params.temperature, req.stream) == (3, 0.0, False)
    assert parse_completion_request(b'{"model": "m", "prompt": "ab"}', engine, "m").params.max_tokens == 16


# ------------------------------------------------------------------------------------- the event loop stays free
@pytest.mark.timeout(90)
def test_event_loop_answers_while_a_step_is_blocked(small_model, gated):
    server, engine, front, gate = gated
    received = front.num_received
    http = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    gate.arm()
    first, out1 = in_thread(lambda: http.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12,
                                                             temperature=0))
    assert gate.entered.wait(30), "the first request's step never started"
    # The engine thread is now stuck inside a forward pass, holding the engine's lock. Everything below must
    # still be answered: a new request is enqueued, /v1/models and /health reply.
    second, out2 = in_thread(lambda: http.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12,
                                                              temperature=0))
    wait_for(lambda: front.num_received == received + 2, "the second request to be enqueued")
    models = httpx.get(f"{server.url}/v1/models", timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    health = httpx.get(f"{server.url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert not gate.released.is_set() and first.is_alive() and second.is_alive()  # the step is still blocked
    gate.release()
    first.join(60)
    second.join(60)
    refs = reference(small_model, PROMPTS[:2], 12)
    assert [o[0].choices[0].text for o in (out1, out2)] == [r.text for r in refs]
    wait_until_idle(engine)
    engine.check_invariants()


# --------------------------------------------------------------------------------------------------- failures
@pytest.mark.timeout(90)
def test_an_error_adding_one_request_ends_that_request_only(small_model, gated, monkeypatch):
    server, engine, front, gate = gated
    add = engine.add_request

    def add_or_fail(ids, params, request_id=None):
        if params.max_tokens == 7:  # the request this test marks as the broken one
            raise RuntimeError("injected failure while adding")
        return add(ids, params, request_id=request_id)

    monkeypatch.setattr(engine, "add_request", add_or_fail)
    received = front.num_received
    gate.arm()
    good, out = in_thread(lambda: httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPTS[2], "max_tokens": 30, "temperature": 0}))
    assert gate.entered.wait(30)
    broken, bad = in_thread(lambda: httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPTS[3], "max_tokens": 7, "temperature": 0}))
    wait_for(lambda: front.num_received == received + 2, "both requests to be enqueued")
    gate.release()  # the engine thread finishes the step, then drains the inbox: the add fails
    broken.join(60)
    good.join(60)
    assert bad[0].status_code == 500 and bad[0].json()["error"]["code"] == "generation_failed"
    assert bad[0].json()["error"]["type"] == "server_error"
    assert out[0].status_code == 200
    assert out[0].json()["choices"][0]["text"] == reference(small_model, [PROMPTS[2]], 30)[0].text
    wait_until_idle(engine)
    engine.check_invariants()


@pytest.mark.timeout(90)
def test_a_failing_step_ends_its_requests_and_the_server_keeps_serving(small_model, gated):
    server, engine, front, gate = gated
    failed = front.num_failed
    gate.fail_next = RuntimeError("injected failure in the forward pass")
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 20, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 500 and error["code"] == "generation_failed" and error["type"] == "server_error"
    assert "injected" not in error["message"]  # internals go to the server log, not to the client
    assert front.num_failed == failed + 1
    after = wait_until_idle(engine)
    assert after["num_free_blocks"] == after["num_total_blocks"]
    engine.check_invariants()
    again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)  # the server still serves
    assert again.status_code == 200
    assert again.json()["choices"][0]["text"] == reference(small_model, [PROMPTS[4]], 20)[0].text


@pytest.mark.timeout(90)
def test_a_broken_engine_thread_fails_requests_instead_of_hanging_them(small_model):
    engine = Engine(small_model, config=EngineConfig(max_num_seqs=4))
    app = create_app(engine)
    front = app.state.async_engine
    with ServerThread(app, port=0) as server:
        def broken_drain(block):  # a bug in the engine thread's own loop
            raise RuntimeError("injected bug in the engine loop")

        front._drain = broken_drain  # the next time round its loop, after the request below is added
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0}
        first = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert first.status_code == 500 and first.json()["error"]["code"] == "generation_failed"
        assert isinstance(front.dead, RuntimeError)
        later = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_dead"


# ----------------------------------------------------------------------------------------------- disconnects
@pytest.mark.timeout(90)
def test_client_leaving_mid_stream_frees_its_sequence_and_blocks(gated):
    server, engine, front, gate = gated
    aborted = front.num_aborted
    generated = engine.stats()["num_generated_tokens"]
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:  # three events in: the request is running and holds KV blocks
                gate.arm()  # the next step stops in its forward pass: the request cannot run to the end
                assert gate.entered.wait(30), "the request's next step never started"
                during = front.stats()  # the snapshot: engine.stats() would wait for the blocked step
                break
    assert during["num_running"] == 1 and during["num_used_blocks"] >= 1
    wait_for(lambda: front.num_aborted == aborted + 1, "the handler to notice the client left")
    gate.release()
    after = wait_until_idle(engine)
    assert after["num_free_blocks"] == after["num_total_blocks"]
    assert after["num_generated_tokens"] - generated < 200  # it stopped early
    engine.check_invariants()


@pytest.mark.timeout(90)
def test_client_leaving_a_plain_request_aborts_it(gated):
    server, engine, front, gate = gated
    aborted = front.num_aborted
    generated = engine.stats()["num_generated_tokens"]
    data = json.dumps({"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 220, "temperature": 0,
                       "ignore_eos": True}).encode()
    gate.arm()  # its first step stops in the forward pass, so it cannot finish before the client leaves
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        assert gate.entered.wait(30), "the request never reached the engine"
    # the socket is closed: the handler must notice while it waits, and queue an abort
    wait_for(lambda: front.num_aborted == aborted + 1, "the handler to notice the client left")
    gate.release()
    after = wait_until_idle(engine)
    assert after["num_generated_tokens"] - generated < 220 and after["num_free_blocks"] == after["num_total_blocks"]
    engine.check_invariants()


# ------------------------------------------------------------------------------------------------ load test
async def one_stream(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
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
def test_64_concurrent_streaming_clients(small_model, served):
    server, engine, _ = served
    rng = random.Random(0)
    jobs = [(PROMPTS[i % 8], rng.randint(4, 24)) for i in range(64)]
    refs = Engine(small_model, config=EngineConfig(max_num_seqs=64)).generate(
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
