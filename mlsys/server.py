"""An OpenAI-compatible HTTP server over `mlsys.engine`.

    from mlsys.engine import Engine
    from mlsys.server import ServerThread, create_app
    app = create_app(Engine(load_pretrained("small")), model_name="mlsys-small")
    with ServerThread(app, port=0) as server:          # uvicorn in a thread; port 0 picks a free port
        print(server.url)                               # http://127.0.0.1:PORT/v1 for openai.OpenAI(base_url=...)

Endpoints: POST /v1/completions and POST /v1/chat/completions (stream true or false; streaming sends
Server-Sent Events, one `data: {json}` chunk per step that produced text and a final `data: [DONE]`),
GET /v1/models, GET /health. What a request body may hold, and the shapes of the answers: mlsys/protocol.py.

How a request travels (the front-end/engine-core split of vLLM's AsyncLLM and EngineCore):

    HTTP handler ── validate ──> AsyncEngine.generate() ── inbox.put(add) ──> engine thread
         ▲                              │ awaits its own asyncio.Queue            │ between two steps: drain the
         │ SSE chunks                   ▼                                         │ inbox (adds, aborts), step,
         └──────────────────── outputs, handed over with call_soon_threadsafe ◄───┘ publish a stats snapshot

The event loop never calls into the engine: a handler only puts a command into a thread-safe queue, and /health
reads the snapshot the engine thread published after its last step. So while a step computes, the loop keeps
accepting connections, validating requests and writing chunks. One engine thread serves every connection, so
requests that arrive while others decode join the next step (continuous batching across HTTP clients). A client
that goes away (a closed stream, a dropped connection) cancels its handler; the handler's `finally` queues an
abort, which the engine thread applies before its next step, freeing the request's KV blocks. An error while
adding a request ends that request alone; a step that raises ends the requests it was running (the engine cannot
yet tell which one broke it) and the server keeps serving the rest.

The arithmetic of a serving benchmark (TTFT, TPOT, ITL, throughput) lives with the benchmarks, in
mlsys/serving_metrics.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import queue
import sys
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlsys import openai_protocol as api
from mlsys.chat import NoChatTemplate, chat_body, chat_chunk
from mlsys.data import Tokenizer
from mlsys.engine import Engine, RequestOutput, SamplingParams
from mlsys.engine.request import FatalEngineError
from mlsys.json_constrained import SchemaCache
from mlsys.protocol import (  # noqa: F401  (parse_completion_request and RequestError are this module's API too)
    CompletionRequest,
    RequestError,
    completion_body,
    finish_reason_of,
    logprobs_of,
    parse_completion_request,
    sse_event,
    usage_of,
)

DEFAULT_MODEL_NAME = "mlsys-small"
MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused before it is parsed (413)
BODY_TIMEOUT_S = 30.0  # a body that stops arriving for this long is refused (408): a half-sent body holds nothing
HEALTH_STALL_S = 20.0  # /health says 503 when requests wait and no engine step has finished for this long
HEADER_TIMEOUT_S = 10.0  # a connection that has not sent a complete request head within this is closed
MAX_CONNECTIONS = 1000  # open connections at most; beyond, the oldest idle one is closed (or the newcomer)
PARSE_WORKERS = 4  # threads that validate bodies, render chat templates and compile schemas, off the event loop
# (at most 2 compile new schemas at once, mlsys/json_constrained.SchemaCache: the others stay free for the rest)
PARSE_QUEUE = 256  # bodies that may wait for one of them; beyond that a request gets 429 at once
GENERATION_FAILED = "the server failed while generating this request (details in the server log)"


# =========================================================================================== the front-end
# --8<-- [start:async_engine]
class AsyncEngine:
    """Many concurrent requests over one Engine, with the event loop never waiting on the engine.

    The event loop (HTTP handlers) only puts commands into `inbox`, a thread-safe queue, and reads a stats
    snapshot. One engine thread owns the Engine: between two steps it drains the inbox (adds and aborts),
    then steps, then hands each output to its request's asyncio.Queue through the loop's call_soon_threadsafe.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add", rid, ids, params) | ("abort", rid) | ("stop",)
        self.queues: dict[str, asyncio.Queue] = {}  # request id -> outputs not yet taken (event-loop thread only)
        self.num_received = 0  # requests handed to the engine thread
        self.num_aborted = 0  # requests whose client went away before they finished
        self.num_failed = 0  # requests ended by an error inside the engine
        self.num_finished = 0  # requests whose last output reached their handler
        self._snapshot: dict = engine.stats()  # replaced (never mutated) by the engine thread after every step
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead: Exception | None = None  # set if the engine thread itself failed
        self._thread: threading.Thread | None = None
        self.last_progress = time.monotonic()  # when the engine thread last finished a step
        self.step_started: float | None = None  # when the step now running began (None between steps)

    def stats(self) -> dict:
        """The engine's counters as of its last step: a read that never waits for a step to end."""
        return dict(self._snapshot)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is not None:
            self.inbox.put(("stop",))
            await asyncio.to_thread(self._thread.join)

    # ---------------------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        """The engine thread. Should its own loop break (a bug here, not in a request), every waiting handler
        gets the error and new requests are refused, rather than waiting forever for a thread that is gone."""
        try:
            self._serve()
        except Exception as err:
            self.dead = err
            print("[mlsys.server] the engine thread stopped; every request now fails with 503:\n"
                  + "".join(traceback.format_exception(err)), file=sys.stderr, flush=True)
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._fail_all, err)

    def _fail_all(self, err: Exception) -> None:  # runs on the event loop
        for q in self.queues.values():
            q.put_nowait(err)

    def _serve(self) -> None:
        """Drain the inbox (blocking while idle), step, publish; until "stop"."""
        while self._drain(block=not self.engine.has_unfinished()):
            self.last_progress = time.monotonic()  # the inbox was just drained: nothing waits on this thread
            if self.engine.has_unfinished():
                self.step_started = time.monotonic()
                try:
                    outputs = self.engine.step()  # the forward pass: only this thread ever waits for it
                except FatalEngineError:
                    raise  # no step can run any more (a tensor-parallel worker died): _run marks the engine dead
                except Exception as err:  # the engine isolates a failing request itself; this is the last resort
                    outputs = self._fail_running(err)
                self._send([self._failure(out) if out.finish_reason == "error" else out for out in outputs
                            if isinstance(out, RequestOutput)] + [o for o in outputs if isinstance(o, tuple)])
            self._snapshot = self.engine.stats()
            self.last_progress, self.step_started = time.monotonic(), None
        for rid in list(self.engine.requests):  # shutting down: free what is still in flight
            self.engine.abort(rid)
        with contextlib.suppress(Exception):
            self.engine.step()  # reports the aborts; every request is gone, so nothing is scheduled
        self._snapshot = self.engine.stats()

    def _drain(self, block: bool) -> bool:
        """Apply every queued add and abort; wait for the first one if the engine is idle. False on "stop"."""
        while True:
            try:
                cmd = self.inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd[0] == "stop":
                return False
            if cmd[0] == "abort":
                self.engine.abort(cmd[1])
                continue
            _, rid, ids, params = cmd
            try:
                self.engine.add_request(ids, params, request_id=rid)
            except Exception as err:
                self._send([(rid, err)])

    @staticmethod
    def _failure(out: RequestOutput) -> tuple[str, Exception]:
        """A request the engine ended with an error: log the details here, hand its handler the exception."""
        err = out.error if isinstance(out.error, Exception) else RuntimeError(str(out.error))
        print(f"[mlsys.server] request {out.request_id} failed inside the engine; the rest of its batch went on:\n"
              + "".join(traceback.format_exception(err)), file=sys.stderr, flush=True)
        return out.request_id, err

    def _fail_running(self, err: Exception) -> list:
        """A step raised: the requests it was running get the error and are aborted; waiting ones stay queued."""
        failed = [s.request_id for s in self.engine.scheduler.running]
        for rid in failed:
            self.engine.abort(rid)  # frees its blocks now; the next step reports the abort to nobody
        return [(rid, err) for rid in failed]

    def _send(self, outputs: list) -> None:
        """Hand outputs (RequestOutput, or (request id, error)) to the event loop; never waits for it."""
        if outputs:
            with contextlib.suppress(RuntimeError):  # the loop is already closed: nobody is listening
                self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list) -> None:  # runs on the event loop
        for out in outputs:
            rid, item = out if isinstance(out, tuple) else (out.request_id, out)
            q = self.queues.get(rid)
            if q is not None:
                q.put_nowait(item)

    # ------------------------------------------------------------------------- the event-loop side
    def health(self, stall_limit: float) -> tuple[bool, str]:
        """(healthy, why not). Unhealthy when the engine thread died or never started properly, or when work is
        waiting and no step has finished for `stall_limit` seconds (a step stuck on a stopped tensor-parallel
        worker, or a wedged forward). An idle engine is healthy however long it has been idle."""
        if self.dead is not None:
            return False, f"the engine thread stopped: {type(self.dead).__name__}"
        if self._thread is not None and not self._thread.is_alive():
            return False, "the engine thread is not running"
        now, started = time.monotonic(), self.step_started   # read once: the engine thread may reset it
        if started is not None and now - started > stall_limit:
            return False, f"no engine step has finished for {now - started:.0f} s while requests wait"
        if not self.inbox.empty() and now - self.last_progress > stall_limit:   # commands nobody picks up
            return False, f"the engine thread has not taken new requests for {now - self.last_progress:.0f} s"
        return True, ""

    def check_alive(self) -> None:
        if self.dead is not None:
            raise RequestError("the engine stopped after an internal error (see the server log); restart the "
                               "server", status=503, code="engine_dead")

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step (those of its n answers, told apart by .index) until every
        answer has finished. Leaving early aborts it."""
        self.check_alive()
        q: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = q
        finished, unfinished = False, params.n
        try:
            self.inbox.put(("add", request_id, prompt_ids, params))  # never blocks: the engine thread adds it
            self.num_received += 1
            while not finished:
                out = await q.get()
                if isinstance(out, Exception):
                    finished = True  # the engine has already dropped it
                    self.num_failed += 1
                    raise out
                unfinished -= out.finished
                finished = unfinished == 0
                self.num_finished += finished
                yield out
        finally:  # runs on normal exit, on an exception, and when the client's task is cancelled
            self.queues.pop(request_id, None)
            if not finished:
                self.inbox.put(("abort", request_id))  # a cancelled task cannot await; a put never blocks
                self.num_aborted += 1
