"""The engine: requests in, one scheduler iteration per `step()`, token streams out.

    from mlsys.engine import Engine, EngineConfig, SamplingParams
    engine = Engine(load_pretrained("small"), config=EngineConfig(block_size=16))
    engine.add_request('{"name": "ada", ', SamplingParams(max_tokens=40))
    while engine.has_unfinished():
        for out in engine.step():             # prefill and/or decode for everyone scheduled
            print(out.request_id, out.new_text, out.finished)

One step is the loop every serving engine runs (vLLM's `LLMEngine.step`):

    schedule ──> prepare (pack tokens, block tables) ──> forward ──> sample ──> update + detokenize
       │                                                                           │
       └──────────────── who runs, how many tokens, which blocks ◄─────────────────┘

`last_step_timing` holds the seconds each stage took in the last step, so a
benchmark can show where time goes besides the model. A lock around add_request,
abort and step keeps one engine safe if two threads call it, but the server does
not rely on it to stay responsive: its handlers only enqueue adds and aborts, and
one engine thread applies them between steps (mlsys/server.py, vLLM's engine core).
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from dataclasses import dataclass

import torch

from mlsys.data import Tokenizer
from mlsys.engine.block_manager import BlockManager
from mlsys.engine.model_runner import ModelRunner
from mlsys.engine.request import FatalEngineError, RequestOutput, SamplingParams, Sequence, SequenceStatus
from mlsys.engine.sampler import apply_structured_masks, sample, sampled_logprobs
from mlsys.engine.scheduler import Scheduler
from mlsys.engine.tokenizer import IncrementalDetokenizer, StopStrings, encode_prompt
from mlsys.model import GPT

DEFAULT_KV_CACHE_BYTES = 4 << 30  # the KV pool's default budget: 4 GiB (kv_cache_memory_bytes overrides it)


def kv_block_bytes(model: torch.nn.Module, block_size: int) -> int:
    """Bytes of one KV block: K and V, every layer, block_size positions, the K/V heads, in the weights' dtype."""
    c = model.config
    dtype_bytes = next(model.parameters()).element_size()
    return 2 * c.n_layer * block_size * c.n_kv_head * c.head_dim * dtype_bytes


# --8<-- [start:config]
@dataclass
class EngineConfig:
    block_size: int = 16  # token positions per KV block
    num_blocks: int | None = None  # KV pool size; None: max_num_seqs full-length sequences, within the budget below
    max_num_seqs: int = 32  # at most this many sequences in one step
    max_num_batched_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    max_model_len: int | None = None  # prompt + output limit; None: the model's block_size
    scheduling: str = "continuous"  # or "static": a batch runs until all its requests finish
    enable_prefix_caching: bool = False  # radix-tree reuse of full prompt blocks
    preemption: str = "recompute"  # the only mode: free the blocks, recompute later
    device: str = "cpu"
    kv_cache_memory_bytes: int | None = None  # budget of the KV pool (vLLM's name); None: DEFAULT_KV_CACHE_BYTES
