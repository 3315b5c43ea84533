"""What a request is inside the engine: its sampling settings, its state, its metrics, its output.

A request holds one sequence, or n of them with `SamplingParams(n=...)` (parallel
sampling: n answers to one prompt). The n sequences share the prompt's KV blocks
(the engine forks them after the prompt's prefill, copy-on-write: block_manager.py);
each is then a `Sequence` of its own, told apart by `index`. Its life, in the
states vLLM uses:

    add_request ──> WAITING ──schedule──> RUNNING ──stop/length──> FINISHED_STOPPED / FINISHED_LENGTH
                       ^                     │
                       └────── preempt ──────┘      abort (any time) ──> FINISHED_ABORTED

The one counter that drives everything is `num_computed_tokens`: how many of
the sequence's tokens (prompt + generated) already have their keys and values
in the KV cache. Each step the scheduler asks for the rest,
`num_tokens - num_computed_tokens`: a whole prompt at first (prefill), a chunk
of it when the token budget is tight (chunked prefill), then exactly one token
(decode). A prefix-cache hit starts the counter above zero; preemption by
recompute resets it to zero. Prefill and decode are the same operation seen at
different counter values.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch


class FatalEngineError(RuntimeError):
    """The engine cannot compute any step (not one request's fault): step() raises it instead of isolating. It lives
    here, beside the request types, so that engine.py and the tensor-parallel runner (tp.py) both import it from a
    module that imports neither of them."""


# --8<-- [start:sampling_params]
@dataclass
class SamplingParams:
    """How to pick tokens for one request, and when to stop.

    vLLM's names, with three differences in defaults and types: temperature 0.0 (greedy; vLLM's default is
    1.0), max_tokens 32 (vLLM: 16), and `logprobs` a bool plus `top_logprobs` a count (vLLM: one int, the
    number of alternatives). The server (mlsys/protocol.py) takes OpenAI's fields and defaults instead."""

    max_tokens: int = 32  # generate at most this many tokens
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int | None = None  # keep the k most likely tokens before sampling
    top_p: float = 1.0  # then keep the fewest most likely tokens whose probability reaches top_p (nucleus)
    seed: int | None = None  # a private torch.Generator per request: same seed, same tokens
    stop_token_ids: tuple[int, ...] = ()  # finish when one of these is generated (it is kept)
    stop: tuple[str, ...] = ()  # finish where the text first contains one of these (left out of the text)
    ignore_eos: bool = False  # keep going past <eos> (benchmarks want fixed lengths)
    logprobs: bool = False  # also return log p(token) of each sampled token, under the distribution it was
    # drawn from: softmax(logits / temperature) after the top-k and top-p filters (and a structured-output mask)
    # when sampling, the raw softmax (after the mask) when greedy
    top_logprobs: int = 0  # with logprobs: also the k most likely tokens of that distribution at each step
    n: int = 1  # answers to sample for the prompt; they share its KV blocks copy-on-write
    json_schema: dict | None = None  # structured output: every answer is a JSON document valid for this schema
    # (chapter 11's automaton masks the logits of each step; {"type": "object"} is OpenAI's json_object mode)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        self.stop_token_ids = tuple(self.stop_token_ids)
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.json_schema is not None and any(self.stop):
            raise ValueError("stop strings cannot be combined with json_schema: one could end the document early")
# --8<-- [end:sampling_params]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # computing this request raised; the others in its batch went on

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None  # time to first token = first_token_time - arrival_time
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token (ITL = diffs)
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """What `Engine.step` reports for a request that changed in that step."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated so far
    new_token_ids: list[int]  # generated in this step
    text: str  # detokenized token_ids (specials skipped)
    new_text: str  # the part of `text` that is new in this step
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    metrics: RequestMetrics
    logprobs: list[float] | None = None  # one per token_ids entry; None unless SamplingParams.logprobs
    error: BaseException | None = None  # what ended the request when finish_reason is "error"
    index: int = 0  # which of the request's n sequences this is
    top_logprobs: list[dict[int, float]] | None = None  # per token_ids entry: {token id: log-prob}, the
    # SamplingParams.top_logprobs most likely tokens; None unless asked for


# --8<-- [start:sequence]
class Sequence:
    """One request's tokens, KV-cache bookkeeping and state."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, eos_token_id: int | tuple[int, ...] | None = None,
                 index: int = 0):
        self.request_id = request_id
        self.index = index  # 0..n-1 among the request's sequences
        self.key = request_id if index == 0 else (request_id, index)  # the engine's handle on this sequence
        self.forks: list[Sequence] = []  # the n-1 siblings, until they fork off after the prompt's prefill
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[float] = []  # with params.logprobs: one per output token, kept on preemption
        self.output_top_logprobs: list[dict[int, float]] = []  # with params.top_logprobs: one dict per token
        self.params = params
        # one end-of-sequence id, or several (a folder's config may list more than one: any of them ends it)
        ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id or ())
        self.eos_token_id, self.eos_token_ids = (ids[0] if ids else None), frozenset(ids)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V sit in the cache
        self.block_table: list[int] = []  # logical block i -> physical block id in the pool
        self.num_inserted_blocks = 0  # full blocks already handed to the prefix cache
        self.metrics = RequestMetrics(time.perf_counter() if arrival_time is None else arrival_time)
        self.generator = None  # None: the global RNG; a seed gives a private, reproducible stream
        if params.seed is not None:  # sibling i draws from seed + i (vLLM's rule), so each answer is reproducible
            self.generator = torch.Generator().manual_seed((params.seed + index) % 2**64)
        self.detokenizer = None  # set by the engine when it has a tokenizer
        self.stop_strings = None  # a StopStrings filter on the text, when params.stop has any
        self.fsm = None  # structured output: the schema's automaton (mlsys.json_constrained.SchemaFSM) ...
        self.fsm_state = 0  # ... and its state after the tokens generated so far

    @property
    def token_ids(self) -> list[int]:  # prompt + generated: what the KV cache holds, in order
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_new_tokens(self) -> int:  # what the next step must compute
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int, now: float, max_model_len: int, logprob: float | None = None,
                     top: dict[int, float] | None = None) -> None:
        """Record a sampled token (its log-prob and alternatives, if asked for) and decide whether it is done."""
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top_logprobs.append(top)
        self.metrics.token_times.append(now)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        if self.fsm is not None:
            if token_id == self.eos_token_id:  # the automaton allowed <eos>: the document is complete
                self.status = SequenceStatus.FINISHED_STOPPED
                return
            self.fsm_state = self.fsm.next_state_list[self.fsm_state][token_id]
        p = self.params
        if token_id in p.stop_token_ids or (token_id in self.eos_token_ids and not p.ignore_eos):
            self.status = SequenceStatus.FINISHED_STOPPED
        elif len(self.output_token_ids) >= p.max_tokens or self.num_tokens >= max_model_len:
            self.status = SequenceStatus.FINISHED_LENGTH
# --8<-- [end:sequence]

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