# --8<-- [end:async_engine]


# ================================================================================================ the app
class _MarkAnswered:
    """ASGI middleware: remembers each request's task as its last response bytes are handed to the server. Such a
    task may still be finishing when shutdown counts what is in flight; it is not."""

    def __init__(self, app: Any, answered: weakref.WeakSet) -> None:
        self.app, self.answered = app, answered

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        task = asyncio.current_task()  # uvicorn runs the whole request in this one task

        async def marking_send(message: dict) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.answered.add(task)  # before the bytes go out: once the client has them, the mark is there
            await send(message)

        await self.app(scope, receive, marking_send)


def create_app(engine: Engine, model_name: str = DEFAULT_MODEL_NAME, api_key: str | None = None,
               body_timeout: float = BODY_TIMEOUT_S, chat_template: str | NoChatTemplate | None = None,
               health_stall_s: float = HEALTH_STALL_S, sampling_defaults: dict | None = None,
               schema_processes: bool = False) -> FastAPI:
    """The FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health over one AsyncEngine
    (app.state.async_engine). Chat prompts use `chat_template` (a checkpoint's Jinja template; a NoChatTemplate
    refuses chat with its reason, for a folder that ships none) or, with None,
    the book's template (mlsys/chat.py).

    With `api_key`, every /v1 route wants the header OpenAI clients send, `Authorization: Bearer <key>` (401
    otherwise); /health stays open for load balancers. A body that stalls for `body_timeout` s gets a 408.
    `schema_processes`: compile response_format schemas in two worker processes (mlsys/json_constrained.SchemaCache;
    serve.py does; the calling script needs the `if __name__ == "__main__":` guard that any multiprocessing needs)."""
    front = AsyncEngine(engine)
    parsing = _BoundedPool(PARSE_WORKERS, PARSE_QUEUE)
    if schema_processes and engine.schemas is None and isinstance(engine.tokenizer, Tokenizer):
        engine.schemas = SchemaCache(engine.tokenizer, in_processes=True)  # compiling cannot take the GIL from steps

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise RequestError("Incorrect API key provided: send the header 'Authorization: Bearer <key>'",
                               status=401, code="invalid_api_key")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await front.start()
        yield
        parsing.shutdown()
        await front.stop()
        if engine.schemas is not None:
            await asyncio.to_thread(engine.schemas.close)

    # with a key, the interactive docs and the OpenAPI document are switched off: every route but /health
    # answers only a client that holds the key, and those three routes cannot check one
    docs = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="mlsys inference server", lifespan=lifespan, **docs)
    app.state.answered = weakref.WeakSet()  # tasks whose response is complete (ServerThread.stop reads it)
    app.add_middleware(_MarkAnswered, answered=app.state.answered)
    app.state.async_engine = front
    app.state.parsing = parsing
    started = int(time.time())

    @app.exception_handler(RequestError)
    async def request_error(_: Request, err: RequestError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:  # 404, 405: OpenAI's shape
        return JSONResponse(RequestError(str(err.detail), status=err.status_code).body(),
                            status_code=err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, err: Exception) -> JSONResponse:  # a bug: no internals to the client
        print("[mlsys.server] unexpected error while handling a request:\n"
              + "".join(traceback.format_exception(err)), file=sys.stderr, flush=True)
        return JSONResponse(RequestError("internal server error (see the server log)", status=500,
                                         code="internal_error").body(), status_code=500)

    def openapi() -> dict:
        """FastAPI's document, plus the request bodies: the handlers read raw bytes (to bound their size and
        time), so FastAPI cannot see the models they validate against; they are added here."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in (api.CompletionRequest, api.ChatCompletionRequest):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(js.pop("$defs", {}))
                _document_limits(js, model_name, engine)
                schemas[model.__name__] = js
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/health", responses={200: {"model": api.Health}, 503: {"model": api.Health}})
    async def health():
        s = front.stats()  # the engine thread's last snapshot: answers at once, even mid-step
        ok, why = front.health(health_stall_s)
        body = {"status": "ok" if ok else "unhealthy", "num_running": s["num_running"],
                "num_waiting": s["num_waiting"], "num_free_blocks": s["num_free_blocks"],
                "num_total_blocks": s["num_total_blocks"], **({} if ok else {"reason": why})}
        return body if ok else JSONResponse(body, status_code=503)  # a load balancer takes this replica out

    @app.get("/v1/models", responses={200: {"model": api.ModelList}, **_ERRORS})
    async def models(request: Request) -> dict:
        check_key(request)
        card = {"id": model_name, "object": "model", "created": started, "owned_by": "mlsys",
                "max_model_len": engine.config.max_model_len}
        return {"object": "list", "data": [card]}

    # --8<-- [start:completions]
    @app.post("/v1/completions", openapi_extra=_body("CompletionRequest"), responses=_answers(api.Completion))
    async def completions(request: Request):
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_body("ChatCompletionRequest"),
              responses=_answers(api.ChatCompletion))
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    async def answer(request: Request, chat: bool):
        check_key(request)
        raw = await read_body(request, timeout=body_timeout)
        # on a small pool of threads: compiling a response_format schema may take a few tenths of a second (bounded
        # in mlsys/json_constrained.py) and a chat template up to its time limit (mlsys/chat.py); the event loop
        # keeps serving everyone else meanwhile, and a burst beyond the pool and its queue is a 429 at once
        req = await parsing.run(parse_completion_request, raw, engine, model_name, chat, chat_template,
                                sampling_defaults)
        front.check_alive()  # before a stream starts: its status line must say 503
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        outputs = front.generate(req.prompt_ids, req.params, rid)
        if req.stream:
            return StreamingResponse(_stream(outputs, rid, model_name, created, req.include_usage, chat,
                                             engine.tokenizer),
                                     media_type="text/event-stream")
        try:
            final = await _collect(outputs, request)
        except RequestError:
            raise
        except Exception:  # the engine failed this request (and only this one); details are in the server log
            raise RequestError(GENERATION_FAILED, status=500, code="generation_failed") from None
        if final is None:  # the client left; nobody reads this
            return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
        shape = chat_body if chat else completion_body
        body = shape(rid, model_name, created, final[0].text, finish_reason_of(final[0]), usage_of(final),
                     logprobs=logprobs_of(final[0], engine.tokenizer, chat))
        for out in final[1:]:  # n > 1: one choice per answer, by index
            more = shape(rid, model_name, created, out.text, finish_reason_of(out), None,
                         logprobs=logprobs_of(out, engine.tokenizer, chat))
            body["choices"].append({**more["choices"][0], "index": out.index})
        return JSONResponse(body)
    # --8<-- [end:completions]

    return app


_ERRORS = {status: {"model": api.ErrorResponse, "description": why} for status, why in (
    (400, "a body the server refuses, with the reason"), (401, "a missing or wrong API key"),
    (404, "an unknown model or route"), (408, "a body that stopped arriving"), (413, "a body over the size limit"),
    (429, "busy: retry after the Retry-After header's seconds"), (503, "the engine stopped"))}


def _document_limits(js: dict, model_name: str, engine: Engine) -> None:
    """What this server accepts beyond the generic models, written into its document: the one model it serves,
    the context length, and for the book's character tokenizer the characters a prompt may hold."""
    props = js["properties"]
    props["model"]["enum"] = [model_name]
    for key in ("max_tokens", "max_completion_tokens"):
        if key in props:
            props[key]["anyOf"][0].update(minimum=1, maximum=engine.config.max_model_len - 1)
    if "prompt" in props and isinstance(engine.tokenizer, Tokenizer):
        chars = "".join(c for c in engine.tokenizer.itos if len(c) == 1)
        cls = "".join("\\" + c if c in "\\]^-[" else c for c in chars)
        props["prompt"]["anyOf"][0].update(pattern=f"^[{cls}]+$", maxLength=engine.config.max_model_len - 2)


def _body(model: str) -> dict:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}}}}


