"""The server's protocol as data (issue 28): /openapi.json documents every body, a fuzzer driven by that
document finds no 5xx and no answer outside it, and every 2xx body, plain or streamed, validates against the
official `openai` package's own response types (an oracle the server's authors did not write).

- schemathesis generates requests from /openapi.json (valid ones and ones that break the schema), against a
  live server with a tiny random-init model; its checks: no 5xx, documented status codes and content types,
  bodies that match the documented response schemas.
- Hand-picked valid requests of every kind (plain, streamed with usage, n=2, logprobs, chat, JSON schema) are
  answered with bodies that `openai.types.Completion`, `ChatCompletion` and `ChatCompletionChunk` accept, and
  the request models accept exactly what `openai`'s own request parameter types describe for the fields we use.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, settings

from mlsys.engine import Engine, EngineConfig
from mlsys.server import DEFAULT_MODEL_NAME, ServerThread, create_app

schemathesis = pytest.importorskip("schemathesis")
openai_types = pytest.importorskip("openai.types")
MODEL = DEFAULT_MODEL_NAME


@pytest.fixture(scope="module")
def server(tiny_model):
    engine = Engine(tiny_model, config=EngineConfig(max_model_len=48, max_num_seqs=8))
    with ServerThread(create_app(engine, model_name=MODEL), port=0) as running:
        yield running, engine


def test_openapi_documents_every_body(server):
    doc = httpx.get(f"{server[0].url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = doc["paths"][path]["post"]
        body_ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert body_ref.split("/")[-1] in doc["components"]["schemas"]
        assert "$ref" in op["responses"]["200"]["content"]["application/json"]["schema"]
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"model", "prompt", "max_tokens", "temperature", "response_format"} <= set(props)
    assert doc["components"]["schemas"]["CompletionRequest"]["additionalProperties"] is False


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fuzzing_from_the_openapi_document_finds_no_5xx(server):
    schema = schemathesis.openapi.from_url(f"{server[0].url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions"}
    seen: dict[str, set[int]] = {}
    from schemathesis import GenerationMode

    runs = [(op, GenerationMode.POSITIVE) for op in operations] + \
        [(op, GenerationMode.NEGATIVE) for op in operations if op.method.upper() == "POST"]  # bodies to break
    for op, mode in runs:
        fuzz_one(op, mode, seen)()
    # refusals were exercised on both routes (the answers' shapes: the hand-picked requests below)
    assert 400 in seen["POST /v1/completions"] and 400 in seen["POST /v1/chat/completions"], seen


def fuzz_one(op, mode, seen: dict):
    """A hypothesis test of one operation in one generation mode: no 5xx, and the answer as documented."""
    from hypothesis import given

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case) -> None:
        response = case.call(timeout=60)
        assert response.status_code < 500, (case.body, response.text[:300])
        case.validate_response(response, checks=_checks())
        seen.setdefault(op.label, set()).add(response.status_code)

    return fuzz


def _checks() -> list:
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    return [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


# -------------------------------------------------------------------------- the openai package's own types
def events(text: str) -> list[dict]:
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


COMPLETIONS = [
    {"prompt": "ab", "max_tokens": 5},
    {"prompt": "ab", "max_tokens": 5, "n": 2, "temperature": 0.8, "seed": 3},
    {"prompt": "ab", "max_tokens": 5, "logprobs": 2},
    {"prompt": [1, 5, 7], "max_tokens": 3, "stop": ["x", "y"]},
]
CHATS = [
    {"messages": [{"role": "user", "content": "ab"}], "max_completion_tokens": 5},
    {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"}]}],
     "max_tokens": 4, "logprobs": True, "top_logprobs": 2, "n": 2},
    {"messages": [{"role": "user", "content": "{"}], "max_completion_tokens": 30,
     "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "boolean"}}}},
]


@pytest.mark.parametrize("body", COMPLETIONS, ids=range(len(COMPLETIONS)))
def test_completions_validate_against_the_openai_types(server, body):
    url = f"{server[0].url}/v1/completions"
    plain = httpx.post(url, json={"model": MODEL, **body}, timeout=60)
    assert plain.status_code == 200, plain.text
    openai_types.Completion.model_validate(plain.json())
    streamed = httpx.post(url, json={"model": MODEL, **body, "stream": True,
                                     "stream_options": {"include_usage": True}}, timeout=60)
    chunks = events(streamed.text)
    for chunk in chunks:
        # the SDK parses completion stream chunks as Completion, whose finish_reason is not nullable; every
        # server (OpenAI's and vLLM's) sends null until the last chunk: the one field not checked here
        chunk = {**chunk, "choices": [{**c, "finish_reason": c["finish_reason"] or "length"}
                                      for c in chunk["choices"]]}
        openai_types.Completion.model_validate(chunk)
    assert chunks[-1]["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("body", CHATS, ids=range(len(CHATS)))
def test_chat_answers_validate_against_the_openai_types(server, body):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    url = f"{server[0].url}/v1/chat/completions"
    plain = httpx.post(url, json={"model": MODEL, **body}, timeout=60)
    assert plain.status_code == 200, plain.text
    ChatCompletion.model_validate(plain.json())
    streamed = httpx.post(url, json={"model": MODEL, **body, "stream": True,
                                     "stream_options": {"include_usage": True}}, timeout=60)
    for chunk in events(streamed.text):
        ChatCompletionChunk.model_validate(chunk)
