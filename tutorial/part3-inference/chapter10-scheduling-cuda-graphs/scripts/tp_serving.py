"""Tensor-parallel serving on this machine: how much of a decode step is communication, at TP = 1, 2 and 4.

What it shows
    The engine with EngineConfig(tensor_parallel_size=N) (mlsys/engine/tp.py): this process is rank 0 and N-1
    worker processes hold the rest of the shards; each rank holds 1/N of every layer's heads and MLP, and of the
    KV cache. Each decode step then costs two all-reduces per layer, of the step's (tokens, hidden) activations.
    1. Self-check: the tokens at every N equal the tokens at N = 1.
    2. For each N, over the decode steps of a full batch: the median step time; the time rank 0 spends sending
       the batch (send_ms: TPRunner.execute until its own forward starts, the picture's broadcast box) and inside
       all-reduce (waiting for the slowest rank included in both); the bytes the step's all-reduces were given
       together, against the formula 2 * layers * tokens * hidden * 4 bytes (float32); and the share of the step
       inside all-reduce (comm_share). The KV bytes each rank holds shrink as 1/N.
    3. Which rows or columns of layer 0's weights each rank holds at the smallest N above 1 (tp_shards.png), read
       from the ranks' real shards. The picture (tp_step.png): three decode steps at that N traced with
       torch.profiler on rank 0, with every sublayer's compute labelled; the fastest of them drawn on four lanes
       (where each layer begins; rank 0's compute; rank 0 inside a collective: sending the batch, then the two
       all-reduces of every layer; gloo's threads carrying the collectives out), and the trace itself beside it
       (tp_step.trace.json, for ui.perfetto.dev). The line above the figure's path gives that step's time, its
       all-reduce time and share, the time spent sending the batch, and the median all-reduce against the median
       compute of one sublayer (its pieces on either side of its all-reduce added). The JSON keeps the drawn boxes
       ("traced_step").
    On this machine the ranks are processes on 2 CPU cores talking through gloo over loopback TCP: every
    all-reduce is a few system calls and copies, and N ranks share 2 cores. There is nothing to gain here, and
    the table and the picture show what it costs. With GPUs joined by NVLink the same all-reduce of a few hundred
    KiB takes tens of microseconds while each GPU's share of the matmuls shrinks N-fold, which is where
    tensor-parallel serving pays off (and where a model too big for one GPU's memory needs it at all). With GPUs
    (--device auto or cuda), the same table follows on NCCL, rank r on cuda:r, for the sizes this machine has
    GPUs for; without them the script says so and prints the gloo table alone (the picture is always gloo's).

How to run
    python tutorial/part3-inference/chapter10-scheduling-cuda-graphs/scripts/tp_serving.py
    python .../tp_serving.py --sizes 1 2 --batch-size 32

Runtime on 2 idle cores: about 10 s, 8 s with --smoke; on a busy machine (a printed load average above the core
count) up to about load average / cores times that.

Try next
    python tutorial/part3-inference/chapter10-scheduling-cuda-graphs/scripts/tp_serving.py --batch-size 64
        -> more tokens per all-reduce: the bytes grow with the batch, the number of all-reduces does not; the KV
           bytes per rank grow with the batch too (the pool is sized for max_num_seqs); whether an all-reduce of 4x
           the bytes takes longer here can be read against a default run only at a similar load average
"""

from __future__ import annotations

import os
import statistics
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mlsys import bench, cli, plot, report
from mlsys.data import Tokenizer, make_corpus
from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.engine import tp as tp_module
from mlsys.tp_comm import ReduceFromTP
from mlsys.weights import load_pretrained


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    sizes: list[int] = field(default_factory=lambda: [1, 2, 4])
    """Tensor-parallel sizes to run (each must divide the small model's 4 heads)."""
    batch_size: int = 16
    """Requests decoding together."""
    max_tokens: int = 32
    """Tokens each request generates (all of them: ignore_eos)."""
    device: typing.Literal["auto", "cpu", "cuda"] = "auto"
    """cpu: gloo ranks only; cuda: NCCL ranks only (one GPU per rank); auto: gloo, then NCCL where GPUs exist."""

    def validate(self) -> None:
        if not self.sizes or any(n not in (1, 2, 4) for n in self.sizes):
            raise cli.UsageError("--sizes must be taken from 1, 2 and 4 (they must divide the model's 4 heads)")
        if self.device == "cuda" and torch.cuda.device_count() < max(self.sizes):
            raise cli.UsageError(f"--device cuda needs {max(self.sizes)} GPUs for --sizes {self.sizes}; this "
                                 f"machine has {torch.cuda.device_count()}")
        if not 1 <= self.batch_size <= 64 or not 6 <= self.max_tokens <= 128:
            raise cli.UsageError("--batch-size must lie in 1..64 and --max-tokens in 6..128 (a prefill, two "
                                 "warm-up decode steps, then three traced ones)")