def _answers(model: type) -> dict:
    """The 200 of a generation route: JSON, or with "stream": true Server-Sent Events of chunks."""
    return {200: {"model": model, "description": "the answer; with \"stream\": true, Server-Sent Events",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}, **_ERRORS}


class _BoundedPool:
    """A few threads for request parsing, with a bounded queue: `run` answers 429 (RequestError) at once when
    `workers + queue` jobs are already pending, instead of letting a burst of expensive bodies pile up. A job
    counts as pending until its thread is done with it, even if its client has gone away meanwhile."""

    def __init__(self, workers: int, queue: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="parse")
        self.limit, self.pending, self.lock = workers + queue, 0, threading.Lock()
        self.refused = 0  # requests answered 429 (an observation for tests and /metrics-style reads)

    async def run(self, fn: Any, *args: Any) -> Any:
        with self.lock:
            if self.pending >= self.limit:
                self.refused += 1
                raise RequestError("the server is busy validating other requests; retry shortly", status=429,
                                   code="server_busy", headers={"Retry-After": "1"})
            self.pending += 1
        try:
            future = self.pool.submit(fn, *args)
        except RuntimeError:  # shutting down
            self._done(None)
            raise RequestError("the server is shutting down", status=503, code="shutting_down") from None
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def _done(self, _: Any) -> None:  # the worker thread, when a job ends (or at once if it was never queued)
        with self.lock:
            self.pending -= 1

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


