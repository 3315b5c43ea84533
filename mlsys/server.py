"""An OpenAI-compatible HTTP server over `mlsys.engine`, and the serving metrics of its benchmarks.

    from mlsys.engine import Engine
    from mlsys.server import ServerThread, create_app
    app = create_app(Engine(load_pretrained("small")), model_name="mlsys-small")
    with ServerThread(app, port=0) as server:          # uvicorn in a thread; port 0 picks a free port
        print(server.url)                               # http://127.0.0.1:PORT/v1 for openai.OpenAI(base_url=...)

Endpoints: POST /v1/completions (stream true or false; streaming sends Server-Sent Events, one
`data: {json}` chunk per step that produced text and a final `data: [DONE]`), GET /v1/models, GET /health.

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

The second half of the file is the arithmetic of a serving benchmark (TTFT, TPOT, ITL, throughput) and its
report in the layout of vLLM's `benchmarks/benchmark_serving.py`, shared by the chapter's benchmark scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import queue
import sys
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlsys.chat import ChatError, chat_body, chat_chunk, normalize_messages, render_book, render_template
from mlsys.engine import Engine, RequestOutput, SamplingParams
from mlsys.engine.tokenizer import encode_prompt

DEFAULT_MODEL_NAME = "mlsys-small"
SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused before it is parsed (413)
BODY_TIMEOUT_S = 30.0  # a body that stops arriving for this long is refused (408): a half-sent body holds nothing
GENERATION_FAILED = "the server failed while generating this request; other requests were not affected"


# ===================================================================================== request validation
class RequestError(Exception):
    """A request the server refuses: an HTTP status and a message for the client (OpenAI's error shape)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate cannot be sent
        param = None if param is None else param.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass
class CompletionRequest:
    """A validated POST /v1/completions body."""

    prompt_ids: list[int]  # <bos> + the prompt's characters (or the ids the client sent)
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with token counts


# Fields we accept and fields OpenAI defines that we refuse unless they hold their neutral value.
_ACCEPTED = {"model", "prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "stream", "stream_options",
             "ignore_eos", "user", "n", "best_of", "echo", "logprobs", "stop", "suffix", "presence_penalty",
             "frequency_penalty", "logit_bias"}
_NEUTRAL = {"n": (1,), "best_of": (1, None), "echo": (False, None),
            "suffix": (None, ""), "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None),
            "logit_bias": (None, {})}
# /v1/chat/completions: messages instead of a prompt, and the chat API's own optional fields
_CHAT_ACCEPTED = (_ACCEPTED - {"prompt", "best_of", "echo", "suffix"}) | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls"}
_CHAT_NEUTRAL = {**{k: v for k, v in _NEUTRAL.items() if k in _CHAT_ACCEPTED},
                 "top_logprobs": (None, 0), "response_format": (None, {"type": "text"}), "tools": (None, []),
                 "tool_choice": (None, "none"), "parallel_tool_calls": (None, True, False)}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true is not a number


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# --8<-- [start:validate]
def parse_completion_request(raw: bytes, engine: Engine, model_name: str, chat: bool = False,
                             chat_template: str | None = None) -> CompletionRequest:
    """Check a request body against the model and the engine; RequestError (4xx) with a clear message if bad.
    chat: a /v1/chat/completions body, whose messages become the prompt (mlsys/chat.py)."""
    accepted, neutral = (_CHAT_ACCEPTED, _CHAT_NEUTRAL) if chat else (_ACCEPTED, _NEUTRAL)
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError("request body is nested too deeply") from None
    except ValueError as err:  # bad JSON, bad UTF-8, an integer of more than 4300 digits
        raise RequestError(f"request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    for key in body:
        if key not in accepted:
            raise RequestError(f"unrecognized request argument {key!r}", param=key)
        if key in neutral and body[key] not in neutral[key]:
            raise RequestError(f"{key}={body[key]!r} is not supported by this server", param=key)
    for key in ("model", "messages" if chat else "prompt"):
        if key not in body:
            raise RequestError(f"missing required argument {key!r}", param=key)
    if not isinstance(body["model"], str):
        raise RequestError("'model' must be a string", param="model")
    if body["model"] != model_name:
        raise RequestError(f"the model {body['model']!r} does not exist; this server serves {model_name!r}",
                           status=404, param="model", code="model_not_found")
    ids = _chat_ids(body["messages"], engine, chat_template) if chat else _prompt_ids(body["prompt"], engine)
    max_len = engine.config.max_model_len
    if chat:  # the chat API's default: as many tokens as the context leaves
        given = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = max(1, max_len - len(ids)) if given is None else given
    else:
        max_tokens = body.get("max_tokens", 16)  # OpenAI's default
    if not _is_int(max_tokens):
        raise RequestError(f"'max_tokens' must be an integer, got {max_tokens!r}", param="max_tokens")
    if max_tokens < 1 or len(ids) + max_tokens > max_len:
        raise RequestError(f"this model's maximum context length is {max_len} tokens: the prompt has {len(ids)}, "
                           f"so max_tokens must be between 1 and {max_len - len(ids)}, got {max_tokens}",
                           param="max_tokens")
    temperature = body.get("temperature", 1.0)  # OpenAI's default: sampling, not greedy
    if not _is_number(temperature) or not 0 <= temperature <= 2:
        raise RequestError(f"'temperature' must be a number in [0, 2], got {temperature!r}", param="temperature")
    top_p = body.get("top_p", 1.0)
    if top_p is None:
        top_p = 1.0
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise RequestError(f"'top_p' must be a number in (0, 1], got {top_p!r}", param="top_p")
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or (top_k < 1 and top_k != -1)):
        raise RequestError(f"'top_k' must be a positive integer or -1 (off), got {top_k!r}", param="top_k")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**63):
        raise RequestError(f"'seed' must be a 64-bit integer, got {seed!r}", param="seed")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(x, str) for x in stop):
        raise RequestError("'stop' must be a string or a list of at most 4 strings", param="stop")
    flags = {k: body.get(k, False) for k in ("stream", "ignore_eos")}
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise RequestError(f"{key!r} must be true or false, got {value!r}", param=key)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError("'stream_options' must be an object like {\"include_usage\": true}",
                           param="stream_options")
    if options and not flags["stream"]:
        raise RequestError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    logprobs = body.get("logprobs")  # chat: true/false; completions: how many alternatives (0: none)
    if chat and logprobs is not None and not isinstance(logprobs, bool):
        raise RequestError(f"'logprobs' must be true or false, got {logprobs!r}", param="logprobs")
    if not chat and logprobs is not None and (not _is_int(logprobs) or logprobs != 0):
        raise RequestError(f"logprobs={logprobs!r} is not supported by this server: 0 returns the log-prob of "
                           f"each sampled token; alternatives are not returned yet", param="logprobs")
    if temperature < SAMPLING_EPS:  # below this, dividing the logits overflows: treated as greedy, as vLLM does
        temperature = 0.0
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=float(temperature),
                            top_k=None if top_k in (None, -1) or top_k >= vocab else top_k,  # >= V: no cut
                            top_p=float(top_p), seed=seed % 2**64 if seed is not None else None,
                            ignore_eos=flags["ignore_eos"], stop=tuple(x for x in stop if x),
                            logprobs=logprobs is True if chat else logprobs is not None)
    return CompletionRequest(ids, params, flags["stream"], bool(options.get("include_usage", False)))
