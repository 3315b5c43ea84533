"""Static vs continuous batching on the same seeded workload: throughput, TTFT, TPOT and ITL.

What it shows
    A workload of requests with mixed prompt and output lengths (most answers short, a few long, as in chat
    traffic), served twice by the same engine and weights. By default every request arrives at t = 0 (vLLM's
    benchmark default, --request-rate inf): throughput is a property of the server only while it is saturated;
    with --request-rate R they arrive over time as a Poisson process, and at a rate both schedulers keep up with,
    both "throughputs" just equal the arrival rate while TTFT and ITL still differ.
      static      a batch is formed when the engine is empty and runs until its LAST request finishes;
                  requests that arrive meanwhile wait, and finished requests leave empty seats behind;
      continuous  the batch is re-formed every step (Orca's iteration-level scheduling): a finished
                  request leaves at once and a waiting one takes its seat in the next step.
    Each run prints the summary block of vLLM's benchmark_serving (throughput, TTFT, TPOT, ITL with p50/p99),
    then the headline ratio continuous/static throughput (goal >= 2x; reported, never fails the run), and a
    figure of how many sequences each step ran. Every request must complete with exactly its max_tokens
    tokens and every KV block must be free afterwards (self-checks, exit 1 otherwise).
    The loop is real: between arrivals with nothing to compute it waits for the next arrival; it never sleeps
    in place of work.

How to run
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/batching_bench.py
    python .../batching_bench.py --request-rate 40     # Poisson arrivals over about 2.5 s: a latency view

Runtime on 2 cores: about 10 s (both runs), 3 s with --smoke.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from mlsys import cli, plot, report
from mlsys.data import make_corpus
from mlsys.engine import Engine, EngineConfig, RequestOutput, SamplingParams
from mlsys.server import format_summary, serving_summary
from mlsys.weights import load_pretrained


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    num_requests: int = 96
    """Requests in the workload."""
    request_rate: float = math.inf
    """Mean arrivals per second (Poisson process); inf (the default) sends everything at t = 0."""
    prompt_min: int = 8
    """Shortest prompt, in characters of a JSON record (+1 for <bos>)."""
    prompt_max: int = 56
    """Longest prompt, in characters."""
    short_max: int = 24
    """Short answers: max_tokens drawn uniformly from 4..short_max."""
    long_min: int = 120
    """Long answers: max_tokens drawn uniformly from long_min..long_max."""
    long_max: int = 190
    """Upper end of the long answers (prompt_max + 1 + long_max must fit the model's 256 positions)."""
    long_fraction: float = 0.15
    """Fraction of requests with a long answer."""
    max_num_seqs: int = 32
    """Seats in the batch (EngineConfig.max_num_seqs), the same for both schedulers."""
    threads: int = 1
    """torch intra-op threads. 1: the tiny model's matrices are too small to split, extra threads only wait."""

    def validate(self) -> None:
        if self.num_requests < 1 or self.max_num_seqs < 1 or self.threads < 1:
            raise cli.UsageError("--num-requests, --max-num-seqs and --threads must be at least 1")
        if not self.request_rate > 0:
            raise cli.UsageError(f"--request-rate must be positive (or inf), got {self.request_rate}")
        if not 1 <= self.prompt_min <= self.prompt_max:
            raise cli.UsageError("need 1 <= --prompt-min <= --prompt-max")
        if self.short_max < 4 or not 1 <= self.long_min <= self.long_max:
            raise cli.UsageError("need --short-max >= 4 and 1 <= --long-min <= --long-max")
        if self.prompt_max + 1 + max(self.long_max, self.short_max) > 256:
            raise cli.UsageError("prompt_max + 1 + the longest answer exceeds the model's 256 positions")
        if not 0 <= self.long_fraction <= 1:
            raise cli.UsageError(f"--long-fraction must lie in [0, 1], got {self.long_fraction}")


@dataclass
class WorkItem:
    request_id: str
    arrival: float  # seconds after the start of the run
    prompt: str
    max_tokens: int


# --8<-- [start:workload]
def make_workload(args: Settings) -> list[WorkItem]:
    """Seeded: prompts are record prefixes, answers mostly short with a long tail, Poisson arrivals."""
    rng = random.Random(args.seed)
    records = make_corpus(args.num_requests, seed=args.seed).splitlines()
    t, items = 0.0, []
    for i, record in enumerate(records):
        if math.isfinite(args.request_rate):
            t += rng.expovariate(args.request_rate)  # exponential gaps = a Poisson process
        prompt = record[: rng.randint(args.prompt_min, args.prompt_max)]
        long = rng.random() < args.long_fraction
        n = rng.randint(args.long_min, args.long_max) if long else rng.randint(4, args.short_max)
        items.append(WorkItem(f"req-{i}", t, prompt, n))
    return items
# --8<-- [end:workload]


# --8<-- [start:loop]
def serve_workload(engine: Engine, workload: list[WorkItem]) -> dict:
    """Feed requests at their arrival times and step the engine; returns outputs and a per-step trace."""
    pending = deque(sorted(workload, key=lambda w: w.arrival))
    finals: dict[str, RequestOutput] = {}
    steps = []  # (seconds since start, sequences in the step, tokens in the step)
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0].arrival <= now:  # everything that has arrived joins the queue
            w = pending.popleft()
            params = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True)  # fixed lengths, like the benchmark
            engine.add_request(w.prompt, params, request_id=w.request_id, arrival_time=start + w.arrival)
        if not engine.has_unfinished():
            time.sleep(pending[0].arrival - now)  # idle: no work exists until the next request arrives
            continue
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        timing = engine.last_step_timing
        steps.append((time.perf_counter() - start, timing["num_seqs"], timing["num_batched_tokens"]))
    return {"finals": finals, "steps": steps, "duration": time.perf_counter() - start}