async def read_body(request: Request, limit: int = MAX_BODY_BYTES, timeout: float = BODY_TIMEOUT_S) -> bytes:
    """The request body, refused (413) as soon as it is known to exceed `limit`: from Content-Length before
    reading anything, or while it streams in (a chunked body has no length up front). A client that stops
    sending for `timeout` seconds mid-body gets a 408, so a half-sent body cannot hold a handler (or shutdown)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(f"request body of {declared} bytes exceeds the limit of {limit}", status=413)
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), timeout)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise RequestError(f"request body not received within {timeout:g} s", status=408,
                               code="request_timeout") from None
        size += len(chunk)
        if size > limit:
            raise RequestError(f"request body exceeds the limit of {limit} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


# --8<-- [start:stream]
async def _stream(outputs: AsyncIterator[RequestOutput], rid: str, model: str, created: int,
                  include_usage: bool, chat: bool = False, tokenizer: Any = None) -> AsyncIterator[bytes]:
    """SSE chunks: one per step that produced text (and the last one, with its finish_reason), then [DONE].
    A chat stream opens with the assistant's role and carries its text as deltas (mlsys/chat.py)."""
    last: dict[int, RequestOutput] = {}  # the latest output of each of the n answers
    try:
        async for out in outputs:
            if chat and out.index not in last:  # each answer's stream opens with the assistant's role
                yield sse_event(chat_chunk(rid, model, created, {"role": "assistant", "content": ""},
                                           index=out.index))
            last[out.index] = out
            speaks = out.new_text or out.finished or (out.logprobs is not None and out.new_token_ids)
            if chat and speaks:
                delta = {"content": out.new_text} if out.new_text else {}
                yield sse_event(chat_chunk(rid, model, created, delta, finish_reason_of(out),
                                           logprobs=logprobs_of(out, tokenizer, True, new_only=True),
                                           index=out.index))
            elif speaks:
                yield sse_event(completion_body(rid, model, created, out.new_text, finish_reason_of(out),
                                                logprobs=logprobs_of(out, tokenizer, False, new_only=True),
                                                index=out.index))
    except Exception:  # the engine failed mid-stream: tell the client in-band, then end the stream
        yield sse_event(RequestError(GENERATION_FAILED, status=500, code="generation_failed").body())
    finally:
        await outputs.aclose()  # a cancelled stream (client gone) closes the generator: its abort is queued
    if include_usage and last:
        usage = usage_of(list(last.values()))
        yield sse_event(chat_chunk(rid, model, created, None, usage=usage) if chat else
                        completion_body(rid, model, created, "", None, usage, with_choice=False))
    yield sse_event("[DONE]")
