"""The server stays available under abuse (issue 28): no request, connection or schema can starve the others.

- Schema compiling is bounded before it starts: `estimated_size` is an upper bound of the automaton that
  `build` really makes (the oracle: the NFA built with the limits lifted, counted), so a refusal costs nothing;
  a refusal is remembered; twelve threads asking for one schema cause one compile; the cache is bounded in bytes,
  and SchemaFSM.nbytes is checked against what tracemalloc measures.
- Parsing runs on a bounded pool: past its threads and queue a request gets a 429 in OpenAI's shape at once, and
  the requests already admitted still get their answers.
- A chat template that loops, or asks for a huge string, is a 400 within its time limit; the server goes on
  answering and stops cleanly.
- Idle and half-sent connections are closed after the header timeout (a byte a second does not keep one open),
  and past the connection limit the oldest idle one makes room: a real client still gets its answer.

No test measures a duration: each waits for an event (a closed socket, an answer) under pytest-timeout.
"""

from __future__ import annotations

import gc
import json
import socket
import threading
import time
import tracemalloc

import httpx
import pytest

import mlsys.json_constrained as jc
import mlsys.server as server_module
from mlsys.engine import Engine, EngineConfig
from mlsys.server import DEFAULT_MODEL_NAME, ServerThread, create_app

MODEL = DEFAULT_MODEL_NAME
SCHEMAS = [
    {"type": "string", "maxLength": 40},
    {"type": "string", "minLength": 3, "maxLength": 200},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 50}, "maxItems": 6},
    {"enum": list(range(300))},
    {"type": "integer", "minimum": 5, "maximum": 2000},
    jc.RECORD_SCHEMA,
    {"type": "object"},
    {"type": "object", "properties": {"a": {}, "b": {"type": "array", "items": {"type": "object"}}}},
]


# --------------------------------------------------------------------------------------- schema compile cost
def built_size(schema: dict) -> int:
    """States + edges of the NFA that build() really makes, with the size limits out of the way."""
    nfa = jc.NFA()
    jc.build(nfa, schema)
    return len(nfa.edges) + sum(map(len, nfa.edges))


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_the_estimate_bounds_the_automaton_built(schema):
    real = built_size(schema)
    assert real <= jc.estimated_size(schema) <= 16 * real + 64, (real, jc.estimated_size(schema))


def test_a_huge_schema_is_refused_before_anything_is_built(monkeypatch):
    built = []
    monkeypatch.setattr(jc, "build", lambda *a, **k: built.append(1))
    for schema in ({"type": "string", "maxLength": 11_000}, {"type": "array", "maxItems": 10**9},
                   {"type": "integer", "minimum": 0, "maximum": 10**7}, {"enum": ["ab" * 50] * 5000}):
        with pytest.raises(jc.SchemaError, match="too large"):
            jc.SchemaFSM(schema)
    assert built == []


def test_strings_compile_in_linear_work():
    """maxLength L: the subset construction follows O(L) edges per character, not O(L^2) (the optional chain)."""
    work = {L: jc.SchemaFSM({"type": "string", "maxLength": L}).nfa.work for L in (50, 100, 200)}
    assert work[200] < 5 * work[50], work  # quadratic growth would be 16x


def test_one_compile_per_schema_and_refusals_remembered(monkeypatch):
    calls = []
    real = jc.SchemaFSM

    class Counting(real):
        def __init__(self, schema, tok=None):
            calls.append(json.dumps(schema))
            time.sleep(0.05)  # hold the compile open so that the other threads arrive while it runs
            super().__init__(schema, tok)

    monkeypatch.setattr(jc, "SchemaFSM", Counting)
    cache = jc.SchemaCache()
    good, bad = {"type": "string", "maxLength": 30}, {"type": "integer", "minimum": 7, "maximum": 3}
    results, errors = [], []

    def ask(schema):
        try:
            results.append(cache.get(schema))
        except jc.SchemaError as err:
            errors.append(str(err))

    threads = [threading.Thread(target=ask, args=(s,)) for s in [good] * 12 + [bad] * 12]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 12 and all(r is results[0] for r in results)
    assert len(errors) == 12 and len(set(errors)) == 1
    assert sorted(calls) == sorted([json.dumps(good), json.dumps(bad)])  # one compile each
    ask(bad)
    ask(dict(reversed(list(good.items()))))  # the same schema, keys in another order
    assert len(calls) == 2 and cache.compiles == 2


