"""OpenAI's request and response shapes for `mlsys.server`: a body checked into SamplingParams, answers as JSON.

Validation refuses anything the engine cannot honour with a 4xx and a message that says why (OpenAI's error
shape), before the request reaches the engine: the server must never answer a client's mistake with a 5xx. The
bodies themselves are declared as pydantic models in mlsys/openai_protocol.py (also what /openapi.json shows);
this module adds the checks that depend on the model and the engine, and writes the answers.

What the server accepts beyond the prompt: max_tokens (max_completion_tokens for chat), temperature, top_p,
top_k, seed, stop, n (parallel sampling: the engine shares the prompt's KV blocks between the n answers),
logprobs (completions: 0..20 alternatives per token; chat: true, with top_logprobs 0..20), response_format
(text, json_object, json_schema: chapter 11's automaton masks the logits of each step, so every answer is valid
JSON under the schema; a schema outside the supported subset, or one whose shortest document does not fit in
max_tokens, is a 400), stream and stream_options.include_usage, ignore_eos (vLLM's). Fields OpenAI defines
that it refuses unless they hold their neutral value: best_of, echo, suffix, presence_penalty,
frequency_penalty, logit_bias, tools, tool_choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import ValidationError

from mlsys import openai_protocol as api
from mlsys.chat import ChatError, NoChatTemplate, normalize_messages, render_book, render_template
from mlsys.engine import Engine, RequestOutput, SamplingParams
from mlsys.engine.tokenizer import encode_prompt
from mlsys.json_constrained import SchemaBusy

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_SCHEMA_BYTES = 16_384  # a response_format schema larger than this is refused before it is compiled


# ===================================================================================== request validation
class RequestError(Exception):
    """A request the server refuses: an HTTP status and a message for the client (OpenAI's error shape)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, headers: dict | None = None) -> None:
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate cannot be sent
        param = None if param is None else param.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.headers = headers  # e.g. Retry-After on a 429

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        kind = "rate_limit_error" if self.status == 429 else kind
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass
class CompletionRequest:
    """A validated POST /v1/completions body."""

    prompt_ids: list[int]  # <bos> + the prompt's characters (or the ids the client sent)
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with token counts


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true is not a number


# --8<-- [start:validate]
def parse_completion_request(raw: bytes, engine: Engine, model_name: str, chat: bool = False,
                             chat_template: str | NoChatTemplate | None = None,
                             defaults: dict | None = None) -> CompletionRequest:
    """Check a request body against the model and the engine; RequestError (4xx) with a clear message if bad.
    chat: a /v1/chat/completions body, whose messages become the prompt (mlsys/chat.py).

    First the body alone, against its pydantic model (mlsys/openai_protocol.py: fields, types, ranges); then what
    depends on this server: the model's name, the context length, n against the engine's seats, the schema."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError("request body is nested too deeply") from None
    except ValueError as err:  # bad JSON, bad UTF-8, an integer of more than 4300 digits
        raise RequestError(f"request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    try:
        req = (api.ChatCompletionRequest if chat else api.CompletionRequest).model_validate(body)
    except ValidationError as err:
        message, param = api.refusal(err, body, chat)
        unknown = message.startswith(("unrecognized", "missing"))
        if not unknown and isinstance(body.get("model"), str) and body["model"] != model_name:
            _check_model(body["model"], model_name)  # a wrong model is a 404 before any field's 400
        if param == "messages" and isinstance(body.get("messages"), list) and body["messages"]:
            try:  # its own words for a bad message: which one, which part
                normalize_messages(body["messages"])
            except ChatError as chat_err:
                raise RequestError(str(chat_err), param=chat_err.param) from None
        raise RequestError(message, param=param) from None
    except RecursionError:
        raise RequestError("request body is nested too deeply") from None
    _check_model(req.model, model_name)
    ids = _chat_ids(body["messages"], engine, chat_template) if chat else _prompt_ids(body["prompt"], engine)
    max_len = engine.config.max_model_len
    if chat:  # the chat API's default: as many tokens as the context leaves
        given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = max(1, max_len - len(ids)) if given is None else given
    else:
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
    if max_tokens < 1 or len(ids) + max_tokens > max_len:
        raise RequestError(f"this model's maximum context length is {max_len} tokens: the prompt has {len(ids)}, "
                           f"so max_tokens must be between 1 and {max_len - len(ids)}, got {max_tokens}",
                           param="max_tokens")
    defaults = defaults or {}  # a folder's generation_config.json (temperature, top_p, top_k), as vLLM reads it
    temperature = req.temperature if req.temperature is not None else defaults.get("temperature", 1.0)
    top_p = req.top_p if req.top_p is not None else defaults.get("top_p", 1.0)  # OpenAI's defaults: sampling
    top_k = req.top_k if "top_k" in body else defaults.get("top_k")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if req.stream_options is not None and not req.stream:
        raise RequestError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if chat:
        if req.top_logprobs and req.logprobs is not True:
            raise RequestError("'top_logprobs' needs 'logprobs' to be true", param="top_logprobs")
        logprobs, top = req.logprobs is True, req.top_logprobs or 0
    else:
        logprobs, top = req.logprobs is not None, req.logprobs or 0
    n = 1 if req.n is None else req.n
    if n > engine.config.max_num_seqs:
        raise RequestError(f"'n' must be an integer from 1 to {engine.config.max_num_seqs}, got {n!r}", param="n")
    schema = _response_schema(req.response_format, body.get("response_format"))
    if schema is not None and any(stop):   # a stop string could cut the document short: invalid JSON, served
        raise RequestError("'stop' cannot be combined with a JSON response_format: a stop string could end the "
                           "document before it is complete", param="stop")
    if schema is not None:
        try:
            fsm = engine.compile_schema(schema)
        except SchemaBusy as err:  # other new schemas are compiling: this one may well be fine a moment later
            raise RequestError(f"response_format: {err}", status=429, param="response_format", code="server_busy",
                               headers={"Retry-After": "1"}) from None
        except ValueError as err:  # SchemaError, or a tokenizer the automaton cannot work over
            raise RequestError(f"response_format cannot be enforced: {err}", param="response_format") from None
        except RecursionError:
            raise RequestError("response_format: the schema is nested too deeply", param="response_format") from None
        if fsm.min_length > max_tokens:
            raise RequestError(f"response_format: the shortest JSON document the schema allows has "
                               f"{fsm.min_length} tokens, more than max_tokens={max_tokens}", param="max_tokens")
    if temperature < SAMPLING_EPS:  # below this, dividing the logits overflows: treated as greedy, as vLLM does
        temperature = 0.0
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=float(temperature),
                            top_k=None if top_k in (None, -1) or top_k >= vocab else top_k,  # >= V: no cut
                            top_p=float(top_p), seed=req.seed % 2**64 if req.seed is not None else None,
                            ignore_eos=req.ignore_eos, stop=tuple(x for x in stop if x),
                            logprobs=logprobs, top_logprobs=top, n=n, json_schema=schema)
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return CompletionRequest(ids, params, req.stream, include_usage)
# --8<-- [end:validate]


def _check_model(given: str, model_name: str) -> None:
    if given != model_name:
        raise RequestError(f"the model {given!r} does not exist; this server serves {model_name!r}",
                           status=404, param="model", code="model_not_found")


def _response_schema(fmt: api.ResponseFormat | None, raw: Any) -> dict | None:
    """response_format -> the JSON schema to enforce, or None (plain text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else {}
    try:
        size = len(json.dumps(schema, allow_nan=False))
    except RecursionError:  # nested too deeply to even write out
        raise RequestError("response_format: the schema is nested too deeply", param="response_format") from None
    except ValueError:  # 1e400, Infinity or NaN: no bound the automaton could count to
        raise RequestError("response_format: the schema holds a number that is not finite (Infinity, NaN, or "
                           "beyond the float range such as 1e400)", param="response_format") from None
    if size > MAX_SCHEMA_BYTES:
        raise RequestError(f"the response_format schema exceeds {MAX_SCHEMA_BYTES} bytes", param="response_format")
    return schema


def _chat_ids(messages: Any, engine: Engine, template: str | NoChatTemplate | None) -> list[int]:
    """The messages rendered by the checkpoint's chat template, or by the book's (the last user message)."""
    tok = engine.tokenizer
    if isinstance(template, NoChatTemplate):    # a folder without a template: refused, never guessed
        raise RequestError(template.reason, param="messages")
    try:
        messages = normalize_messages(messages)
        if template is None:
            # a character-level book tokenizer: its one-character entries are the alphabet (specials are <...>)
            alphabet = "".join(s for s in getattr(tok, "itos", []) if len(s) == 1) or None
            return encode_prompt(tok, render_book(messages, alphabet))
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
                    usage: dict | None = None, with_choice: bool = True, logprobs: dict | None = None,
                    index: int = 0) -> dict:
    """An OpenAI `text_completion` object: the whole answer, or one streamed chunk of it."""
    choices = [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}] \
        if with_choice else []
    body = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body
