"""The life of one request, traced: tokenize, queue, schedule, prefill, decode steps, detokenize, stream.

What it shows
    A few background requests are already decoding when the traced request arrives, as on a busy server.
    The script then drives the engine step by step, exactly as a server's engine loop does, and for the traced
    request records every stage of its life:
      tokenize     text -> <bos> + character ids (the server does this before the engine sees the request)
      queue        from the end of tokenize (add_request) to the start of the step that first schedules it
                   (here: the next step)
      schedule / prepare / forward / sample / detokenize
                   the engine's own timing of each step the request took part in (engine.last_step_timing);
                   the first of those steps is its prefill, the rest are decode steps shared with the others
      stream       turning each step's new text into a Server-Sent Event, as mlsys.server sends it
    It prints the step-by-step trace, the time per stage (total, median per call, share; the garbage
    collector held off during the trace, the load average printed beside), and TTFT / TPOT / end-to-end
    latency from the engine's request metrics. TTFT is tokenize + queue + the prefill step's schedule, prepare,
    forward and sample (the first token is stamped after sample; its detokenize and stream come after), plus a
    little untimed bookkeeping inside the step; the script prints that split. Self-check: the traced request's
    tokens equal mlsys.model.generate's greedy output for the same prompt, computed alone with a contiguous cache.
    FIGURE  flat_batch.png (into --plot-dir): the one flat batch the engine ran in the traced request's first
    step, recorded from the engine's own ModelRunner.prepare call: the traced request's prefill chunk beside
    one decode token of every other sequence, with each token's sequence, position and KV slot.
    FIGURE  kv_cache.png (into --plot-dir): after every step, the tokens the traced request holds in the KV
    cache and the slots its blocks claim, and the blocks each running sequence holds, read from the engine's
    own sequences (num_computed_tokens, block_table).

How to run
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/request_lifecycle.py
    python .../request_lifecycle.py --prompt '{"name": "grace", ' --max-tokens 40 --background 0

Runtime on 2 idle cores: about 3 s, 2 s with --smoke (two or three times that on a busy machine, and more
on a heavily shared one).

Try next
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/request_lifecycle.py --background 0
        -> the request alone: every decode step computes one token, and the forward pass gets shorter
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/request_lifecycle.py --background 15
        -> 15 neighbours: each of the traced request's steps now carries 16 sequences, so the median decode
           forward (the line below the stage table) grows against a default run made just before on the same
           machine (compare the two runs, not a number from another machine or hour), and its TPOT usually with
           it (load noise can hide that); the default pool doubles to room for 16 full-length sequences
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/request_lifecycle.py --max-tokens 120 --ignore-eos
        -> a longer answer (120 tokens, past its <eos>): in kv_cache.png the request crosses more 16-token block
           boundaries, and holds more blocks at its last step
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from mlsys import bench, cli, plot, report
from mlsys.data import Tokenizer, make_corpus
from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.engine.tokenizer import encode_prompt
from mlsys.model import generate
from mlsys.server import completion_body, sse_event
from mlsys.serving_metrics import request_latencies
from mlsys.weights import load_pretrained

STAGES = ("schedule", "prepare", "forward", "sample", "detokenize")


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    prompt: str = '{"name": "ada", "age": '
    """The traced request's prompt (characters of the JSON-record alphabet)."""
    max_tokens: int = 48
    """Tokens the traced request may generate (it stops earlier at <eos>, unless --ignore-eos)."""
    ignore_eos: bool = False
    """Keep generating past <eos> until --max-tokens, so that the answer has exactly that many tokens."""
    background: int = 7
    """Requests already decoding when the traced one arrives (they share its decode steps)."""
    show_steps: int = 6
    """Trace rows to print (the first ones, then the last one)."""
    threads: int = 1
    """torch intra-op threads. 1: the tiny model's matrices are too small to split, extra threads only wait."""

    def validate(self) -> None:
        if not self.prompt:
            raise cli.UsageError("--prompt must not be empty")
        try:
            Tokenizer().encode(self.prompt)
        except ValueError as err:
            raise cli.UsageError(f"--prompt: {err}") from None
        if not 1 <= self.max_tokens <= 255 - len(self.prompt):
            raise cli.UsageError(f"--max-tokens must lie in 1..{255 - len(self.prompt)} for this prompt")
        if self.background < 0 or self.show_steps < 1 or self.threads < 1:
            raise cli.UsageError("--background must be >= 0, --show-steps and --threads >= 1")