# --8<-- [end:stream]


async def _collect(outputs: AsyncIterator[RequestOutput], request: Request) -> list[RequestOutput] | None:
    """The final outputs of a non-streaming request (one per answer, by index), or None if the client disconnects
    first (then aborted)."""

    async def last() -> list[RequestOutput]:
        final = {}
        async for out in outputs:
            final[out.index] = out
        return [final[i] for i in sorted(final)]

    task = asyncio.ensure_future(last())
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.2)  # idle wait; the engine loop does the work
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None


# ============================================================================= a server in a thread
class _CutCounter(logging.Filter):
    """Counts the tasks uvicorn cancels at the end of a graceful shutdown and drops its log lines about them
    (one traceback per cut request otherwise): ServerThread.stop reports the count instead."""

    def __init__(self) -> None:
        super().__init__()
        self.cut = 0
        self.thread_id: int | None = None  # the server thread whose records these are: others pass untouched

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self.thread_id:  # another server in this process (each has its own thread)
            return True
        if str(record.msg).startswith("Cancel %s running task"):
            self.cut += int(record.args[0])
            return False
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, asyncio.CancelledError)


def _guarded_protocol(header_timeout: float, max_connections: int) -> type:
    """uvicorn's h11 protocol with two guards it lacks, so idle or half-sent connections cannot use up the
    process's file descriptors (and with them, every real client's chance to connect):

    - a connection must send a complete request head within `header_timeout` seconds of opening, and of its
      previous answer (uvicorn's own keep-alive timer is reset by any byte, so one byte a second kept it open);
    - at most `max_connections` are open: a new one first closes the oldest connection with no request in
      progress; if every connection is busy with a request, the newcomer is closed instead."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Guarded(H11Protocol):
        opened = 0.0
        head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.opened = time.monotonic()
            live = [c for c in self.connections if not c.transport.is_closing()]  # closed ones may linger a moment
            if len(live) > max_connections:
                idle = [c for c in live if c is not self and not c.busy()]
                victim = min(idle, key=lambda c: c.opened) if idle else self
                victim.transport.close()
            self.arm()

        def busy(self) -> bool:  # a request head has arrived and its answer is not complete
            return self.cycle is not None and not self.cycle.response_complete

        def arm(self) -> None:
            self.disarm()
            self.head_timer = self.loop.call_later(header_timeout, self.head_timeout)

        def disarm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def head_timeout(self) -> None:
            self.head_timer = None
            if not self.busy() and not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.busy():
                self.disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.busy():
                self.arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self.disarm()
            super().connection_lost(exc)

    return Guarded


def _raise_open_file_limit() -> int:
    """Lift this process's soft limit on open files to the hard limit (as vLLM does); returns the new soft one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