# --8<-- [end:sse]


def logprobs_of(out: RequestOutput, tokenizer, chat: bool, new_only: bool = False) -> dict | None:
    """The log-probs block of a choice, for the tokens of `out` (or only this step's): OpenAI's completions shape
    (tokens, token_logprobs, top_logprobs, text_offset) or its chat shape (content: token, logprob, bytes,
    top_logprobs); None if not asked."""
    if out.logprobs is None:
        return None
    ids = out.new_token_ids if new_only else out.token_ids
    values = out.logprobs[len(out.logprobs) - len(ids):]
    tops = out.top_logprobs[len(out.top_logprobs) - len(ids):] if out.top_logprobs is not None else None
    text = lambda i: tokenizer.decode([i])
    raw = getattr(tokenizer, "token_bytes", None) or (lambda i: text(i).encode("utf-8"))  # the token's own bytes
    tokens = [text(i) for i in ids]
    if chat:
        entry = lambda i, lp: {"token": text(i), "logprob": lp, "bytes": list(raw(i))}
        return {"content": [{**entry(i, lp), "top_logprobs": [entry(a, alp) for a, alp in top.items()]
                             if tops is not None else []}
                            for i, lp, top in zip(ids, values, tops or [None] * len(ids))]}
    # offsets into the whole answer: a streamed chunk's first token starts where the text before it ended
    start = sum(len(text(i)) for i in out.token_ids[:len(out.token_ids) - len(ids)])
    offsets = np.cumsum([start] + [len(t) for t in tokens[:-1]]).tolist() if tokens else []
    top_block = None if tops is None else [{text(a): alp for a, alp in top.items()} for top in tops]
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top_block, "text_offset": offsets}


def usage_of(outs: RequestOutput | list[RequestOutput]) -> dict:
    """Token counts of a request: its prompt once, the tokens of all its n answers."""
    outs = outs if isinstance(outs, list) else [outs]
    n_prompt, n_out = len(outs[0].prompt_token_ids), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def finish_reason_of(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finish_reason in ("stop", "length") else None