# --8<-- [start:trace]
def trace_request(engine: Engine, prompt: str, params: SamplingParams) -> dict:
    """Submit `prompt` and step the engine until it finishes; time every stage of its life."""
    t0 = time.perf_counter()
    ids = encode_prompt(engine.tokenizer, prompt)  # 1. tokenize
    t_tok = time.perf_counter() - t0
    rid = engine.add_request(ids, params, arrival_time=t0)  # 2. queue (WAITING)
    steps, chunks, stream_s, kv, starts, final = [], [], [], [], [], None
    while final is None:
        starts.append(time.perf_counter())  # when each step starts: the queue ends at the one that admits us
        outputs = engine.step()  # 3-6. schedule, prepare, forward, sample, detokenize (one iteration)
        timing = dict(engine.last_step_timing)
        kv.append(kv_snapshot(engine))  # who holds how much KV cache after this step (for the figure)
        mine = [o for o in outputs if o.request_id == rid]
        if not mine:
            continue  # a step without us (not possible here: we are admitted in the first step)
        out = mine[0]
        t = time.perf_counter()
        event = sse_event(completion_body(rid, "mlsys-small", 0, out.new_text, out.finish_reason))  # 7. stream
        stream_s.append(time.perf_counter() - t)
        kind = "prefill" if len(out.token_ids) == 1 else "decode"
        steps.append({"step": len(steps), "kind": kind, "seqs": timing["num_seqs"],
                      "tokens": timing["num_batched_tokens"], **{k: timing[k] * 1e3 for k in STAGES},
                      "new_text": out.new_text})
        chunks.append(event)
        final = out if out.finished else None
    return {"ids": ids, "final": final, "steps": steps, "chunks": chunks, "tokenize_s": t_tok, "stream_s": stream_s,
            "rid": rid, "kv": kv, "step_starts": starts}
# --8<-- [end:trace]


def record_flat_batches(engine: Engine) -> list[dict]:
    """Record every flat batch the engine packs from now on: the scheduler's (request, chunk) list and the
    runner's positions and slot_mapping for the same step (wraps the two calls on this engine only)."""
    batches: list[dict] = []
    schedule, prepare = engine.scheduler.schedule, engine.runner.prepare

    def recorded_schedule():
        out = schedule()
        batches.append({"request_ids": [s.request_id for s, _ in out.scheduled],
                        "chunk_sizes": [n for _, n in out.scheduled]})
        return out

    def recorded_prepare(starts, token_chunks, block_tables, want_logits):
        m = prepare(starts, token_chunks, block_tables, want_logits)
        batches[-1].update(starts=list(starts), block_tables=[list(t) for t in block_tables],
                           positions=m.positions.tolist(), slot_mapping=m.slot_mapping.tolist())
        return m

    engine.scheduler.schedule, engine.runner.prepare = recorded_schedule, recorded_prepare
    return batches