class ServerThread:
    """uvicorn serving `app` from a background thread: for tests, scripts and notebooks.

    `port=0` asks the OS for a free port; `.port` and `.url` tell which one it got once `start()` returns.
    Idle and half-sent connections are closed after `header_timeout` s, and at most `max_connections` are open
    (see _guarded_protocol). `stop()` drains: the socket stops accepting, requests in flight run to their end
    for up to `grace_seconds`, then whatever is left is cut (its task cancelled, its request aborted, its KV
    blocks freed).
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 grace_seconds: float = 10.0, header_timeout: float = HEADER_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        import uvicorn

        files = _raise_open_file_limit()  # each connection holds one; keep some for the model, logs, the store
        protocol = _guarded_protocol(header_timeout, max(1, min(max_connections, files - 64)))
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", http=protocol,
                                timeout_graceful_shutdown=max(grace_seconds, 1e-3))  # uvicorn reads 0 as "no limit"
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.host, self.port, self.grace_seconds = host, port, grace_seconds
        self.front: AsyncEngine | None = getattr(getattr(app, "state", None), "async_engine", None)
        self.answered = getattr(getattr(app, "state", None), "answered", ())  # requests already answered
        self._forced: set = set()  # the tasks force() cancelled
        self._cuts = _CutCounter()  # from the start: a second signal may cut before stop() begins

    def start(self, timeout: float = 30.0) -> ServerThread:
        logging.getLogger("uvicorn.error").addFilter(self._cuts)
        self.thread.start()
        self._cuts.thread_id = self.thread.ident
        deadline = time.monotonic() + timeout
        while not self.server.started:  # uvicorn sets it once the socket listens
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.01)  # waiting for the server thread, not standing in for work
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float | None = None) -> dict[str, int]:
        """Drain and stop; returns {"in_flight", "drained", "cut"}: HTTP requests being handled when stop began
        (streams, plain completions, bodies still arriving), how many ended by themselves, how many were cut at
        the grace period (or by `force()`). uvicorn's per-task traceback for a cut is replaced by that count."""
        # one C-level copy under the GIL; a task whose answer is complete was not in flight, even if it has not
        # returned yet (or its removal from the set is still queued on the loop)
        at_stop = {task for task in set(self.server.server_state.tasks)
                   if not task.done() and task not in self.answered}
        deadline = time.monotonic() + (timeout if timeout is not None else self.grace_seconds + 30.0)
        try:
            self.server.should_exit = True
            if self.grace_seconds <= 0:  # no grace: cut now, not at uvicorn's next tick (0.1 s, in which a tiny
                self.force()             # model can finish a whole stream and turn a cut into a drain)
            while self.thread.is_alive() and time.monotonic() < deadline:
                # Short waits: Python runs a signal handler (a second Ctrl-C calling force()) only between
                # bytecodes of the main thread, and a long join may never see the signal if the kernel
                # delivered it to another thread.
                self.thread.join(0.05)
        finally:
            logging.getLogger("uvicorn.error").removeFilter(self._cuts)
        if self.thread.is_alive():
            raise RuntimeError("the server thread did not stop")
        in_flight = len(at_stop | self._forced)  # force() may have run first and its tasks ended already
        cut = min(self._cuts.cut + len(self._forced), in_flight)  # a task force() cancelled is not cancelled twice
        return {"in_flight": in_flight, "drained": in_flight - cut, "cut": cut}

    def force(self) -> None:
        """Stop draining now (a second Ctrl-C): cut every request still in flight, as the grace period would."""
        loop = self.front._loop if self.front is not None else None
        if loop is None:
            self.server.force_exit = True
            return

        def cut_all() -> None:
            for task in list(self.server.server_state.tasks):
                if task not in self.answered and task.cancel():  # False for a task that has already ended
                    self._forced.add(task)
            loop.call_later(0.05, cut_all)  # and any request whose headers were still on their way: until the end

        with contextlib.suppress(RuntimeError):  # the loop has already closed: nothing left to cut
            loop.call_soon_threadsafe(cut_all)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