# --8<-- [end:config]
    tensor_parallel_size: int = 1  # ranks that split every layer (mlsys/engine/tp.py); this process is rank 0
    cuda_graph_sizes: list[int] | None = None  # decode-only steps replay a CUDA graph of these batch sizes
    # (Chapter 10, mlsys/engine/cuda_graphs.py); None: eager. On a CPU the padded static path runs uncaptured.

    def resolve(self, model: GPT) -> EngineConfig:
        """Fill the None defaults from the model and check the settings against each other."""
        c = copy.copy(self)
        c.max_model_len = c.max_model_len or model.config.block_size
        if c.max_model_len > model.config.block_size:
            raise ValueError(f"max_model_len={c.max_model_len} exceeds the model's "
                             f"block_size={model.config.block_size}")
        if c.block_size < 1 or c.max_num_seqs < 1 or c.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        blocks_per_seq = -(-c.max_model_len // c.block_size)
        if c.kv_cache_memory_bytes is not None and c.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {c.kv_cache_memory_bytes}")
        if c.num_blocks is None:   # as many full-length sequences as max_num_seqs, but never past the budget
            budget = c.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES
            per_block = kv_block_bytes(model, c.block_size)
            if blocks_per_seq * per_block > budget:
                fits = budget // per_block * c.block_size
                size = lambda n: (f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB" if n >= 2**20
                                  else f"{n} bytes")
                raise ValueError(f"one {c.max_model_len}-token sequence needs {size(blocks_per_seq * per_block)} of "
                                 f"KV cache, more than the {size(budget)} budget: lower max_model_len (at most {fits} "
                                 f"tokens fit) or raise kv_cache_memory_bytes")
            c.num_blocks = min(c.max_num_seqs * blocks_per_seq, budget // per_block)
        if c.num_blocks < blocks_per_seq:  # else one long request could never run, even alone
            raise ValueError(f"num_blocks={c.num_blocks} cannot hold one {c.max_model_len}-token sequence "
                             f"({blocks_per_seq} blocks of {c.block_size})")
        if c.scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {c.scheduling!r}")
        if c.cuda_graph_sizes is not None and (not c.cuda_graph_sizes or min(c.cuda_graph_sizes) < 1):
            raise ValueError(f"cuda_graph_sizes must be batch sizes >= 1, got {c.cuda_graph_sizes!r}")
        if c.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {c.tensor_parallel_size}")
        if c.tensor_parallel_size > 1 and c.cuda_graph_sizes:
            raise ValueError("tensor_parallel_size > 1 runs without CUDA graphs in this engine")
        if c.tensor_parallel_size > 1 and c.device != "cpu":  # NCCL: one GPU per rank, this process on cuda:0
            if c.device not in ("cuda", "cuda:0"):
                raise ValueError(f"tensor_parallel_size > 1 runs on device 'cpu' (gloo) or 'cuda' (NCCL, rank r on "
                                 f"cuda:r), got {c.device!r}")
            if torch.cuda.device_count() < c.tensor_parallel_size:
                raise ValueError(f"tensor_parallel_size={c.tensor_parallel_size} on 'cuda' needs one GPU per rank; "
                                 f"this machine has {torch.cuda.device_count()}")
        if c.preemption != "recompute":
            raise ValueError(f"only preemption='recompute' is implemented, got {c.preemption!r}")
        return c


class Engine:
    supports_parallel_sampling = True  # SamplingParams.n > 1 (the overlap engine says no)

    def __init__(self, model: GPT, tokenizer: Tokenizer | None = None, config: EngineConfig | None = None):
        self.config = (config or EngineConfig()).resolve(model)
        c = self.config
        # The engine serves its own copy of the weights: a trainer may keep updating (or .train()-ing)
        # the caller's model; new weights reach the engine only through load_weights().
        self.model = copy.deepcopy(model).to(c.device).eval().requires_grad_(False)
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer()
        if self.tokenizer.vocab_size > model.config.vocab_size:  # a checkpoint's embedding may be padded larger
            raise ValueError(f"tokenizer has {self.tokenizer.vocab_size} ids, the model only {model.config.vocab_size}")
        self.block_manager = BlockManager(c.num_blocks, c.block_size, c.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, c.max_num_seqs, c.max_num_batched_tokens, c.scheduling)
        if c.tensor_parallel_size > 1:  # ranks 1..N-1 start here; each holds 1/N of every layer and of the KV
            from mlsys.engine.tp import TPRunner

            self.runner = TPRunner(self.model, c.num_blocks, c.block_size, c.tensor_parallel_size, c.device)
            self.model = self.runner.model  # rank 0's shard: the whole model is not kept
        else:
            self.runner = ModelRunner(self.model, c.num_blocks, c.block_size, c.device)
        if c.cuda_graph_sizes:
            from mlsys.engine.cuda_graphs import CUDAGraphRunner

            self.runner = CUDAGraphRunner(self.runner, c.max_model_len, c.cuda_graph_sizes).capture()
        self.requests: dict[str, Sequence] = {}  # unfinished requests by id
        self._aborted: list[RequestOutput] = []  # reported by the next step()
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self.last_step_timing: dict[str, float] = {}
        self.counters = dict(num_steps=0, num_prefill_tokens=0, num_decode_tokens=0, num_generated_tokens=0,
                             num_failed_requests=0)
        self.schemas = None  # compiled JSON schemas (a SchemaCache, made on first use), for every thread that asks

    # ------------------------------------------------------------ requests

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request; a text prompt is encoded with a leading <bos>. Returns its id. With params.n > 1 the
        step outputs of its n sequences carry the same request id and their `index`."""
        params = params or SamplingParams()
        if params.n > 1 and not self.supports_parallel_sampling:
            raise ValueError(f"{type(self).__name__} does not support n > 1 (parallel sampling)")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        ids = encode_prompt(self.tokenizer, prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room to generate under "
                             f"max_model_len={self.config.max_model_len}")
        if not all(0 <= t < self.model.config.vocab_size for t in ids):
            raise ValueError("prompt token id out of the vocabulary")
        fsm = None if params.json_schema is None else self.compile_schema(params.json_schema, limit=False)
        if fsm is not None and fsm.min_length > min(params.max_tokens, self.config.max_model_len - len(ids)):
            raise ValueError(f"the shortest document the schema allows has {fsm.min_length} tokens; "
                             f"max_tokens={params.max_tokens} cannot hold it")
        with self._lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self.requests or any(isinstance(k, tuple) and k[0] == rid for k in self.requests):
                raise ValueError(f"request id {rid!r} is already in use")
            eos = getattr(self.tokenizer, "eos_ids", None) or self.tokenizer.eos_id   # every id that ends a text
            seqs = [Sequence(rid, ids, params, arrival_time, eos, index=i) for i in range(params.n)]
            for seq in seqs:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids)
                seq.stop_strings = StopStrings(params.stop) if any(params.stop) else None
                seq.fsm = fsm
            seq = seqs[0]  # the prompt is prefilled once, by the first; the others fork from it (_fork)
            seq.forks = seqs[1:]
            self.requests[rid] = seq
            self.scheduler.add(seq)
        return rid

    def compile_schema(self, schema: dict, limit: bool = True):
        """Chapter 11's automaton for a JSON schema over this engine's tokenizer (compiled once per schema).
        SchemaError (a ValueError) if the schema is outside the supported subset; SchemaBusy if `limit` and other
        new schemas are compiling (mlsys/json_constrained.SchemaCache)."""
        from mlsys.json_constrained import SchemaCache

        if not isinstance(self.tokenizer, Tokenizer):
            raise ValueError("structured output needs the book's character tokenizer (its automaton is over "
                             "characters); this model's tokenizer is not supported")
        if self.schemas is None:  # a race here makes two caches, one of which is dropped: harmless
            self.schemas = SchemaCache(self.tokenizer)
        return self.schemas.get(schema, limit)  # bounded in bytes; refusals kept; one compile per schema at a time

    def abort(self, request_id) -> None:
        """Stop a request (all its n sequences) now and free its blocks; the next step() reports each of them
        (finish_reason "abort")."""
        with self._lock:
            keys = [k for k in self.requests if k == request_id or (isinstance(k, tuple) and k[0] == request_id)]
            for key in keys:  # unknown or already finished: nothing to do
                seq = self.requests.pop(key)
                self.scheduler.finish(seq)
                for s in [seq, *seq.forks]:  # siblings not forked yet end with it
                    s.status = SequenceStatus.FINISHED_ABORTED
                    s.metrics.finish_time = time.perf_counter()
                    self._aborted.append(self._output(s, [], ""))
                seq.forks = []

    def _withdraw(self, request_ids: list) -> None:
        """Remove requests that were queued but never stepped, without reporting them (nobody awaits them)."""
        with self._lock:
            for key in [k for k in self.requests if k in request_ids or (isinstance(k, tuple) and k[0] in request_ids)]:
                self.scheduler.finish(self.requests.pop(key))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.requests) or bool(self._aborted)

    # ---------------------------------------------------------------- step

    # --8<-- [start:step]
    def step(self) -> list[RequestOutput]:
        """One scheduler iteration; returns an output for every request that changed."""
        with self._lock:
            t0 = time.perf_counter()
            sched = self.scheduler.schedule()
            t1 = time.perf_counter()
            outputs, self._aborted = self._aborted, []
            timing = dict(schedule=t1 - t0, prepare=0.0, forward=0.0, sample=0.0, detokenize=0.0)
            if sched.scheduled:
                scheduled = list(sched.scheduled)
                self._copy_blocks()  # copy-on-write blocks this step writes into
                try:
                    sampled = self._compute(scheduled, timing)
                except FatalEngineError:
                    raise  # the engine itself cannot compute (a tensor-parallel worker died): no request is to blame
                except Exception as err:  # one request may have broken the batch: find it, keep the rest
                    scheduled, sampled, failed = self._isolate(scheduled, err)
                    outputs += [self._fail(seq, e) for seq, e in failed]
                t4 = time.perf_counter()
                outputs += self._update(scheduled, sampled, t4)
                timing["detokenize"] = time.perf_counter() - t4
            self._count(sched, timing, t0)
            return outputs
    # --8<-- [end:step]

    # The pieces below are shared with the overlap engine (overlap.py), which orders them differently.
    def _count(self, sched, timing: dict, t0: float) -> None:
        self.counters["num_steps"] += 1
        self.counters["num_prefill_tokens"] += sched.num_prefill_tokens
        self.counters["num_decode_tokens"] += sched.num_batched_tokens - sched.num_prefill_tokens
        timing["total"] = time.perf_counter() - t0
        timing["num_batched_tokens"] = sched.num_batched_tokens
        timing["num_seqs"] = len(sched.scheduled)
        self.last_step_timing = timing

    def _copy_blocks(self) -> None:
        """Copy-on-write: give the blocks the scheduler just copied their K/V (before the forward writes)."""
        if self.block_manager.pending_copies:
            self.runner.copy_blocks(self.block_manager.pending_copies)
            self.block_manager.pending_copies = []

    def _remaining(self, seq: Sequence) -> int:
        """Tokens the sequence may still generate (a placeholder of the overlap engine is not one yet)."""
        done = len(seq.output_token_ids) - (bool(seq.output_token_ids) and seq.output_token_ids[-1] < 0)
        return min(seq.params.max_tokens, self.config.max_model_len - len(seq.prompt_token_ids)) - done

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple]:
        """(token, log-prob or None, alternatives or None) for each row of logits (R, V), row i for seqs[i]:
        structured-output masks, then the sampler, then the log-probs asked for."""
        logits = apply_structured_masks(logits, seqs, [s.fsm and self._remaining(s) for s in seqs])
        new_ids = sample(logits, seqs) if seqs else []
        logprobs, tops = sampled_logprobs(logits, seqs, new_ids)  # None where not asked for
        return list(zip(new_ids, logprobs, tops))

    def _commit(self, seq: Sequence, sampled: tuple, now: float) -> RequestOutput:
        """Append a sampled token to its sequence; finish, free and detokenize (shared with overlap.py)."""
        token, logprob, top = sampled
        seq.append_token(token, now, self.config.max_model_len, logprob, top)
        self.counters["num_generated_tokens"] += 1
        self.block_manager.cache_full_blocks(seq)
        new_text = self._detokenize(seq, token)  # a stop string may finish it too
        if seq.is_finished:
            seq.metrics.finish_time = now
            self.scheduler.finish(seq)
            del self.requests[seq.key]
        return self._output(seq, [token], new_text)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Parallel sampling: the parent's prompt is now in the cache. Each sibling takes the parent's block
        table (shared, copy-on-write), its computed count and its place among the running sequences."""
        children, parent.forks = parent.forks, []
        for child in children:
            self.block_manager.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SequenceStatus.RUNNING
            child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
            child.metrics.num_cached_prompt_tokens = parent.metrics.num_cached_prompt_tokens
            self.scheduler.running.append(child)
            self.requests[child.key] = child
        return children

    def _compute(self, scheduled: list, timing: dict) -> dict:
        """Prepare, forward and sample the scheduled chunks: sequence key -> (token, log-prob, alternatives) for
        each sequence whose chunk reaches its last token, and for the siblings that fork from it (each draws
        from the same logits row). Writes the chunks' K and V into their blocks; changes nothing else, so a
        failed call can be repeated on a subset."""
        t1 = time.perf_counter()
        seqs = [s for s, _ in scheduled]
        done = [s.num_computed_tokens + n == s.num_tokens for s, n in scheduled]  # sample after this chunk?
        batch = self.runner.prepare(
            [s.num_computed_tokens for s in seqs],
            [s.token_ids[s.num_computed_tokens : s.num_computed_tokens + n] for s, n in scheduled],
            [s.block_table for s in seqs], done)
        t2 = time.perf_counter()
        logits = self.runner.execute(batch)  # (R, V): one row per sequence that samples
        t3 = time.perf_counter()
        to_sample = [s for s, d in zip(seqs, done) if d]
        rows = [r for r, s in enumerate(to_sample) for r in [r] * (1 + len(s.forks))]  # siblings reuse a row
        if len(rows) > len(to_sample):
            logits = logits[torch.tensor(rows, device=logits.device)]
            to_sample = [x for s in to_sample for x in [s, *s.forks]]
        sampled = self._sample(logits, to_sample)
        timing.update(prepare=timing["prepare"] + t2 - t1, forward=timing["forward"] + t3 - t2,
                      sample=timing["sample"] + time.perf_counter() - t3)
        return {s.key: x for s, x in zip(to_sample, sampled)}

    def _isolate(self, scheduled: list, err: Exception) -> tuple[list, dict, list]:
        """The batched step raised. Run each scheduled chunk alone: the ones that raise again are the culprits
        and fail; the others produce what they would have produced alone. (Costs a step per request, only on
        the rare step that fails.) Returns (chunks that ran, their samples, [(sequence, its error)])."""
        if len(scheduled) == 1:
            return [], {}, [(scheduled[0][0], err)]
        ok, sampled, failed = [], {}, []
        timing = dict(prepare=0.0, forward=0.0, sample=0.0)
        for seq, n in scheduled:
            try:
                sampled |= self._compute([(seq, n)], timing)
                ok.append((seq, n))
            except FatalEngineError:
                raise
            except Exception as alone:
                failed.append((seq, alone))
        return ok, sampled, failed

    def _fail(self, seq: Sequence, err: BaseException) -> RequestOutput:
        """End one sequence with an error and free its blocks; the rest of the batch is untouched. Siblings not
        forked yet fail with it (reported by the next step)."""
        self.scheduler.finish(seq)
        self.requests.pop(seq.key, None)
        self.counters["num_failed_requests"] += 1
        outs = []
        for s in [seq, *seq.forks]:
            s.status = SequenceStatus.FINISHED_ERROR
            s.metrics.finish_time = time.perf_counter()
            outs.append(self._output(s, [], ""))
            outs[-1].error = err
        seq.forks = []
        self._aborted += outs[1:]
        return outs[0]

    def _update(self, scheduled: list, sampled: dict, now: float) -> list[RequestOutput]:
        """Advance the counters, append sampled tokens (and log-probs), finish, free, detokenize. A request whose
        own bookkeeping raises (a detokenizer error, say) fails alone."""
        outputs = []
        for seq, n in scheduled:
            group = [seq]
            try:
                seq.num_computed_tokens += n
                if seq.num_computed_tokens < seq.num_tokens:
                    self.block_manager.cache_full_blocks(seq)
                    continue  # a prefill chunk: nothing to sample yet
                group += self._fork(seq)  # before the parent's token: it may finish and free its blocks
                for s in group:
                    outputs.append(self._commit(s, sampled[s.key], now))
            except Exception as err:
                outputs += [self._fail(s, err) for s in group if not s.is_finished]
        return outputs

    @staticmethod
    def _detokenize(seq: Sequence, token: int) -> str:
        """The text a sampled token adds, after the request's stop strings (which may finish it)."""
        new_text = seq.detokenizer.step([token])
        if seq.is_finished:  # the last token may have left a character incomplete: release its bytes now
            new_text += seq.detokenizer.flush()
        if seq.stop_strings is not None:
            new_text = seq.stop_strings.step(new_text, final=seq.is_finished)
            if seq.stop_strings.stopped and not seq.is_finished:
                seq.status = SequenceStatus.FINISHED_STOPPED
        return new_text

    def _output(self, seq: Sequence, new_ids: list[int], new_text: str) -> RequestOutput:
        finished = seq.is_finished
        text = seq.stop_strings.text if seq.stop_strings is not None else seq.detokenizer.text
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids), new_token_ids=list(new_ids),
            text=text, new_text=new_text, finished=finished,
            finish_reason=seq.status.value if finished else None, metrics=seq.metrics,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs else None, index=seq.index,
            top_logprobs=list(seq.output_top_logprobs) if seq.params.logprobs and seq.params.top_logprobs else None,
        )

    # ------------------------------------------------------------ helpers

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run `prompts` (texts or id lists) to completion; final outputs in input order (a request with n > 1
        gives n outputs in a row, by index)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        rids: list = []
        try:
            for p, sp in zip(prompts, params):
                rids.append(self.add_request(p, sp))
        except BaseException:   # one bad prompt: take back the ones queued before it, so nothing is left running
            self._withdraw(rids)
            raise
        keys = [(rid, i) for rid, sp in zip(rids, params) for i in range((sp or SamplingParams()).n)]
        final: dict[tuple, RequestOutput] = {}
        while len(final) < len(keys):
            if not self.has_unfinished():
                raise RuntimeError("engine idle with requests unfinished")  # a bug, not a user error
            for out in self.step():
                if out.finished:
                    final[out.request_id, out.index] = out
        failed = [k for k in keys if final[k].finish_reason == "error"]
        if failed:
            what = "requests" if len(keys) == len(prompts) else "sequences"
            raise RuntimeError(f"{len(failed)} of {len(keys)} {what} failed (first: {failed[0][0]})") \
                from final[failed[0]].error
        return [final[k] for k in keys]

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot step afterwards)."""
        if hasattr(self.runner, "close"):
            self.runner.close()

    def load_weights(self, state_dict: dict) -> None:
        """Serve new weights (RLHF: the policy after a training step). Cached prefixes were
        computed with the old weights, so the prefix cache is emptied; no request may be in flight."""
        if self.config.tensor_parallel_size > 1:
            raise NotImplementedError("load_weights with tensor_parallel_size > 1")
        with self._lock:
            if self.requests:
                raise RuntimeError(f"load_weights with {len(self.requests)} requests in flight")
            self.model.load_state_dict(state_dict)
            self.reset_prefix_cache()

    def reset_prefix_cache(self) -> int:
        """Drop every cached, unreferenced block; returns how many were freed."""
        with self._lock:
            cache = self.block_manager.prefix_cache
            return cache.evict(self.config.num_blocks) if cache is not None else 0

    def stats(self) -> dict:
        with self._lock:
            pool, bm = self.block_manager.pool, self.block_manager
            hit, query = bm.prefix_hit_tokens, bm.prefix_query_tokens
            return dict(
                num_total_blocks=pool.num_blocks, num_free_blocks=pool.num_free, num_used_blocks=pool.num_used,
                num_cached_blocks=pool.num_cached_unused, block_size=self.config.block_size,
                num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                prefix_hit_tokens=hit, prefix_miss_tokens=query - hit,
                prefix_hit_rate=hit / query if query else 0.0,
                num_evicted_blocks=bm.prefix_cache.num_evicted_blocks if bm.prefix_cache else 0,
                num_preemptions=self.scheduler.num_preemptions, kv_cache_bytes=self.runner.kv_cache_bytes,
                num_cow_copies=bm.num_cow_copies,
                **self.counters,
            )

    def check_invariants(self) -> None:
        """AssertionError on a leaked block, a wrong refcount, or a request in the wrong place."""
        with self._lock:
            sch = self.scheduler
            live = sch.running + list(sch.waiting)
            assert len(sch.running) <= self.config.max_num_seqs
            assert {s.key for s in live} == set(self.requests), "a request is lost or duplicated"
            assert len(live) == len(self.requests)
            for s in sch.running:
                assert s.status is SequenceStatus.RUNNING, s
            for s in sch.waiting:
                assert s.status is SequenceStatus.WAITING and s.num_computed_tokens == 0 and not s.block_table, s
            self.block_manager.check_invariants(live)
