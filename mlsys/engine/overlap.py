"""Overlap scheduling: schedule and prepare step N+1 on the CPU while step N's forward runs.

The plain engine does everything in a line, so the accelerator waits while
Python schedules and packs the next batch:

    plain     | sched+prep N | forward N | sample N | update N | sched+prep N+1 | forward N+1 | ...
    overlap   | sched+prep N | forward N ...................| sample N | update N | forward N+1 ...
                             | sched+prep N+1 (optimistic) |                      | sched+prep N+2

Step N+1 can be scheduled before step N's tokens exist, because scheduling
needs to know only WHO runs and HOW MANY tokens each computes, not which token
it is: every sequence that samples in step N will decode one token in step
N+1, at a known position, into a known slot. So the engine first advances the
sequences as if step N were done, with a placeholder where each new token will
go, schedules and prepares step N+1, and when step N's tokens arrive writes them
into the placeholders (in the sequences and in the prepared input ids).

What overlaps here is only the scheduling and preparation of step N+1 with step
N's forward: step N's logits come back to the host, are sampled there, and their
tokens are written into N+1's inputs before N+1 launches. SGLang's overlap
scheduler (`FutureMap` in python/sglang/srt/managers/overlap_utils.py) and vLLM's
async scheduling (the model runner keeps `prev_sampled_token_ids` on the GPU)
go one step further: the placeholders are resolved ON THE DEVICE from the sampled
ids the GPU just produced, so N+1 is launched before N's tokens reach the host,
and the CPU processes step N's results while N+1 runs.

Two things can be known only afterwards, and both are handled exactly:
- a sequence that reaches max_tokens or max_model_len with this token is known
  in advance: it is left out of step N+1's schedule;
- a sequence that samples <eos> (or a stop token) is not: it was scheduled for
  step N+1 anyway, so step N+1 is re-prepared without it (a step that loses
  the overlap, only when someone stops).
Everything else is the plain engine's code, so the output is token for token the
plain engine's (the tests check it). An abort between steps frees the request's
blocks and, if it was in the prepared step N+1, re-prepares that step without it.

Where the forward runs: on a GPU, kernels are launched asynchronously and the
launching thread returns at once, so the CPU work simply follows the launch.
On a CPU, the forward runs in a worker thread; PyTorch releases the GIL inside
each kernel, so the scheduler's Python runs while a kernel computes, but not
while the forward's own Python (module calls, op dispatch) holds the GIL.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from mlsys.engine.engine import Engine
from mlsys.engine.request import RequestOutput, SequenceStatus
from mlsys.engine.scheduler import Scheduler

PLACEHOLDER = -1  # a token id that is not known yet (step N still running)


class OverlapEngine(Engine):
    """Engine whose step() overlaps the next step's scheduling and preparation with this step's forward.
    It reuses the plain engine's pieces (sampling with masks and log-probs, committing a token, counting) and
    only orders them differently. Parallel sampling (n > 1) is refused: a fork's copy-on-write copies would
    have to wait for the forward in flight, which may still be writing the block being copied."""

    supports_parallel_sampling = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config.cuda_graph_sizes and self.runner.device.type != "cuda":
            raise ValueError("OverlapEngine on a CPU: the forward thread would read the static graph buffers "
                             "while the next step fills them; use cuda_graph_sizes only on a GPU")
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="forward")
        self._next = None  # (sched, batch) prepared for the coming step
        self.overlap_stats = dict(num_steps=0, num_reprepared=0)

    # --8<-- [start:step]
    def step(self) -> list[RequestOutput]:
        with self._lock:
            t0 = time.perf_counter()
            outputs, self._aborted = self._aborted, []
            if self._next is None:  # pipeline empty: schedule and prepare in line, nothing to overlap with
                self._next = self._schedule_and_prepare()
            sched, batch = self._next
            timing = dict(schedule=0.0, prepare=0.0, forward=0.0, sample=0.0, detokenize=0.0, overlapped=0.0)
            if not sched.scheduled:
                self._next = None
                self._count(sched, timing, t0)
                return outputs
            pending = self._launch(batch)  # step N's forward starts (worker thread / GPU stream)
            t1 = time.perf_counter()
            seqs, finishing = self._advance_optimistically(sched)  # seqs: those that sample in step N
            self._next = self._schedule_and_prepare(hide=finishing)  # step N+1, while N computes
            t2 = time.perf_counter()
            logits = pending.result()  # wait for step N: (R, V), one row per sequence in seqs
            t3 = time.perf_counter()
            sampled = self._sample(logits, seqs)  # the plain engine's: masks, sampler, log-probs
            t4 = time.perf_counter()
            outputs += self._commit_all(seqs, sampled, t4)
            self._fix_next({seq: x[0] for seq, x in zip(seqs, sampled)})
            t5 = time.perf_counter()
            timing.update(overlapped=t2 - t1, forward=t3 - t2, sample=t4 - t3, detokenize=t5 - t4, launch=t1 - t0)
            self._count(sched, timing, t0)
            return outputs
    # --8<-- [end:step]

    def _launch(self, batch) -> Future:
        if self.runner.device.type == "cuda":  # kernels are queued asynchronously: nothing to wait for here
            done: Future = Future()
            done.set_result(self.runner.execute(batch))
            return done
        return self._worker.submit(self.runner.execute, batch)

    def _schedule_and_prepare(self, hide=()):
        """Plain scheduling, with `hide` (sequences that finish by length in the step in flight) left out."""
        self.scheduler.running = [s for s in self.scheduler.running if s not in hide]
        sched = self.scheduler.schedule()
        self.scheduler.running += hide  # they finish (and leave) when their token is committed
        return sched, self._prepare(sched) if sched.scheduled else None

    def _prepare(self, sched):
        seqs = [s for s, _ in sched.scheduled]
        done = [s.num_computed_tokens + n == s.num_tokens for s, n in sched.scheduled]
        return self.runner.prepare(
            [s.num_computed_tokens for s in seqs],
            [s.token_ids[s.num_computed_tokens : s.num_computed_tokens + n] for s, n in sched.scheduled],
            [s.block_table for s in seqs], done)

    # --8<-- [start:optimistic]
    def _advance_optimistically(self, sched) -> tuple[list, list]:
        """Move every scheduled sequence past step N as if its token were known. Returns the sequences that
        sample in step N, and those that will surely finish by length with that token (not to be scheduled)."""
        sampling, finishing = [], []
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)  # only blocks below num_computed: real tokens
            if seq.num_computed_tokens == seq.num_tokens:  # a decode, or a prompt's last chunk: it samples
                sampling.append(seq)
                seq.output_token_ids.append(PLACEHOLDER)  # its position and slot are known, its id is not
                if len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= self.config.max_model_len:
                    finishing.append(seq)
        return sampling, finishing

    def _commit_all(self, seqs, sampled, now) -> list[RequestOutput]:
        """Step N's tokens arrive: replace the placeholders, then the plain engine's commit (finish, free,
        detokenize) for each."""
        outputs = []
        for seq, x in zip(seqs, sampled):
            assert seq.output_token_ids.pop() == PLACEHOLDER
            outputs.append(self._commit(seq, x, now))
        return outputs

    def _fix_next(self, tokens: dict) -> None:
        """Write step N's tokens into step N+1's prepared input ids; re-prepare if someone stopped."""
        if self._next is None or not self._next[0].scheduled:
            self._next = None
            return
        sched, batch = self._next
        if any(s.status is not SequenceStatus.RUNNING for s, _ in sched.scheduled):  # stopped on <eos>
            self.overlap_stats["num_reprepared"] += 1
            self._drop_from_next(lambda s: s.status is not SequenceStatus.RUNNING)
            return  # prepared from the sequences' committed tokens: no placeholder left
        rows, ids, row = [], [], 0
        for seq, n in sched.scheduled:
            row += n
            if seq.num_computed_tokens + n == seq.num_tokens and seq in tokens:  # its last input was a placeholder
                rows.append(row - 1)
                ids.append(tokens[seq])
        if rows:  # packed rows of an eager ModelInput; a graph batch has one row per sequence: the same index
            input_ids = batch.input_ids if hasattr(batch, "input_ids") else batch.buffers.input_ids
            input_ids[torch.tensor(rows)] = torch.tensor(ids, device=input_ids.device)

    def _drop_from_next(self, leaves) -> None:
        """Take the sequences for which leaves(seq) holds out of the prepared step N+1 and prepare it again
        (from committed tokens only: call it between steps, when no placeholder is left)."""
        sched, _ = self._next
        gone = [(s, n) for s, n in sched.scheduled if leaves(s)]
        sched.scheduled = [(s, n) for s, n in sched.scheduled if not leaves(s)]
        sched.num_batched_tokens -= sum(n for _, n in gone)
        sched.num_prefill_tokens -= sum(n for s, n in gone if not Scheduler._is_decode(s, n))
        self._next = (sched, self._prepare(sched)) if sched.scheduled else None
    # --8<-- [end:optimistic]

    def _count(self, sched, timing: dict, t0: float) -> None:
        self.overlap_stats["num_steps"] += 1
        super()._count(sched, timing, t0)

    def abort(self, request_id: str) -> None:
        """Stop a request between steps (step() holds the lock, so no forward is in flight): free its blocks
        as the plain engine does, and if it is in the already prepared step N+1, prepare that step without it
        (its slots would otherwise be written after the blocks went back to the pool)."""
        with self._lock:
            seq = self.requests.get(request_id)
            super().abort(request_id)
            if seq is not None and self._next is not None and any(s is seq for s, _ in self._next[0].scheduled):
                self._drop_from_next(lambda s: s is seq)

    def close(self) -> None:
        self._worker.shutdown(wait=True)
