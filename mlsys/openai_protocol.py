"""The server's protocol as data: OpenAI's request and response bodies as pydantic models (as vLLM's
`entrypoints/openai/protocol.py` declares them), so that one declaration both checks a body and documents it in
`/openapi.json`, where clients, code generators and fuzzers read it.

A request model holds what a body may say in isolation: its fields, their types, their ranges (strict: `"8"` is
not an integer, `true` is not a number, NaN is not a temperature). What depends on the model or the engine
(the context length, `n` against the engine's seats, the schema's automaton, the chat template) is checked after
it, in mlsys/protocol.py. A failed check becomes OpenAI's error shape with a message that names the field
(`refusal`), never pydantic's raw error list.

The response models are the shapes the server writes (mlsys/protocol.py, mlsys/chat.py); the tests check every
answer against the official `openai` package's own types, an oracle written by someone else.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_LOGPROBS = 20  # alternatives per token, at most (vLLM's default max_logprobs)
ROLES = ("system", "developer", "user", "assistant", "tool")
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str = ""
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


Int = Annotated[int, Field(strict=True)]
Stop = str | Annotated[list[str], Field(max_length=4)] | None
Neutral = float | None  # a penalty OpenAI defines: accepted only at its neutral value 0 (refused otherwise)


class _Sampling(BaseModel):
    """Fields the two endpoints share."""

    model_config = _STRICT
    model: str
    max_tokens: Int | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Int | None = Field(None, description="vLLM's: a positive integer, or -1 for no cut")
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    stop: Stop = None
    n: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="vLLM's: generate past the end-of-sequence token")
    user: str | None = None
    response_format: ResponseFormat | None = None
    presence_penalty: Neutral = None
    frequency_penalty: Neutral = None
    logit_bias: dict[str, float] | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v < 1 and v != -1:
            raise ValueError("below 1")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _neutral_penalty(cls, v: float | None) -> float | None:
        if v not in (None, 0):
            raise ValueError("not neutral")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _neutral_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("not neutral")
        return v


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[Int] | list[str]
    max_tokens: Int | None = 16  # OpenAI's default
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Int | None = None
    echo: bool | None = None
    suffix: str | None = None

    @field_validator("best_of", "echo", "suffix")
    @classmethod
    def _neutral(cls, v: Any, info: Any) -> Any:
        if v not in (None, {"best_of": 1, "echo": False, "suffix": ""}[info.field_name]):
            raise ValueError("not neutral")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_call_id, ...: accepted, not used
    role: Literal[ROLES]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Int | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list | None) -> list | None:
        if v:
            raise ValueError("not neutral")
        return v


# What to tell a client whose field failed: the message names the field and what it must be.
_MUST = {
    "model": "'model' must be a string",
    "prompt": "'prompt' must be a string or a list of token ids",
    "max_tokens": "'max_tokens' must be an integer",
    "max_completion_tokens": "'max_completion_tokens' must be an integer",
    "temperature": "'temperature' must be a number in [0, 2]",
    "top_p": "'top_p' must be a number in (0, 1]",
    "top_k": "'top_k' must be a positive integer or -1 (off)",
    "seed": "'seed' must be a 64-bit integer",
    "stop": "'stop' must be a string or a list of at most 4 strings",
    "n": "'n' must be an integer from 1",
    "stream": "'stream' must be true or false",
    "ignore_eos": "'ignore_eos' must be true or false",
    "stream_options": "'stream_options' must be an object like {\"include_usage\": true}",
    "user": "'user' must be a string",
    "response_format": "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
    "top_logprobs": f"'top_logprobs' must be an integer from 0 to {MAX_LOGPROBS}",
    "messages": "'messages' must be a non-empty list of {\"role\", \"content\"} objects",
}
_NEUTRAL_FIELDS = {"best_of", "echo", "suffix", "presence_penalty", "frequency_penalty", "logit_bias", "tools",
                   "tool_choice", "parallel_tool_calls"}


def refusal(err: ValidationError, body: dict, chat: bool) -> tuple[str, str | None]:
    """(message, param) for the first problem of a body, in the order a reader would fix them: unknown fields,
    missing fields, then the rest in declaration order."""
    problems = err.errors()
    rank = {"extra_forbidden": 0, "missing": 1}
    first = min(problems, key=lambda p: rank.get(p["type"], 2))
    field = str(first["loc"][0]) if first["loc"] else None
    if field is None:
        return f"request body must be a JSON object, got {type(body).__name__}", None
    if first["type"] == "extra_forbidden":
        return f"unrecognized request argument {field!r}", field
    if first["type"] == "missing":
        return f"missing required argument {field!r}", field
    got = body.get(field)
    if field in _NEUTRAL_FIELDS:
        return f"{field}={got!r} is not supported by this server", field
    if field == "logprobs":
        return ("'logprobs' must be true or false" if chat else
                f"'logprobs' must be an integer from 0 to {MAX_LOGPROBS}") + f", got {got!r}", field
    return f"{_MUST.get(field, repr(field) + ' is not valid')}, got {got!r}", field


# ================================================================================ responses (documentation)
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """A `text_completion`; streamed, each `data:` event has this shape with the new text only."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"] | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unhealthy"]
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    reason: str | None = None