# --8<-- [start:measure]
def measure(model, prompts: list[list[int]], args: Settings, size: int, device: str = "cpu") -> dict:
    """Run the batch at tensor-parallel size `size`; stage timings of the full-batch decode steps, rank 0's
    time sending the batch and its all-reduce time and bytes during them, and the tokens."""
    engine = Engine(model, Tokenizer(), EngineConfig(tensor_parallel_size=size, max_num_seqs=args.batch_size,
                                                     device=device))
    try:
        sent = {"s": 0.0, "t0": 0.0}  # rank 0's time sending the batch: TPRunner.execute up to its local forward
        if size > 1:
            runner = engine.runner
            execute, forward = runner.execute, runner.local.execute

            def timed_execute(*a, **k):
                sent["t0"] = time.perf_counter()
                return execute(*a, **k)

            def timed_forward(*a, **k):
                sent["s"] += time.perf_counter() - sent["t0"]
                return forward(*a, **k)

            runner.execute, runner.local.execute = timed_execute, timed_forward
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
        steps, outs = [], {}
        with bench.steady_timing():
            while engine.has_unfinished():
                before, sent_before = dict(tp_module.COMM), sent["s"]
                for out in engine.step():
                    if out.finished:
                        outs[out.request_id] = out.token_ids
                t = engine.last_step_timing
                if t["num_seqs"] == args.batch_size and t["num_batched_tokens"] == args.batch_size:  # decode
                    steps.append((t["total"], tp_module.COMM["all_reduce_s"] - before["all_reduce_s"],
                                  tp_module.COMM["all_reduce_bytes"] - before["all_reduce_bytes"],
                                  tp_module.COMM["all_reduce_calls"] - before["all_reduce_calls"],
                                  sent["s"] - sent_before))
        kv = engine.stats()["kv_cache_bytes"]
    finally:
        engine.close()
    c = model.config
    step_s = statistics.median(s[0] for s in steps)
    comm_s = statistics.median(s[1] for s in steps)
    send_s = statistics.median(s[4] for s in steps)
    return {"tp": size, "step_ms": 1e3 * step_s, "send_ms": 1e3 * send_s, "all_reduce_ms": 1e3 * comm_s,
            "comm_share": comm_s / step_s,
            "all_reduces_per_step": steps[-1][3], "bytes_per_step": steps[-1][2],
            "formula_bytes_per_step": 2 * c.n_layer * args.batch_size * c.n_embd * 4 if size > 1 else 0,
            "kv_bytes_per_rank": kv, "steps_timed": len(steps),
            "tokens": [outs[k] for k in sorted(outs, key=lambda k: int(k.split("-")[1]))]}
# --8<-- [end:measure]


def shard_map(model, size: int) -> dict:
    """Which rows (a split of the outputs) or columns (of the inputs) of layer 0's dense (out, in) weights each rank's
    real shard holds: every shard_model slice located in the dense weight it was cut from."""
    dense, C = model.blocks[0], model.config.n_embd
    full = {"q": dense.attn.c_attn.weight[:C], "k": dense.attn.c_attn.weight[C : 2 * C],
            "v": dense.attn.c_attn.weight[2 * C :], "attn out": dense.attn.c_proj.weight,
            "MLP up": dense.mlp.c_fc.weight, "MLP down": dense.mlp.c_proj.weight}
    out = {k: {"shape": list(w.shape), "split": "columns" if k in ("attn out", "MLP down") else "rows", "ranks": []}
           for k, w in full.items()}
    for r in range(size):
        b = tp_module.shard_model(model, r, size).blocks[0]
        for k, w in zip(full, (b.wq, b.wk, b.wv, b.wo, b.up[0].weight, b.down.weight)):
            cols = out[k]["split"] == "columns"
            d, n = (full[k].T, w.shape[1]) if cols else (full[k], w.shape[0])
            start = next(i for i in range(d.shape[0] - n + 1) if torch.equal(d[i : i + n], w.T if cols else w))
            out[k]["ranks"].append([start, start + n])
    return out