@pytest.mark.timeout(60)
def test_past_two_new_schemas_compiling_a_third_is_busy_and_a_cached_one_is_not(monkeypatch):
    gate, started = threading.Event(), threading.Semaphore(0)
    real = jc.SchemaFSM

    class Held(real):
        def __init__(self, schema, tok=None):
            if schema.get("title") == "held":
                started.release()
                gate.wait()
            super().__init__(schema, tok)

    monkeypatch.setattr(jc, "SchemaFSM", Held)
    cache = jc.SchemaCache(max_compiling=2)
    ready = cache.get({"type": "boolean"})
    held = [{"type": "string", "maxLength": n, "title": "held"} for n in (3, 4)]
    threads = [threading.Thread(target=cache.get, args=(h,)) for h in held]
    for t in threads:
        t.start()
    started.acquire()
    started.acquire()  # both compiles are running
    with pytest.raises(jc.SchemaBusy):
        cache.get({"type": "string", "maxLength": 5})
    assert cache.get({"type": "boolean"}) is ready  # cached: no compile needed, never busy
    gate.set()
    for t in threads:
        t.join()
    assert cache.get({"type": "string", "maxLength": 5}).accepts_text('"ab"')  # free again


def test_nbytes_is_an_upper_estimate_of_the_memory_held():
    tok = jc.Tokenizer()
    for schema in SCHEMAS:
        gc.collect()
        tracemalloc.start()
        fsm = jc.SchemaFSM(schema, tok)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert held <= fsm.nbytes() <= 2.5 * held, (schema, held, fsm.nbytes())


def test_the_cache_is_bounded_in_bytes():
    cache = jc.SchemaCache(max_bytes=3 << 20)
    fsms = [cache.get({"type": "integer", "minimum": 0, "maximum": 300 + i}) for i in range(12)]
    sizes = [f.nbytes() for f in fsms]
    assert cache.nbytes <= 3 << 20 and cache.nbytes == sum(size for _, size in cache._fsms.values())
    assert len(cache._fsms) < 12 and sum(sizes) > 3 << 20  # some were dropped, the newest kept
    assert cache.get({"type": "integer", "minimum": 0, "maximum": 311}) is fsms[-1]


# ------------------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(tiny_model, config=EngineConfig(max_model_len=48, max_num_seqs=8))


def body(**extra) -> dict:
    return {"model": MODEL, "prompt": "ab", "max_tokens": 4, "temperature": 0, **extra}


@pytest.mark.timeout(120)
def test_a_full_parse_queue_answers_429_and_the_admitted_requests_finish(engine, monkeypatch):
    gate, entered = threading.Event(), threading.Semaphore(0)
    real = server_module.parse_completion_request

    def held(*args):
        entered.release()
        gate.wait()
        return real(*args)

    monkeypatch.setattr(server_module, "parse_completion_request", held)
    monkeypatch.setattr(server_module, "PARSE_WORKERS", 1)
    monkeypatch.setattr(server_module, "PARSE_QUEUE", 1)
    app = create_app(engine)
    with ServerThread(app, port=0) as server:
        answers: list[httpx.Response] = []

        def post() -> None:
            with httpx.Client(timeout=60) as http:
                answers.append(http.post(f"{server.url}/v1/completions", json=body()))

        threads = [threading.Thread(target=post) for _ in range(2)]  # one parsing (held there), one queued
        for t in threads:
            t.start()
        entered.acquire()  # the first is inside the parser
        while app.state.parsing.pending < 2:  # the second has been queued behind it
            time.sleep(0.01)
        with httpx.Client(timeout=60) as http:
            refused = http.post(f"{server.url}/v1/completions", json=body())
        gate.set()
        for t in threads:
            t.join()
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "server_busy"
    assert [a.status_code for a in answers] == [200, 200]
    assert app.state.parsing.pending == 0 and app.state.parsing.refused == 1


LOOPING = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[-1].content }}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("template, why", [(LOOPING, "did not finish"), ("{{ 'ab' * 10**9 }}", "size limit"),
                                           ("{{ 'a'|center(10**10) }}", "beyond the limit")])