def draw_flat_batch(batch: dict, traced: str, block_size: int, args: Settings) -> list[dict]:
    """One cell per token of the packed step: its sequence, position and slot. Returns the cells it drew."""
    plt = plot.pyplot()
    cells = []
    for k, (rid, n) in enumerate(zip(batch["request_ids"], batch["chunk_sizes"])):
        cells += [{"seq": k, "request_id": rid, "row": len(cells) + i} for i in range(n)]
    for c in cells:
        c["position"], c["slot"] = batch["positions"][c["row"]], batch["slot_mapping"][c["row"]]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.36 * len(cells)), 1.9))
    # the traced request takes the first colour (blue), as in kv_cache.png; the others follow in batch order
    order = sorted(range(len(batch["request_ids"])), key=lambda k: batch["request_ids"][k] != traced)
    palette = seq_colours(plt, len(order))
    colours = {k: palette[j] for j, k in enumerate(order)}
    for c in cells:
        ax.add_patch(plt.Rectangle((c["row"], 0), 1, 3, fc=colours[c["seq"]], ec="white", lw=1))
        for y, key in ((2.5, "seq"), (1.5, "position"), (0.5, "slot")):
            ax.text(c["row"] + 0.5, y, str(c[key]), ha="center", va="center", fontsize=6.5, color="black")
    for y, label in ((2.5, "sequence"), (1.5, "position"), (0.5, "KV slot")):
        ax.text(-0.3, y, label, ha="right", va="center", fontsize=8)
    k = batch["request_ids"].index(traced)
    rows = [c["row"] for c in cells if c["seq"] == k]
    ax.text((rows[0] + rows[-1] + 1) / 2, 3.2, f"prefill of the traced request ({len(rows)} tokens, blue)",
            ha="center", va="bottom", fontsize=8)
    others = [c["row"] for c in cells if c["seq"] != k]
    if others:
        ax.text((min(others) + max(others) + 1) / 2, 3.2, f"{len(others)} decode tokens, one per other sequence",
                ha="center", va="bottom", fontsize=8)
    ax.set(xlim=(-4.5, len(cells) + 0.2), ylim=(-0.1, 4.0))
    ax.axis("off")
    ax.set_title(f"one engine step = one flat batch of {len(cells)} tokens (slot = block_table[position // "
                 f"{block_size}] * {block_size} + position % {block_size})", fontsize=9)
    print(f"figure: {plot.save(fig, args, 'flat_batch')}")
    return cells


def seq_colours(plt, n: int) -> list:
    """n distinct colours, the first (the traced request's) always tab10's blue: tab10, then tab20 without its
    light blue (too close to the traced blue), then evenly spaced hues away from blue (no colour is reused)."""
    if n <= 10:
        return [plt.cm.tab10(k) for k in range(n)]
    if n <= 19:
        return [plt.cm.tab20(0)] + [plt.cm.tab20(k) for k in range(2, n + 1)]
    hues = [0.75 * k / (n - 1) for k in range(n - 1)]  # 3/4 of the colour wheel, skipping 0.5 - 0.75 (blues)
    return [plt.cm.tab10(0)] + [plt.cm.hsv(h if h < 0.5 else h + 0.25) for h in hues]


def kv_snapshot(engine: Engine) -> dict[str, tuple[int, list[int]]]:
    """request id -> (tokens whose K/V are cached, its block table), for every running sequence."""
    return {s.request_id: (s.num_computed_tokens, list(s.block_table)) for s in engine.scheduler.running}


