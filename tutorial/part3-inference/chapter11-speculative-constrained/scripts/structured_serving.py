"""Structured output inside the serving engine: a schema mask per request in the batched sampler, and its cost.

What it shows
    constrained_decoding.py masked one sequence at a time. A server batches: requests with and without a
    response_format share each step, so the engine (mlsys/engine/sampler.py, apply_structured_masks) looks up
    one mask row per structured request, in that request's own automaton state, and masks only those rows.
    1. A mixed batch of --batch-size sequences: --batch-size/4 requests with a JSON schema (response_format
       json_schema in the API) and the API's n (answers per request) = 2 fill half of them, --batch-size/2 free
       requests (one answer each) the other half; at the default 16: 4 structured requests x 2 answers + 8 free
       = 12 requests, 16 sequences. Every structured answer validates (jsonschema), and every free request
       produces exactly the tokens it produces alone (self-checks).
    2. The cost of the masks in a decode step: the same batch decoded twice, every request structured and none,
       for the same number of steps (each free request generates as many tokens as its structured twin).
       Timed side by side, alternating, --repeats times after a warm-up, with the garbage collector held
       off, by the engine's own stage timings: the median full-batch decode step both ways, the median of its
       "sample" stage (where the masks run, with the sampler), and the extra sample time as a share of the free
       step (the rest of the step does the same work both ways). The goal, the book's own round target for a cost
       that stays small beside the step (not a figure from a paper or a server), is under 10% of a decode step.

How to run
    python tutorial/part3-inference/chapter11-speculative-constrained/scripts/structured_serving.py
    python tutorial/part3-inference/chapter11-speculative-constrained/scripts/structured_serving.py \\
        --batch-size 32 --repeats 5

Runtime on 2 cores: about 4 s, 4 s with --smoke.

Try next
    python tutorial/part3-inference/chapter11-speculative-constrained/scripts/structured_serving.py --batch-size 64
        -> more rows to mask per step, and a bigger forward to hide them in: the share stays small
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

import jsonschema
import torch

from mlsys import bench, cli, report
from mlsys.data import Tokenizer
from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.json_constrained import RECORD_SCHEMA
from mlsys.weights import load_pretrained


@dataclass
class Settings(cli.Args):
    batch_size: int = 16
    """Requests decoding together in each timed step."""
    max_tokens: int = 90
    """Token budget of each structured answer (the record schema's shortest document needs fewer)."""
    repeats: int = 5
    """Timed runs of each variant, after one warm-up of each."""

    def validate(self) -> None:
        if not 2 <= self.batch_size <= 128:
            raise cli.UsageError("--batch-size must be from 2 to 128")
        if self.repeats < 1:
            raise cli.UsageError("--repeats must be >= 1")
        if not 70 <= self.max_tokens <= 200:
            raise cli.UsageError("--max-tokens must be from 70 (the record schema needs that many) to 200")


def step_times(engine: Engine, params: list[SamplingParams], batch: int) -> tuple[list[dict], list]:
    """Run one request per params; (the engine's stage timings of every step that decoded the whole batch, final
    outputs). The masks run in the "sample" stage, with the sampler."""
    for sp in params:
        engine.add_request("{", sp)
    times, final = [], {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id, out.index] = out
        t = engine.last_step_timing
        if t["num_seqs"] == batch and t["num_batched_tokens"] == batch:  # a decode step of the full batch
            times.append(t)
    return times, [final[k] for k in sorted(final, key=lambda k: (int(k[0].split("-")[1]), k[1]))]


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"batch_size": 8, "repeats": 1})
    torch.set_num_threads(1)
    model, tok = load_pretrained("small"), Tokenizer()
    config = EngineConfig(max_num_seqs=args.batch_size, block_size=16)

    # 1. a mixed batch: half the sequences structured (n=2 answers per request), half free
    half = args.batch_size // 2
    structured = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=s, n=2, json_schema=RECORD_SCHEMA)
                  for s in range(half // 2 or 1)]
    free = [SamplingParams(max_tokens=40, temperature=1.0, seed=100 + s, ignore_eos=True) for s in range(half)]
    _, outs = step_times(Engine(model, tok, config), structured + free, -1)
    ids = {f"req-{i}" for i in range(len(structured))}  # the engine numbers requests in the order they came
    docs = [o for o in outs if o.request_id in ids]
    for o in docs:
        jsonschema.validate(json.loads(o.text), RECORD_SCHEMA)
    num_valid = len(docs)
    print(f"mixed batch: {len(structured)} structured requests x n=2 + {len(free)} free = "
          f"{len(structured) + len(free)} requests, {2 * len(structured) + len(free)} sequences; {num_valid} "
          f"structured answers, every one valid under the record schema; e.g. {docs[0].text}")
    alone = Engine(model, tok, config).generate(["{"] * len(free), free)
    report.expect_equal("free requests in the mixed batch = alone",
                        [o.token_ids for o in outs if o.request_id not in ids], [o.token_ids for o in alone])

    # 2. the mask's cost: every request structured, against none, for the same number of steps
    # --8<-- [start:timing]
    masked = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=s, json_schema=RECORD_SCHEMA)
              for s in range(args.batch_size)]
    _, docs = step_times(Engine(model, tok, config), masked, args.batch_size)
    lengths = [len(o.token_ids) for o in docs]  # each free twin generates exactly as many tokens
    plain = [SamplingParams(max_tokens=n, temperature=1.0, seed=s, ignore_eos=True) for s, n in enumerate(lengths)]
    runs: dict[str, list[dict]] = {"structured": [], "free": []}
    with bench.steady_timing():
        for rep in range(args.repeats + 1):  # the first round warms up, untimed
            for name, params in (("structured", masked), ("free", plain)):
                times, _ = step_times(Engine(model, tok, config), params, args.batch_size)
                if rep:
                    runs[name] += times
    # --8<-- [end:timing]
    med = {k: statistics.median(t["total"] for t in v) for k, v in runs.items()}  # a whole decode step
    sample = {k: statistics.median(t["sample"] for t in v) for k, v in runs.items()}  # masks + sampler
    extra = sample["structured"] - sample["free"]  # what the masks add; the rest of the step is the same work
    share = extra / med["free"]
    print(report.table([{"batch": args.batch_size, "variant": k, "full-batch decode steps timed": len(runs[k]),
                         "median step (ms)": 1e3 * med[k], "median sample stage (ms)": 1e3 * sample[k]}
                        for k in runs]))
    verdict = "met" if share < 0.10 else "not met"
    print(f"\nthe masks add {1e3 * extra:.3f} ms (sample stage) to a {1e3 * med['free']:.2f} ms decode step of "
          f"{args.batch_size} requests: {share:.1%} of the step; the goal of under 10% is {verdict} "
          f"({bench.load_average()})")
    step_diff = med["structured"] - med["free"]  # the masks' cost plus the noise of two whole-step timings
    print(f"whole-step medians differ by {1e3 * step_diff:.3f} ms ({step_diff / med['free']:.1%}): the same masks, "
          "plus the noise of timing the forward and scheduling, which do the same work both ways")
    if args.json:
        report.write_json(args.json, {"median_step_s": med, "extra_s": extra, "extra_ms": 1e3 * extra,
                                      "free_step_ms": 1e3 * med["free"], "share": share, "goal_met": share < 0.1,
                                      "structured_step_ms": 1e3 * med["structured"], "step_diff_ms": 1e3 * step_diff,
                                      "step_diff_share": step_diff / med["free"],
                                      "mixed_requests": {"structured": len(structured), "free": len(free)},
                                      "verdict": verdict, "batch_size": args.batch_size,
                                      "steps_timed": {k: len(v) for k, v in runs.items()},
                                      "num_valid_mixed": num_valid}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