def test_a_hostile_chat_template_is_a_400_and_the_server_goes_on(engine, monkeypatch, template, why):
    import mlsys.chat as chat

    monkeypatch.setattr(chat, "RENDER_TIME_LIMIT_S", 0.5)
    server = ServerThread(create_app(engine, chat_template=template), port=0).start()
    try:
        with httpx.Client(timeout=60) as http:
            r = http.post(f"{server.url}/v1/chat/completions",
                          json={"model": MODEL, "messages": [{"role": "user", "content": "ab"}], "max_tokens": 2})
            plain = http.post(f"{server.url}/v1/completions", json=body())
            health = http.get(f"{server.url}/health")
    finally:
        counts = server.stop()
    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert plain.status_code == 200 and health.status_code == 200
    assert counts["cut"] == 0


def closed_by_server(sock: socket.socket) -> bool:
    """Block until the server closes this connection (True), or until the guard timeout (False)."""
    sock.settimeout(30)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.timeout(120)
def test_idle_and_trickling_connections_are_closed_after_the_header_timeout(engine):
    server = ServerThread(create_app(engine), port=0, header_timeout=0.5).start()
    try:
        idle = socket.create_connection(("127.0.0.1", server.port))
        half = socket.create_connection(("127.0.0.1", server.port))
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        stop = threading.Event()

        def trickle(sock: socket.socket) -> None:  # one header byte at a time, faster than the timeout
            while not stop.wait(0.1):
                try:
                    sock.sendall(b"X")
                except OSError:
                    return

        slow = socket.create_connection(("127.0.0.1", server.port))
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        threading.Thread(target=trickle, args=(slow,), daemon=True).start()
        closed = [closed_by_server(s) for s in (idle, half, slow)]
        stop.set()
        with httpx.Client(timeout=60) as http:  # a keep-alive client: its second request on the same socket works
            first = http.post(f"{server.url}/v1/completions", json=body())
            second = http.post(f"{server.url}/v1/completions", json=body())
    finally:
        server.stop()
    assert closed == [True, True, True]
    assert first.status_code == second.status_code == 200


@pytest.mark.timeout(120)
def test_past_the_connection_limit_the_oldest_idle_connection_makes_room(engine):
    """8 connections at most. Counted by hand: 8 idle; a real request evicts idle[0] and closes its own; 20 more
    idle ones: the first fits, the next 19 evict idle[1:] and more[:12]; a last real request evicts more[12]."""
    import select

    server = ServerThread(create_app(engine), port=0, max_connections=8, header_timeout=60).start()
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
        with httpx.Client(timeout=60) as http:
            first = http.post(f"{server.url}/v1/completions", json=body(), headers={"connection": "close"})
            assert closed_by_server(idle[0])
            more = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
            last = http.post(f"{server.url}/v1/completions", json=body(), headers={"connection": "close"})
        evicted = [closed_by_server(s) for s in idle[1:] + more[:13]]
        readable, _, _ = select.select(more[13:], [], [], 0.5)  # still open and silent: nothing to read
    finally:
        server.stop()
    for s in idle + more:
        s.close()
    assert first.status_code == last.status_code == 200
    assert all(evicted) and readable == []


@pytest.mark.timeout(180)
def test_served_schemas_compile_in_worker_processes_that_end_with_the_server(tiny_model):
    """serve.py's setting: the automaton is built in another process (so it cannot hold this one's GIL against
    the engine thread), the answer is still valid, and shutdown leaves no worker process behind."""
    import os

    engine = Engine(tiny_model, config=EngineConfig(max_model_len=48, max_num_seqs=8))
    server = ServerThread(create_app(engine, schema_processes=True), port=0).start()
    schema = {"type": "integer", "minimum": 3, "maximum": 400}
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "{"}], "max_completion_tokens": 6,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
        workers = list(engine.schemas._pool._processes)
    finally:
        server.stop()
    assert r.status_code == 200, r.text
    assert 3 <= json.loads(r.json()["choices"][0]["message"]["content"]) <= 400
    fsm = engine.compile_schema(schema)  # from the cache: the automaton the request was decoded with
    assert fsm.compiled_in in workers and fsm.compiled_in != os.getpid()
    assert engine.schemas._pool is None and not any(os.path.exists(f"/proc/{pid}") for pid in workers)