# --8<-- [end:validate]


def _chat_ids(messages: Any, engine: Engine, template: str | None) -> list[int]:
    """The messages rendered by the checkpoint's chat template, or by the book's (the last user message)."""
    tok = engine.tokenizer
    try:
        messages = normalize_messages(messages)
        if template is None:
            return encode_prompt(tok, render_book(messages))
        special = getattr(tok, "token_text", lambda i: "")
        text = render_template(template, messages, special(tok.bos_id), special(tok.eos_id))
        return tok.encode(text)  # the template writes the special tokens it wants
    except ChatError as err:
        raise RequestError(str(err), param=err.param) from None
    except ValueError as err:  # a character outside the model's alphabet
        raise RequestError(f"'messages' cannot be tokenized: {err}", param="messages") from None


def _prompt_ids(prompt: Any, engine: Engine) -> list[int]:
    """A text prompt (or a one-element list of one) -> <bos> + characters; a list of ints is taken as ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("'prompt' is empty", param="prompt")
        try:
            return encode_prompt(engine.tokenizer, prompt)
        except ValueError as err:  # a character outside the model's alphabet
            raise RequestError(f"'prompt' cannot be tokenized: {err}", param="prompt") from None
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        vocab = engine.model.config.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise RequestError(f"'prompt' token ids must lie in [0, {vocab})", param="prompt")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise RequestError("batched prompts are not supported; send one prompt per request", param="prompt")
    if isinstance(prompt, list) and not prompt:
        raise RequestError("'prompt' is empty", param="prompt")
    raise RequestError(f"'prompt' must be a string or a list of token ids, got {type(prompt).__name__}",
                       param="prompt")


# ======================================================================================== response bodies
# --8<-- [start:sse]
def sse_event(payload: dict | str) -> bytes:
    """One Server-Sent Event: `data: <json>` and a blank line (the [DONE] sentinel is sent as plain text)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def completion_body(request_id: str, model: str, created: int, text: str, finish_reason: str | None,
                    usage: dict | None = None, with_choice: bool = True, logprobs: dict | None = None) -> dict:
    """An OpenAI `text_completion` object: the whole answer, or one streamed chunk of it."""
    choices = [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}] if with_choice else []
    body = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body