# --8<-- [end:loop]


def run_mode(model, scheduling: str, workload: list[WorkItem], args: Settings) -> dict:
    engine = Engine(model, config=EngineConfig(scheduling=scheduling, max_num_seqs=args.max_num_seqs))
    engine.generate(["{", '{"name": "ada", '], SamplingParams(max_tokens=4))  # warm-up: first calls are slow
    result = serve_workload(engine, workload)
    check_run(engine, workload, result["finals"], scheduling)
    records = [{"arrival": f.metrics.arrival_time, "token_times": f.metrics.token_times,
                "prompt_len": len(f.prompt_token_ids)} for f in result["finals"].values()]  # fmt: skip
    result["summary"] = serving_summary(records, result["duration"])
    result["num_steps"] = len(result["steps"])
    result["mean_seqs_per_step"] = float(np.mean([s[1] for s in result["steps"]]))
    return result


def check_run(engine: Engine, workload: list[WorkItem], finals: dict, scheduling: str) -> None:
    report.expect_equal(f"{scheduling}: requests completed", len(finals), len(workload))
    for w in workload:
        out = finals[w.request_id]
        if len(out.token_ids) != w.max_tokens or out.finish_reason != "length":
            raise cli.SelfCheckFailed(f"{scheduling}: {w.request_id} produced {len(out.token_ids)} tokens "
                                      f"({out.finish_reason}), expected {w.max_tokens}")  # fmt: skip
    stats = engine.stats()
    report.expect_equal(f"{scheduling}: KV blocks in use after the run", stats["num_used_blocks"], 0)
    engine.check_invariants()


def draw(results: dict, args: Settings) -> None:
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for mode, res in results.items():
        t = [s[0] for s in res["steps"]]
        ax.step(t, [s[1] for s in res["steps"]], where="post", label=f"{mode} ({res['duration']:.1f} s)", lw=1.2)
    ax.set_xlabel("time since the first arrival (s)")
    ax.set_ylabel("sequences in the step")
    arrivals = f"{args.request_rate:g} req/s Poisson" if math.isfinite(args.request_rate) else "all at t = 0"
    ax.set_title(f"{args.num_requests} requests, {arrivals}, {args.max_num_seqs} seats")
    ax.legend()
    plot.save(fig, args, "batch_occupancy")


def main() -> None:
    args = cli.parse(Settings, __doc__, smoke={"num_requests": 16, "request_rate": 200.0, "prompt_max": 24,
                                               "short_max": 8, "long_min": 24, "long_max": 32,
                                               "long_fraction": 0.25, "max_num_seqs": 8})  # fmt: skip
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model = load_pretrained("small")
    workload = make_workload(args)
    n_long = sum(w.max_tokens >= args.long_min for w in workload)
    arrivals = f"over {workload[-1].arrival:.2f} s (Poisson, {args.request_rate:g}/s)" if math.isfinite(
        args.request_rate) else "all at t = 0"  # fmt: skip
    print(f"workload: {len(workload)} requests {arrivals}, "
          f"prompts {args.prompt_min}-{args.prompt_max} chars, answers 4-{args.short_max} tokens "
          f"({len(workload) - n_long}) or {args.long_min}-{args.long_max} ({n_long}); {args.max_num_seqs} seats\n")
    results = {}
    for mode in ("static", "continuous"):
        results[mode] = run_mode(model, mode, workload, args)
        print(format_summary(results[mode]["summary"], title=f"{mode} batching"))
        print(f"{'Engine steps:':<40}{results[mode]['num_steps']}")
        print(f"{'Mean sequences per step:':<40}{results[mode]['mean_seqs_per_step']:.1f}\n")
    s, c = results["static"]["summary"], results["continuous"]["summary"]
    ratio = c["output_throughput"] / s["output_throughput"]
    same = sum(results["static"]["finals"][w.request_id].token_ids == results["continuous"]["finals"][
        w.request_id].token_ids for w in workload)  # fmt: skip
    print(f"greedy outputs identical under both schedulers: {same}/{len(workload)}")
    steps_ratio = results["static"]["num_steps"] / results["continuous"]["num_steps"]
    print(f"continuous / static throughput: {ratio:.2f}x  (goal >= 2x: {'goal met' if ratio >= 2 else 'not met'}); "
          f"engine steps: {steps_ratio:.2f}x fewer")
    print(f"TTFT p50: static {s['median_ttft_ms']:.0f} ms, continuous {c['median_ttft_ms']:.0f} ms;  "
          f"ITL p99: static {s['p99_itl_ms']:.1f} ms, continuous {c['p99_itl_ms']:.1f} ms")
    draw(results, args)
    if args.json:
        out = {mode: {**r["summary"], "num_steps": r["num_steps"], "mean_seqs_per_step": r["mean_seqs_per_step"]}
               for mode, r in results.items()}  # fmt: skip
        out.update(throughput_ratio=ratio, goal_met=ratio >= 2, steps_ratio=steps_ratio, identical_outputs=same,
                   num_long=n_long)
        report.write_json(args.json, out, args)


if __name__ == "__main__":
    cli.run(main)