def draw_shards(shards: dict, size: int, args: Settings) -> Path:
    plt = plot.pyplot()
    fig, axes = plt.subplots(1, len(shards), figsize=(12, 3.4))
    for ax, (name, m) in zip(axes, shards.items()):
        owner = torch.zeros(m["shape"])  # (out, in): which rank holds each weight
        for r, (a, b) in enumerate(m["ranks"]):
            (owner[:, a:b] if m["split"] == "columns" else owner[a:b]).fill_(r)
        ax.imshow(owner, cmap="tab10", vmin=0, vmax=9, aspect="equal", interpolation="nearest")
        reduce = "\neach rank's output: a partial\nsum, then all-reduced" if m["split"] == "columns" else "\n\n"
        ax.set(title=f"{name} {tuple(m['shape'])}\nsplit by {m['split']}{reduce}", xticks=[], yticks=[], xlabel="in",
               ylabel="out")
    fig.suptitle(f"Layer 0's weights at TP={size}, each colour one rank's shard (" + ", ".join(
        f"rank {r}: {c}" for r, c in enumerate(["blue", "orange", "green", "red"][:size])) + ")", fontsize=10)
    fig.tight_layout()
    return plot.save(fig, args, "tp_shards")


# --8<-- [start:trace]
STEP, FORWARD, SEND = "decode step", "forward on rank 0's shard", "runner.execute"
ENGINE_REGIONS = ("prepare", "embed", "head", "sample", "detokenize")  # rank 0's labelled work outside the layers
TRIES = 3  # decode steps traced; the picture keeps the fastest (on a shared machine one may be interrupted)
ALL_REDUCE = ReduceFromTP.__name__  # the profiler names an autograd Function's forward after its class