# --8<-- [end:sse]


def logprobs_of(out: RequestOutput, tokenizer, chat: bool, new_only: bool = False) -> dict | None:
    """The log-probs block of a choice, for the tokens of `out` (or only this step's): OpenAI's completions shape
    (tokens, token_logprobs, text_offset) or its chat shape (content: token, logprob, bytes); None if not asked."""
    if out.logprobs is None:
        return None
    ids = out.new_token_ids if new_only else out.token_ids
    values = out.logprobs[len(out.logprobs) - len(ids):]
    tokens = [tokenizer.decode([i]) for i in ids]
    if chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "replace")), "top_logprobs": []}
                            for t, lp in zip(tokens, values)]}
    offsets = np.cumsum([0] + [len(t) for t in tokens[:-1]]).tolist() if tokens else []
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}


def usage_of(out: RequestOutput) -> dict:
    n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def finish_reason_of(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finish_reason in ("stop", "length") else None


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
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()  # the forward pass: only this thread ever waits for it
                except Exception as err:  # the engine isolates a failing request itself; this is the last resort
                    outputs = self._fail_running(err)
                self._send([self._failure(out) if out.finish_reason == "error" else out for out in outputs
                            if isinstance(out, RequestOutput)] + [o for o in outputs if isinstance(o, tuple)])
            self._snapshot = self.engine.stats()
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
    def check_alive(self) -> None:
        if self.dead is not None:
            raise RequestError("the engine stopped after an internal error (see the server log); restart the "
                               "server", status=503, code="engine_dead")

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step until it finishes. Leaving early aborts it."""
        self.check_alive()
        q: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = q
        finished = False
        try:
            self.inbox.put(("add", request_id, prompt_ids, params))  # never blocks: the engine thread adds it
            self.num_received += 1
            while not finished:
                out = await q.get()
                if isinstance(out, Exception):
                    finished = True  # the engine has already dropped it
                    self.num_failed += 1
                    raise out
                finished = out.finished
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
               body_timeout: float = BODY_TIMEOUT_S, chat_template: str | None = None) -> FastAPI:
    """The FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health over one AsyncEngine
    (app.state.async_engine). Chat prompts use `chat_template` (a checkpoint's Jinja template) or, without one,
    the book's template (mlsys/chat.py).

    With `api_key`, every /v1 route wants the header OpenAI clients send, `Authorization: Bearer <key>` (401
    otherwise); /health stays open for load balancers. A body that stalls for `body_timeout` s gets a 408."""
    front = AsyncEngine(engine)

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
        await front.stop()

    app = FastAPI(title="mlsys inference server", lifespan=lifespan)
    app.state.answered = weakref.WeakSet()  # tasks whose response is complete (ServerThread.stop reads it)
    app.add_middleware(_MarkAnswered, answered=app.state.answered)
    app.state.async_engine = front
    started = int(time.time())

    @app.exception_handler(RequestError)
    async def request_error(_: Request, err: RequestError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

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

    @app.get("/health")
    async def health() -> dict:
        s = front.stats()  # the engine thread's last snapshot: answers at once, even mid-step
        return {"status": "ok", "num_running": s["num_running"], "num_waiting": s["num_waiting"],
                "num_free_blocks": s["num_free_blocks"], "num_total_blocks": s["num_total_blocks"]}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        check_key(request)
        card = {"id": model_name, "object": "model", "created": started, "owned_by": "mlsys",
                "max_model_len": engine.config.max_model_len}
        return {"object": "list", "data": [card]}

    # --8<-- [start:completions]
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    async def answer(request: Request, chat: bool):
        check_key(request)
        req = parse_completion_request(await read_body(request, timeout=body_timeout), engine, model_name, chat,
                                       chat_template)
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
        return JSONResponse(shape(rid, model_name, created, final.text, finish_reason_of(final), usage_of(final),
                                  logprobs=logprobs_of(final, engine.tokenizer, chat)))
    # --8<-- [end:completions]

    return app


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
    last = None
    try:
        if chat:
            yield sse_event(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
        async for out in outputs:
            last = out
            speaks = out.new_text or out.finished or (out.logprobs is not None and out.new_token_ids)
            if chat and speaks:
                delta = {"content": out.new_text} if out.new_text else {}
                yield sse_event(chat_chunk(rid, model, created, delta, finish_reason_of(out),
                                           logprobs=logprobs_of(out, tokenizer, True, new_only=True)))
            elif speaks:
                yield sse_event(completion_body(rid, model, created, out.new_text, finish_reason_of(out),
                                                logprobs=logprobs_of(out, tokenizer, False, new_only=True)))
    except Exception:  # the engine failed mid-stream: tell the client in-band, then end the stream
        yield sse_event(RequestError(GENERATION_FAILED, status=500, code="generation_failed").body())
    finally:
        await outputs.aclose()  # a cancelled stream (client gone) closes the generator: its abort is queued
    if include_usage and last is not None:
        yield sse_event(chat_chunk(rid, model, created, None, usage=usage_of(last)) if chat else
                        completion_body(rid, model, created, "", None, usage_of(last), with_choice=False))
    yield sse_event("[DONE]")
# --8<-- [end:stream]


async def _collect(outputs: AsyncIterator[RequestOutput], request: Request) -> RequestOutput | None:
    """The final output of a non-streaming request, or None if the client disconnects first (then aborted)."""

    async def last() -> RequestOutput:
        final = None
        async for out in outputs:
            final = out
        return final

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


class ServerThread:
    """uvicorn serving `app` from a background thread: for tests, scripts and notebooks.

    `port=0` asks the OS for a free port; `.port` and `.url` tell which one it got once `start()` returns.
    `stop()` drains: the socket stops accepting, requests in flight run to their end for up to `grace_seconds`,
    then whatever is left is cut (its task cancelled, its request aborted, its KV blocks freed).
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 grace_seconds: float = 10.0) -> None:
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
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


# ================================================================================= serving metrics
# --8<-- [start:metrics]
def request_latencies(arrival: float, token_times: list[float]) -> dict[str, Any]:
    """One request's latencies (seconds) from its arrival time and the time each output token was produced.

    TTFT = first token - arrival. ITL = the gaps between consecutive tokens (n - 1 of them).
    TPOT = (last token - first token) / (n - 1): the mean ITL of this request; undefined for n = 1.
    """
    ttft = token_times[0] - arrival
    itl = list(np.diff(token_times)) if len(token_times) > 1 else []
    tpot = (token_times[-1] - token_times[0]) / (len(token_times) - 1) if len(token_times) > 1 else None
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "e2e": token_times[-1] - arrival}


