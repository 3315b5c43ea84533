"""Measuring one engine step (Chapter 10): a warmed-up decode batch, per-stage timings, op counts, dispatch cost.

    engine = decode_engine(model, batch_size=8, prompt_len=32)   # 8 sequences past their prefill
    rows = time_decode_steps(engine, num_steps=20)               # engine.last_step_timing of each step
    ops = count_ops(lambda: engine.step())                       # aten ops one step dispatches (profiler)
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter

import torch

from mlsys.bench import steady_timing
from mlsys.data import Tokenizer, make_corpus
from mlsys.engine.engine import Engine, EngineConfig
from mlsys.engine.request import SamplingParams

STAGES = ("schedule", "prepare", "forward", "sample", "detokenize")


def decode_prompts(batch_size: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """batch_size prompts of exactly prompt_len ids: <bos> + the start of a corpus record."""
    tok = Tokenizer()
    lines = make_corpus(batch_size, seed=seed).splitlines()
    return [[tok.bos_id] + tok.encode((line * 4)[: prompt_len - 1]) for line in lines]


def decode_engine(model, batch_size: int, prompt_len: int, max_tokens: int, device: str = "cpu",
                  engine_cls=Engine, **config) -> Engine:
    """An engine with batch_size sequences that have finished their prefill and are decoding."""
    cfg = EngineConfig(max_num_seqs=batch_size, max_num_batched_tokens=max(512, batch_size * prompt_len),
                       max_model_len=prompt_len + max_tokens + 2, device=device, **config)
    engine = engine_cls(model, config=cfg)
    for p in decode_prompts(batch_size, prompt_len):
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    engine.step()  # the prefill of all of them, one step
    return engine


def decode_step_inputs(engine: Engine) -> tuple:
    """ModelRunner.prepare's arguments for one decode step of every running sequence (slots allocated):
    starts, token chunks (the last sampled token), block tables, want_logits."""
    seqs = engine.scheduler.running
    for s in seqs:
        assert engine.block_manager.allocate_slots(s, s.num_new_tokens), "KV pool full"
    return ([s.num_computed_tokens for s in seqs], [s.token_ids[s.num_computed_tokens:] for s in seqs],
            [s.block_table for s in seqs], [True] * len(seqs))


def time_decode_steps(engine: Engine, num_steps: int) -> list[dict]:
    """Run num_steps steps and return each one's last_step_timing (seconds per stage, and the total)."""
    rows = []
    for _ in range(num_steps):
        engine.step()
        rows.append(dict(engine.last_step_timing))
    return rows


def mean_breakdown(rows: list[dict], fastest: float = 1.0) -> dict:
    """Mean seconds per stage over the steps (only the `fastest` fraction of them by total: on a busy
    machine the slowest steps are the ones the OS interrupted); `other` is what the stages do not cover
    (counter updates, and whatever else ran in between); `median_other` is its median over those steps."""
    rows = sorted(rows, key=lambda r: r["total"])[: max(1, round(fastest * len(rows)))]
    out = {k: statistics.fmean(r[k] for r in rows) for k in (*STAGES, "total")}
    out["other"] = out["total"] - sum(out[k] for k in STAGES)
    out["median_other"] = statistics.median(r["total"] - sum(r[k] for k in STAGES) for r in rows)
    return out


# --8<-- [start:count_ops]
def count_ops(fn) -> dict:
    """Profile one call of fn. Returns how many aten ops were dispatched (nested ones included), how many
    of them were called from Python (top-level: each one pays the full Python -> C++ dispatch), those
    top-level calls by name, and on a GPU how many kernels were launched."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # torch 2.13's profiler logs every start/stop to stderr otherwise
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    kernels = len([e for e in prof.events() if e.device_type == DeviceType.CUDA])
    kernels = kernels or sum(len(e.kernels) for e in prof.events())  # older profilers: kernels hang off CPU ops
    return {"aten_ops": len(events), "python_ops": len(top), "kernels": kernels if cuda else None,
            "by_name": Counter(e.name for e in top).most_common()}
# --8<-- [end:count_ops]


# --8<-- [start:tiny_op]
def time_tiny_op(device: str = "cpu", iters: int = 2000) -> float:
    """Seconds per call of an op on 1-element tensors: pure dispatch (Python -> C++ -> kernel) cost,
    since the arithmetic is one add. On a GPU this is the launch cost the CPU pays per kernel."""
    a = torch.ones(1, device=device)
    b, out = torch.ones_like(a), torch.empty_like(a)
    for _ in range(100):
        torch.add(a, b, out=out)
    _sync(device)
    with steady_timing():
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.add(a, b, out=out)
        _sync(device)
        return (time.perf_counter() - t0) / iters
# --8<-- [end:tiny_op]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