def draw_kv(tr: dict, block_size: int, num_blocks: int, args: Settings) -> None:
    """Left: the traced request's cached tokens and claimed slots per step. Right: the pool of physical blocks at
    the traced request's last step, each block coloured by the sequence that owns it."""
    plt = plot.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [1, 1.2]})
    mine = [(i, snap[tr["rid"]]) for i, snap in enumerate(tr["kv"]) if tr["rid"] in snap]
    steps = [i for i, _ in mine]
    axes[0].step(steps, [len(t) * block_size for _, (_, t) in mine], where="post", label="slots its blocks claim")
    axes[0].plot(steps, [n for _, (n, _) in mine], "o-", ms=3, label="tokens with K/V in the cache")
    axes[0].set(xlabel="engine step (0 = its prefill)", ylabel="token slots",
                title=f"the traced request: one block per {block_size} tokens")
    axes[0].legend(loc="upper left")
    last = tr["kv"][steps[-1]]
    cols = 16
    owner = [-1] * num_blocks
    order = sorted(last, key=lambda r: r != tr["rid"])  # traced request first: colour C0
    for k, r in enumerate(order):
        for logical, phys in enumerate(last[r][1]):
            owner[phys] = k
            if r == tr["rid"]:
                axes[1].text(phys % cols, phys // cols, str(logical), ha="center", va="center", color="white")
    colours = ["#ffffff"] + seq_colours(plt, len(order))
    grid = [[owner[i] + 1 for i in range(row * cols, min(num_blocks, (row + 1) * cols))]
            for row in range(-(-num_blocks // cols))]
    from matplotlib.colors import ListedColormap
    axes[1].imshow(grid, cmap=ListedColormap(colours), vmin=0, vmax=len(colours) - 1, aspect="auto")
    axes[1].set_xticks([x - 0.5 for x in range(cols + 1)], labels=[])
    axes[1].set_yticks([y - 0.5 for y in range(len(grid) + 1)], labels=[])
    axes[1].grid(color="0.3", lw=0.5)
    axes[1].set(title=f"the pool of {num_blocks} blocks after step {steps[-1]}, the last before the request's\n"
                      f"final step {len(tr['steps']) - 1} frees them: colour = owning sequence (traced: blue)",
                xlabel="physical block id (row by row); numbers: the traced request's logical blocks")
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'kv_cache')}")


def stage_table(tr: dict) -> list[dict]:
    """Per stage: calls, total ms, median ms per call, share of the total. Stages: tokenize, queue (from the end
    of tokenize to the start of the step that first schedules the request), the engine's stages split into
    prefill and decode, stream. The stages do not overlap."""
    m = tr["final"].metrics
    admitted = max(t for t in tr["step_starts"] if t <= m.first_scheduled_time)  # start of the step that admits it
    per_call = {"tokenize": [tr["tokenize_s"] * 1e3],
                "queue (added -> its first step)": [(admitted - m.arrival_time - tr["tokenize_s"]) * 1e3]}
    for kind in ("prefill", "decode"):
        for stage in STAGES:
            per_call[f"{kind}: {stage}"] = [s[stage] for s in tr["steps"] if s["kind"] == kind]
    per_call["stream (SSE chunks)"] = [t * 1e3 for t in tr["stream_s"]]
    rows = [{"stage": name, "calls": len(ms), "ms": sum(ms), "median_ms": statistics.median(ms) if ms else 0.0}
            for name, ms in per_call.items()]
    total = sum(r["ms"] for r in rows)
    for r in rows:
        r["share_%"] = 100 * r["ms"] / total
    return rows


def busy_engine(model, background: int, seed: int) -> Engine:
    """An engine with `background` requests already decoding (prompt i: the first 10 + 3i characters of a
    record; one prefill step, then two decode steps), seats for one more."""
    engine = Engine(model, config=EngineConfig(max_num_seqs=background + 1))
    engine.generate(["{"], SamplingParams(max_tokens=2))  # warm-up: first calls pay one-off costs
    for i, line in enumerate(make_corpus(background, seed=seed).splitlines()):  # already busy
        engine.add_request(line[: 10 + 3 * i], SamplingParams(max_tokens=200 - 10 - 3 * i, ignore_eos=True))
    for _ in range(3):
        engine.step()  # the background requests prefill and start decoding
    return engine


def main() -> None:
    args = cli.parse(Settings, __doc__, smoke={"max_tokens": 12, "background": 2, "show_steps": 3})
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model = load_pretrained("small")
    engine = busy_engine(model, args.background, args.seed)

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)  # greedy
    batches = record_flat_batches(engine)  # what the scheduler and the runner really packed, step by step
    with bench.steady_timing():  # no garbage-collector pause inside the traced steps
        tr = trace_request(engine, args.prompt, params)
    first_batch = next(b for b in batches if tr["rid"] in b["request_ids"])  # the traced request's prefill step
    out, m = tr["final"], tr["final"].metrics
    print(f"prompt {args.prompt!r} -> {len(tr['ids'])} token ids {tr['ids'][:8]}...  "
          f"({args.background} other requests decoding)\n")
    cut = len(tr["steps"]) > args.show_steps + 1  # the first steps, then the last one: mark the gap where it is
    rows = tr["steps"][: args.show_steps] + [tr["steps"][-1]] if cut else tr["steps"]
    lines = report.table(rows, floatfmt=".2f").splitlines()
    if cut:
        lines.insert(-1, f"... ({len(tr['steps']) - args.show_steps - 1} steps not shown)")
    print("\n".join(lines))
    print(f"{len(tr['steps'])} steps in all\n")
    stages = stage_table(tr)
    print(report.table(stages, floatfmt=".2f"))
    share = {kind: sum(r["share_%"] for r in stages if r["stage"].endswith(kind)) for kind in STAGES}
    decode_median = {r["stage"].split(": ")[1]: r["median_ms"] for r in stages if r["stage"].startswith("decode:")}
    others = sum(decode_median.values()) - decode_median["forward"] - decode_median["prepare"]
    print(f"a decode step (median): forward {decode_median['forward']:.2f} ms, prepare {decode_median['prepare']:.2f} "
          f"ms, the other engine stages {others:.2f} ms; over the request's life, forward passes took "
          f"{share['forward']:.0f}% of the time spent in the stages above; "
          f"{bench.load_average()}\n")
    lat = request_latencies(m.arrival_time, m.token_times)
    by_stage = {r["stage"]: r["ms"] for r in stages}
    ttft_rows = ["tokenize", "queue (added -> its first step)"] + [f"prefill: {k}" for k in STAGES[:-1]]
    ttft_sum = sum(by_stage[k] for k in ttft_rows)
    print(f"streamed text ({len(tr['chunks'])} SSE events, '|' between them):")
    print("  " + "|".join(s["new_text"] for s in tr["steps"]))
    print(f"first event on the wire: {tr['chunks'][0].decode().strip()}\n")
    print(f"finish_reason={out.finish_reason}, {len(out.token_ids)} tokens;  TTFT {lat['ttft'] * 1e3:.2f} ms, "
          f"TPOT {(lat['tpot'] or 0) * 1e3:.2f} ms, end-to-end {lat['e2e'] * 1e3:.1f} ms")
    print(f"TTFT {lat['ttft'] * 1e3:.2f} ms = tokenize + queue + prefill schedule, prepare, forward and sample "
          f"({ttft_sum:.2f} ms) + the step's untimed bookkeeping ({lat['ttft'] * 1e3 - ttft_sum:.2f} ms); the first "
          f"token is stamped after sample, so the prefill's detokenize and stream come after it")

    eos = None if args.ignore_eos else engine.tokenizer.eos_id
    ref = generate(model, torch.tensor([tr["ids"]]), args.max_tokens, eos_id=eos)
    report.expect_equal("traced tokens vs mlsys.model.generate", out.token_ids, ref[0, len(tr["ids"]) :].tolist())
    print("self-check: tokens equal mlsys.model.generate (greedy, alone, contiguous cache)")
    while engine.has_unfinished():  # let the background requests finish, then nothing may be left over
        engine.step()
    report.expect_equal("KV blocks in use after all requests", engine.stats()["num_used_blocks"], 0)
    engine.check_invariants()
    cells = draw_flat_batch(first_batch, tr["rid"], engine.config.block_size, args)
    draw_kv(tr, engine.config.block_size, engine.config.num_blocks, args)
    if args.json:
        report.write_json(args.json, {"prompt_ids": tr["ids"], "token_ids": out.token_ids, "text": out.text,
                                      "finish_reason": out.finish_reason, "ttft_ms": lat["ttft"] * 1e3,
                                      "ttft_rows_ms": ttft_sum,
                                      "tpot_ms": (lat["tpot"] or 0) * 1e3, "e2e_ms": lat["e2e"] * 1e3,
                                      "steps": tr["steps"], "stages": stages, "share_%": share,
                                      "forward_share": share["forward"] / 100,
                                      "decode_median_ms": decode_median,
                                      "num_steps": len(tr["steps"]), "prompt_tokens": len(tr["ids"]),
                                      "block_size": engine.config.block_size,
                                      "num_blocks": engine.config.num_blocks, "traced_request_id": tr["rid"],
                                      "flat_batch": {**first_batch, "cells": cells},
                                      "background_decodes": len(first_batch["request_ids"]) - 1,
                                      "max_kv_blocks": max(len(s[tr["rid"]][1]) for s in tr["kv"] if tr["rid"] in s),
                                      "load_average": bench.load_average()},
                          args)


if __name__ == "__main__":
    cli.run(main)