def serving_summary(requests: list[dict[str, Any]], duration: float,
                    percentiles: tuple[float, ...] = (50, 99)) -> dict[str, float]:
    """vLLM benchmark_serving's numbers from finished requests, each {"arrival", "token_times",
    "prompt_len"}, over a run of `duration` seconds. Times in the result are in milliseconds."""
    lat = [request_latencies(r["arrival"], r["token_times"]) for r in requests]
    ttft = [x["ttft"] for x in lat]
    tpot = [x["tpot"] for x in lat if x["tpot"] is not None]
    itl = [gap for x in lat for gap in x["itl"]]  # every gap of every request, pooled
    n_in = sum(r["prompt_len"] for r in requests)
    n_out = sum(len(r["token_times"]) for r in requests)
    out = {"completed": len(requests), "duration_s": duration, "total_input_tokens": n_in,
           "total_output_tokens": n_out, "request_throughput": len(requests) / duration,
           "output_throughput": n_out / duration, "total_token_throughput": (n_in + n_out) / duration}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        ms = np.asarray(values, dtype=np.float64) * 1e3
        out[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else 0.0
        out[f"median_{name}_ms"] = float(np.median(ms)) if ms.size else 0.0
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else 0.0
    return out
# --8<-- [end:metrics]


def format_summary(s: dict[str, float], title: str = "Serving Benchmark Result",
                   percentiles: tuple[float, ...] = (99,)) -> str:
    """The summary block in the layout vLLM's benchmark_serving prints."""
    lines = [f"{' ' + title + ' ':=^50}"]
    row = lambda label, value, fmt: lines.append(f"{label:<40}{value:<10{fmt}}")
    row("Successful requests:", s["completed"], "")
    row("Benchmark duration (s):", s["duration_s"], ".2f")
    row("Total input tokens:", s["total_input_tokens"], "")
    row("Total generated tokens:", s["total_output_tokens"], "")
    row("Request throughput (req/s):", s["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", s["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", s["total_token_throughput"], ".2f")
    for name, header in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                         ("itl", "Inter-token Latency")):
        lines.append(f"{header:-^50}")
        row(f"Mean {name.upper()} (ms):", s[f"mean_{name}_ms"], ".2f")
        row(f"Median {name.upper()} (ms):", s[f"median_{name}_ms"], ".2f")
        for p in percentiles:
            row(f"P{p:g} {name.upper()} (ms):", s[f"p{p:g}_{name}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)