def labelled(fn, name: str):
    """`fn`, run inside a profiler region called `name`, so that the trace says what each op belongs to."""
    def run(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return run


def trace_decode_step(model, prompts: list[list[int]], args: Settings, size: int, trace_path: Path) -> None:
    """TRIES full-batch decode steps of a TP=`size` engine under torch.profiler, as rank 0 runs them, written as a
    Chrome trace. Rank 0's shard labels its sublayers ("layer i attention", "layer i MLP"), embedding and head;
    the engine its sample and detokenize, and the runner's execute (broadcast of the batch, then the forward)."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # quiet: the profiler logs every start and stop otherwise
    engine = Engine(model, Tokenizer(), EngineConfig(tensor_parallel_size=size, max_num_seqs=args.batch_size))
    try:
        runner = engine.runner  # rank 0's TPRunner; .local is its ModelRunner on rank 0's shard
        shard = runner.local.model
        for i, block in enumerate(shard.blocks):
            block.attention_qkv = labelled(block.attention_qkv, f"layer {i} attention")
            block.attention_out = labelled(block.attention_out, f"layer {i} attention")
            block.feed_forward = labelled(block.feed_forward, f"layer {i} MLP")
        attend = runner.local.attention  # paged attention over this rank's KV heads, called with the layer index
        runner.local.attention = lambda layer, *rest: labelled(attend, f"layer {layer} attention")(layer, *rest)
        shard.embed, shard.head = labelled(shard.embed, "embed"), labelled(shard.head, "head")
        runner.local.execute = labelled(runner.local.execute, FORWARD)
        runner.execute, runner.prepare = labelled(runner.execute, SEND), labelled(runner.prepare, "prepare")
        # after the forward, rank 0 alone samples and detokenizes (the engine's own stages, by their names)
        engine._sample, engine._update = labelled(engine._sample, "sample"), labelled(engine._update, "detokenize")
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
        full = lambda t: t["num_seqs"] == t["num_batched_tokens"] == args.batch_size  # a full-batch decode step
        decodes = 0
        while decodes < 2:  # warm-up: the prefill, then two full-batch decode steps
            engine.step()
            decodes += full(engine.last_step_timing)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(TRIES):
                with torch.profiler.record_function(STEP):
                    engine.step()
                if not full(engine.last_step_timing):
                    raise cli.SelfCheckFailed(f"a traced step was not a decode of all {args.batch_size} sequences")
        prof.export_chrome_trace(str(trace_path))
    finally:
        engine.close()
# --8<-- [end:trace]


# --8<-- [start:spans]
def step_spans(trace_path: Path) -> tuple[list[plot.Span], dict]:
    """The fastest traced step as boxes on four lanes, in ms from its start: where each layer begins; rank 0's
    compute (the labelled regions, minus the time spent inside a collective); rank 0's time inside a collective
    (sending the batch, and each all-reduce, named after the sublayer that called it); and gloo's own threads
    carrying the collectives out (exchanging with rank 1, waiting for its half included). Also what the lesson
    reads off them."""
    raw = plot.trace_spans(trace_path, lane_of=lambda e: str(e.get("tid")), kind_of=lambda e: "")
    step = min((s for s in raw if s.label == STEP), key=lambda s: s.end - s.start)
    main = [s for s in raw if s.lane == step.lane and step.start <= s.start and s.end <= step.end]
    regions = [s for s in main if s.label.startswith("layer ") or s.label in ENGINE_REGIONS]
    forward = next(s for s in main if s.label == FORWARD)
    send = next(s for s in main if s.label == SEND)
    waits = [plot.Span("collective", send.start, forward.start, "batch", "broadcast")]
    for s in sorted((s for s in main if s.label == ALL_REDUCE), key=lambda s: s.start):
        caller = next(r for r in regions if r.label.startswith("layer ") and r.start <= s.start <= r.end)
        i, part = caller.label.split()[1:]
        waits.append(plot.Span("collective", s.start, s.end, f"L{i} {'attn' if part == 'attention' else part}",
                               "all-reduce"))
    compute: list[plot.Span] = []
    for r in sorted(regions, key=lambda r: r.start):  # each region minus the waits inside it
        cuts = sorted((w.start, w.end) for w in waits if w.start < r.end and w.end > r.start)
        start = r.start
        for lo, hi in [*cuts, (r.end, r.end)]:
            if lo > start:
                label = r.label.replace("layer ", "L").replace(" attention", " attn")
                kind = "attention" if "attention" in r.label else "MLP" if "MLP" in r.label else "other"
                last = compute[-1] if compute else None
                if last and last.label == label and not any(last.end <= w.start < start for w in waits):
                    last.end = min(lo, r.end)  # the same sublayer, no collective in between: one box
                else:
                    compute.append(plot.Span("compute", start, min(lo, r.end), label, kind))
            start = max(start, hi)
    gloo = [plot.Span("gloo", s.start, s.end, "", "gloo runs the collective") for s in raw
            if s.label.startswith("gloo:") and step.start <= s.start <= step.end]
    layers = {}  # the step lane: where each layer begins, from its first region
    for r in regions:
        if r.label.startswith("layer "):
            layers.setdefault(int(r.label.split()[1]), r.start)
    edges = [step.start, *layers.values(), max(r.end for r in regions if r.label.startswith("layer ")), step.end]
    # short layer names, so that a narrow layer's box still has room for its label
    names = ["prepare, send batch", *(f"L{i}" for i in layers), "head, sample, detokenize"]
    parts = [plot.Span("step", a, b, n, "engine" if i in (0, len(names) - 1) else f"layer {i % 2}")
             for i, (a, b, n) in enumerate(zip(edges, edges[1:], names))]
    spans = [plot.Span(s.lane, s.start - step.start, s.end - step.start, s.label, s.kind)
             for s in [*parts, *compute, *waits, *gloo]]
    reduce_ms = sum(w.end - w.start for w in waits if w.kind == "all-reduce")
    step_ms = step.end - step.start
    per_sublayer: dict[str, float] = {}  # a sublayer's compute is cut in pieces by its all-reduce: sum them
    for c in compute:
        if c.kind in ("attention", "MLP"):
            per_sublayer[c.label] = per_sublayer.get(c.label, 0.0) + c.end - c.start
    collective_ms = sum(w.end - w.start for w in waits)
    summary = {"step_ms": step_ms, "all_reduces": sum(w.kind == "all-reduce" for w in waits),
               "all_reduce_ms": reduce_ms, "broadcast_ms": waits[0].end - waits[0].start,
               "compute_ms": sum(c.end - c.start for c in compute), "all_reduce_share": reduce_ms / step_ms,
               "broadcast_share": (waits[0].end - waits[0].start) / step_ms,
               "collective_ms": collective_ms, "collective_share": collective_ms / step_ms,
               "median_all_reduce_ms": statistics.median(w.end - w.start for w in waits if w.kind == "all-reduce"),
               "longest_all_reduce_ms": max(w.end - w.start for w in waits if w.kind == "all-reduce"),
               "sublayer_compute_ms": per_sublayer,
               "median_sublayer_compute_ms": statistics.median(per_sublayer.values())}
    return spans, summary
# --8<-- [end:spans]


def draw_step(spans: list[plot.Span], summary: dict, size: int, args: Settings) -> Path:
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(12, 3.4))
    lanes = {"step": "rank 0: the step", "compute": "rank 0: compute", "collective": "rank 0: in a collective",
             "gloo": "gloo's threads: running it"}
    import seaborn as sns

    c = sns.color_palette("colorblind", 10)
    palette = {"attention": c[0], "MLP": c[2], "other": c[7], "all-reduce": c[3], "broadcast": c[4],
               "gloo runs the collective": c[5],
               "engine": "0.97", "layer 0": "0.82", "layer 1": "0.9"}  # the step lane: greys
    # every all-reduce box gets its label ("L0 attn", "L0 MLP", ...): written across a wide box, turned upright in a
    # narrow one (plot.timeline would leave a narrow box blank)
    plot.timeline(ax, [plot.Span(lanes[s.lane], s.start, s.end, "" if s.kind == "all-reduce" else s.label, s.kind)
                       for s in spans],
                  list(lanes.values()), unit="ms since the decode step started (rank 0)", palette=palette,
                  legend=False, fontsize=7)
    y = len(lanes) - 1 - list(lanes).index("collective")
    for s in spans:
        if s.kind == "all-reduce" and s.label:
            wide = (s.end - s.start) / summary["step_ms"] * 60 >= len(s.label) * 7 / 8
            ax.text((s.start + s.end) / 2, y, s.label, ha="center", va="center", fontsize=7 if wide else 6,
                    rotation=0 if wide else 90)
    from matplotlib.patches import Patch

    shown = ["attention", "MLP", "other", "all-reduce", "broadcast", "gloo runs the collective"]
    ax.legend(handles=[Patch(facecolor=palette[k], edgecolor="black", label=k if k != "other" else
                             ", ".join(ENGINE_REGIONS)) for k in shown], loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=7, frameon=False)
    ax.set_xlim(0, summary["step_ms"])
    ax.set_title(f"The fastest of {TRIES} decode steps at TP={size} on this CPU, from rank 0's torch.profiler "
                 f"trace: {summary['all_reduces']} all-reduces, {summary['collective_share']:.0%} of the step inside "
                 "a collective", fontsize=9)
    fig.tight_layout()
    return plot.save(fig, args, "tp_step")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"sizes": [1, 2], "batch_size": 4, "max_tokens": 8})
    torch.set_num_threads(1)  # rank 0 shares the 2 cores with its workers
    model, tok = load_pretrained("small"), Tokenizer()
    lines = make_corpus(args.batch_size, seed=args.seed).splitlines()
    prompts = [tok.encode(line[:12], bos=True) for line in lines[: args.batch_size]]
    gpus = torch.cuda.device_count()
    print(f"the small GPT ({model.config.n_layer} layers, hidden {model.config.n_embd}), a batch of "
          f"{args.batch_size} requests decoding ({bench.load_average()})")
    tables = {}
    if args.device in ("auto", "cpu"):
        tables["gloo on CPU ranks"] = [measure(model, prompts, args, n) for n in sorted(set(args.sizes))]
    nccl_sizes = [n for n in sorted(set(args.sizes)) if n <= gpus]
    if args.device in ("auto", "cuda") and nccl_sizes:
        tables[f"NCCL, one GPU per rank ({torch.cuda.get_device_name(0)})"] = [
            measure(model, prompts, args, n, "cuda") for n in nccl_sizes]
    elif args.device == "auto":
        print("no GPU here: no NCCL table (with GPUs, the same run follows on NCCL)")
    for name, rows in tables.items():
        print(f"\n{name}:")
        print(report.table([{k: v for k, v in r.items() if k != "tokens"} for r in rows], floatfmt=".3g"))
        for r in rows:
            report.expect_equal(f"tokens at TP={r['tp']} = TP={rows[0]['tp']} ({name})", r["tokens"],
                                rows[0]["tokens"])
            report.expect_equal(f"all-reduce bytes per step at TP={r['tp']}", r["bytes_per_step"],
                                r["formula_bytes_per_step"])
        print(f"   check passed: the tokens at TP={', '.join(str(r['tp']) for r in rows)} are identical "
              f"({len(rows[0]['tokens'])} requests x {len(rows[0]['tokens'][0])} tokens), and every row's all-reduce "
              "bytes per step equal the formula")
    runs = next(iter(tables.values()))
    base = runs[0]
    last = runs[-1]
    print(f"\nTP={last['tp']}: {last['step_ms'] / base['step_ms']:.3g}x the step time of TP={base['tp']}, "
          f"{last['comm_share']:.0%} of it inside all-reduce; each rank holds "
          f"{last['kv_bytes_per_rank'] / base['kv_bytes_per_rank']:.3g}x the KV bytes")
    traced = next((n for n in sorted(set(args.sizes)) if n > 1), None)
    picture = None
    if traced:
        shards = shard_map(model, traced)
        print(f"figure: {draw_shards(shards, traced, args)}")
        trace_path = plot.figure_dir(args) / "tp_step.trace.json"
        trace_decode_step(model, prompts, args, traced, trace_path)
        spans, picture = step_spans(trace_path)
        print(f"\none decode step at TP={traced} under the profiler (rank 0): {picture['step_ms']:.2f} ms; inside "
              f"a collective: {picture['all_reduces']} all-reduces {picture['all_reduce_ms']:.2f} ms "
              f"({picture['all_reduce_share']:.0%}) + sending the batch {picture['broadcast_ms']:.2f} ms "
              f"({picture['broadcast_share']:.0%}) = {picture['collective_ms']:.2f} ms "
              f"({picture['collective_share']:.0%}); median all-reduce {picture['median_all_reduce_ms']:.3f} ms "
              f"against a median {picture['median_sublayer_compute_ms']:.3f} ms of compute per sublayer "
              f"(its pieces before and after its all-reduce added); the longest all-reduce "
              f"{picture['longest_all_reduce_ms']:.3f} ms")
        table_ms = next((r["step_ms"] for r in runs if r["tp"] == traced), None)
        if table_ms:
            print(f"   the drawn step is {picture['step_ms'] / table_ms:.2f}x the table's median step at TP={traced} "
                  f"({table_ms:.3g} ms): one traced step, under the profiler, against the median of many. The "
                  "profiler slows each op, but the machine's load moves between the table's steps and this one, "
                  "so the traced step can also come out faster than the median")
            picture |= {"table_step_ms": table_ms, "vs_table": picture["step_ms"] / table_ms}
        picture |= {"tp": traced, "spans": [vars(s) for s in spans]}
        print(f"figure: {draw_step(spans, picture, traced, args)}")
        print(f"trace: {trace_path}")
    else:
        print("\nno TP size above 1 in --sizes: no traced step")
    if args.json:
        report.write_json(args.json, {"runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
                                      "traced_step": picture, "shards": shards if traced else None,
                                      "slowdown": last["step_ms"] / base["step_ms"],
                                      "kv_ratio": last["kv_bytes_per_rank"] / base["kv_bytes_per_rank"],
                                      "last_tp": last["tp"], "last_comm_share": last["comm_share"],
                                      "tables": {name: [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
                                                 for name, rows in tables.items()}}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
