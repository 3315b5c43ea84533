"""1F1B in a profiler trace: every stage's forwards, backwards, receives and sends on one clock.

What it shows
    TRACE     W ranks (2 by default, gloo on CPU) run the book's runner (mlsys.pipeline.run_pipeline_step, 1F1B)
              on a GPT cut into W equal stages: one unprofiled warm-up step, then one step under torch.profiler on
              every rank. The runner names its work with record_function: "F3" and "B3" (forward and backward of
              micro-batch 3), "recv act 3" and "recv grad 3" (the time a stage is blocked waiting for that
              message), "send act 3" (posting a send); gloo adds "gloo:send" and "gloo:recv" itself (from the
              moment a message is posted until the runner's wait on it returns; the runner waits for its sends
              only at the end of the step, so those are long and not drawn). Rank 0 merges the ranks' traces into
              pipeline_1f1b.trace.json, one process per stage on one clock (the processes of one machine share
              it): open it in https://ui.perfetto.dev.
    TIMELINE  pipeline_1f1b.png, drawn from that file alone (mlsys.plot.trace_spans): per stage a row of
              forwards and backwards and a row of its messages: the time blocked in each receive, and each send
              where the runner posted it.
    BUBBLE    each stage's idle share of the step, measured on the trace (the step runs from the first compute
              start to the last compute end on any stage), split into the time spent blocked in a receive,
              the time spent posting sends and the rest, against a replay (the same orders and op lengths with
              no gaps between ops) and the ideal clock of the same orders (forward 1 tick, backward 2, messages
              free): (p - 1) / (m + p - 1). The check: the order of F and B
              events in the trace is the order the runner ran (exit 1 otherwise). Timings are reported, never
              a reason to fail.

How to run (world size 2..4)
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/pipeline_trace.py
    torchrun --nproc-per-node 2 tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/pipeline_trace.py

Runtime on 2 cores: about 5 s on an idle machine (over 20 s at load 6), 4 s with --smoke.

Try next
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/pipeline_trace.py --micro-batches 8
        -> twice the micro-batches: the ideal bubble falls from 0.200 to 0.111; the measured share need not
           follow it (on a loaded 2-core machine it can even rise), since the gaps between operations and the
           waits for a core grow with the number of operations
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/pipeline_trace.py -w 3
        -> three stages on two cores: the middle stage receives and sends in both directions, and the ranks
           now also wait for a core
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.data import Tokenizer, get_batch, make_corpus
from mlsys.launch import RankContext, launch
from mlsys.model import GPT, GPTConfig
from mlsys.pipeline import bubble_fraction, measured_bubble, run_pipeline_step, simulate, split_gpt

COMPUTE_RE = re.compile(r"^([FB])(\d+)$")  # the runner's record_function names: F3, B3
WAIT_RE = re.compile(r"^recv (act|grad) (\d+)$")  # the runner's waits for a message
SEND_RE = re.compile(r"^send (act|grad) (\d+)$")  # the runner's isend calls
KINDS = ("forward", "backward", "blocked in recv", "send posted")


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 2
    """Number of ranks = pipeline stages p. Under torchrun it is taken from WORLD_SIZE."""
    micro_batches: int = 4
    """m, micro-batches in the profiled step."""
    micro_batch_size: int = 4
    """Sequences per micro-batch."""
    seq_len: int = 64
    """Tokens per sequence."""
    layers_per_stage: int = 2
    """Transformer blocks on every stage (equal work per stage)."""
    width: int = 128
    """Model width n_embd (4 heads)."""

    def validate(self) -> None:
        if min(self.micro_batches, self.micro_batch_size, self.layers_per_stage) < 1:
            raise cli.UsageError("--micro-batches, --micro-batch-size and --layers-per-stage must be >= 1")
        if not 1 <= self.seq_len <= 256 or self.width < 4 or self.width % 4:
            raise cli.UsageError("--seq-len must be 1..256 and --width a positive multiple of 4")


def build(args: Settings, p: int, rank: int) -> tuple[torch.nn.Module, list, list]:
    """This rank's stage and the m micro-batches of real tokens (the same on every rank)."""
    torch.manual_seed(args.seed)
    config = GPTConfig.preset("small", n_layer=p * args.layers_per_stage, n_embd=args.width, n_head=4)
    stage = split_gpt(GPT(config), p)[rank]
    tokens = Tokenizer().encode_corpus(make_corpus(200, args.seed))
    x, y = get_batch(tokens, args.micro_batches * args.micro_batch_size, args.seq_len,
                     torch.Generator().manual_seed(args.seed))
    return stage, list(x.chunk(args.micro_batches)), list(y.chunk(args.micro_batches))


# --8<-- [start:profile]
def profiled_step(ctx: RankContext, args: Settings) -> tuple[dict, list[tuple[str, int]]]:
    """One warm-up step, then one 1F1B step under torch.profiler. Returns this rank's Chrome trace (as a dict)
    and the order of operations the runner ran."""
    torch.set_num_threads(1)  # equal, predictable compute per stage; the ranks share the cores
    stage, xs, ys = build(args, ctx.world_size, ctx.rank)
    ranks = list(range(ctx.world_size))  # stage s on rank s
    run_pipeline_step(stage, ranks, xs, ys, "1f1b")  # warm-up: allocators, connections
    stage.zero_grad(set_to_none=True)
    with plot.quiet_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dist.barrier()  # inside: starting the profiler takes a while, so the stages start the step together
        out = run_pipeline_step(stage, ranks, xs, ys, "1f1b")
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(str(Path(tmp) / "trace.json"))
        trace = json.loads((Path(tmp) / "trace.json").read_text())
    return trace, out["actions"]
# --8<-- [end:profile]


def merge(traces: list[dict]) -> dict:
    """One Chrome trace of all stages: every rank's events under its own process, named "stage s" (rank s), on
    rank 0's time base (the ranks of one machine read the same clock; ts counts microseconds from the base)."""
    base = int(traces[0].get("baseTimeNanoseconds", 0))
    events = []
    for s, trace in enumerate(traces):
        shift = (int(trace.get("baseTimeNanoseconds", 0)) - base) / 1000.0
        pids = {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X" and isinstance(e.get("pid"), int)}
        for e in trace["traceEvents"]:
            if not isinstance(e.get("pid"), int) or (e.get("ph") == "M" and e.get("name", "").startswith("process")):
                continue  # the profiler's own bookkeeping rows, and process names we replace below
            events.append({**e, "ts": e["ts"] + shift} if "ts" in e else e)
        for pid in pids:
            events += [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"stage {s}"}},
                       {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": s}}]
    return {"traceEvents": events, "baseTimeNanoseconds": base, "displayTimeUnit": "ms"}


def trace_timeline(path: Path) -> tuple[list[plot.Span], int]:
    """The spans to draw, read from the merged trace file alone. Stage s gets two rows: "stage s" with its F and B
    boxes, and "stage s messages" with the time it was blocked in a receive and the moments it posted a send,
    each labelled with the message (a3: the activation of micro-batch 3, g3: its gradient). Time 0 is the first
    compute start on any stage. Returns the spans and the number of stages."""
    raw = json.loads(path.read_text())["traceEvents"]
    stage_of = {e["pid"]: int(e["args"]["name"].split()[1]) for e in raw if e.get("name") == "process_name"}

    def lane_of(e: dict) -> str | None:
        s, name = stage_of.get(e.get("pid")), e.get("name", "")
        if s is None:
            return None
        if COMPUTE_RE.match(name):
            return f"stage {s}"
        return f"stage {s} messages" if WAIT_RE.match(name) or SEND_RE.match(name) else None

    spans = plot.trace_spans(path, lane_of=lane_of)
    t0 = min(sp.start for sp in spans if COMPUTE_RE.match(sp.label))
    out = []
    for sp in sorted(spans, key=lambda sp: (sp.lane, sp.start)):
        if m := COMPUTE_RE.match(sp.label):
            kind, label = ("forward" if m[1] == "F" else "backward"), sp.label
        else:
            m = WAIT_RE.match(sp.label) or SEND_RE.match(sp.label)
            kind, label = ("blocked in recv" if sp.label.startswith("recv") else "send posted"), f"{m[1][0]}{m[2]}"
        out.append(plot.Span(sp.lane, sp.start - t0, sp.end - t0, label, kind))
    return out, len(set(stage_of.values()))


def draw(args: Settings, spans: list[plot.Span], p: int, summary: dict) -> Path:
    """The timeline: boxes for compute, for the time blocked in a receive and for posting a send, and a triangle
    where each send was posted (posting usually takes too little time to show as a box). Message boxes too short
    to see are drawn without an outline (an outline alone would show as a stray black line)."""
    plt = plot.pyplot()
    lanes = [f"stage {s}{part}" for s in range(p) for part in ("", " messages")]
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.55 * len(lanes)))
    palette = {**plot.colours(KINDS), "send posted": "0.45"}  # grey: no orange a backward could be mistaken for
    boxes = [sp if sp.kind != "send posted" else plot.Span(sp.lane, sp.start, sp.end, "", sp.kind) for sp in spans]
    plot.timeline(ax, boxes, lanes, palette=palette, fontsize=7, legend=False,
                  unit="ms since the first forward started (all stages on one clock)")
    span_x = max(sp.end for sp in boxes) - min(sp.start for sp in boxes) or 1.0
    for bar in ax.patches:  # a box under 0.3 % of the step: its outline alone would read as a black line
        if bar.get_width() < 0.003 * span_x:
            bar.set_linewidth(0)
    above = []  # labels drawn above their box or triangle; the ones that would overlap another are dropped below
    for sp in boxes:  # compute and receive boxes too thin for their label (plot.timeline's rule): label above
        visible = sp.end - sp.start >= 0.003 * span_x
        if (sp.kind in ("forward", "backward") or (sp.kind == "blocked in recv" and visible)) \
                and (sp.end - sp.start) / span_x * 60 < len(sp.label) * 7 / 8:
            y = len(lanes) - 1 - lanes.index(sp.lane)
            above.append(ax.annotate(sp.label, ((sp.start + sp.end) / 2, y + 0.4), xytext=(0, 1),
                                     textcoords="offset points", ha="center", va="bottom", fontsize=6))
    for sp in spans:
        if sp.kind == "send posted":
            y = len(lanes) - 1 - lanes.index(sp.lane)
            ax.plot(sp.start, y + 0.25, marker="v", color=palette["send posted"], markersize=7)
            above.append(ax.annotate(sp.label, (sp.start, y + 0.3), xytext=(0, 3), textcoords="offset points",
                                     ha="center", fontsize=6))
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=palette[k], edgecolor="black", label=k) for k in KINDS[:3]]
    handles += [Line2D([], [], marker="v", ls="", color=palette["send posted"], markersize=7, label="send posted"),
                Patch(facecolor=palette["send posted"], edgecolor="black", label="time spent posting it")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_xlim(0, None)
    shares = ", ".join(f"stage {s} {b:.2f}" for s, b in enumerate(summary["measured"]["per_stage"]))
    ax.set_title(f"1F1B, p={p}, m={args.micro_batches}, from the torch.profiler trace: idle share {shares} "
                 f"(ideal clock {summary['ideal']:.2f}); a3 / g3: activation / gradient of micro-batch 3",
                 fontsize=9)
    fig.tight_layout()
    drop_overlapping(fig, [t for t in ax.texts if t not in above], above)
    return plot.save(fig, args, "pipeline_1f1b")


def drop_overlapping(fig, fixed: list, labels: list) -> None:
    """Remove each of labels (left to right) whose text would overlap a fixed text or a label already kept, so
    crowded labels such as a5 and g4 never print on top of each other."""
    renderer = fig.canvas.get_renderer()
    kept = [t.get_window_extent(renderer) for t in fixed]
    for t in sorted(labels, key=lambda t: t.xy[0]):
        box = t.get_window_extent(renderer).expanded(1.1, 1.0)
        if any(box.overlaps(k) for k in kept):
            t.remove()
        else:
            kept.append(box)


def summarize(spans: list[plot.Span], p: int, actions: list[list[tuple[str, int]]]) -> dict:
    """The measured bubble of each stage from the trace's compute boxes, the part of it blocked in a receive, and
    the ideal clock's bubble for the orders that ran."""
    compute = [[{"start": sp.start, "end": sp.end} for sp in spans if sp.lane == f"stage {s}"] for s in range(p)]
    measured = measured_bubble(compute)
    end = max(e["end"] for stage in compute for e in stage)

    def total(kind: str) -> list[float]:  # ms per stage inside the step in the messages row's spans of one kind
        return [sum(max(0.0, min(sp.end, end) - max(sp.start, 0.0)) for sp in spans
                    if sp.lane == f"stage {s} messages" and sp.kind == kind) for s in range(p)]

    ideal = measured_bubble(simulate(lambda s, p_, m_: actions[s], p, len(actions[0]) // 2))
    ops = {k: [sp.end - sp.start for sp in spans if sp.kind == k] for k in ("forward", "backward")}
    shown = round(measured["mean"], 3), round(ideal["mean"], 3)  # as the lesson prints them
    vs = "above" if shown[0] > shown[1] else "below" if shown[0] < shown[1] else "equal to"
    fwd, bwd = sum(ops["forward"]) / len(ops["forward"]), sum(ops["backward"]) / len(ops["backward"])
    replayed = replay(spans, p)["mean"]
    return {"measured": measured, "idle_ms": [measured["span"] - b for b in measured["busy"]],
            "longest_op": longest_op(spans, {"forward": fwd, "backward": bwd}, p),
            "blocked_ms": total("blocked in recv"), "sending_ms": total("send posted"),
            "ideal": ideal["mean"], "ideal_per_stage": ideal["per_stage"],
            "formula": bubble_fraction(p, len(actions[0]) // 2),
            "forward_ms": fwd, "backward_ms": bwd, "measured_vs_ideal": vs, "replayed": replayed,
            # measured - ideal = gaps (measured - replayed, never negative) + op lengths (replayed - ideal, either sign)
            "gaps_added": measured["mean"] - replayed, "lengths_added": replayed - ideal["mean"],
            "cores": len(os.sched_getaffinity(0))}  # the ranks share these cores


def replay(spans: list[plot.Span], p: int) -> dict:
    """The trace's orders and operation lengths with nothing between operations: each F or B starts as soon as its
    stage is free and its input has been computed (F i on stage s after F i on s - 1; B i after B i on s + 1, the last
    stage's after its own F i). It keeps what the ops' own lengths do to the bubble and drops every gap; since the
    trace's ops waited for the same inputs, each stage's measured share can only be larger."""
    ops = [[sp for sp in spans if sp.lane == f"stage {s}"] for s in range(p)]  # each stage's ops in trace order
    done: dict[tuple[str, int, int], float] = {}  # (kind, mb, stage) -> end on the replayed clock
    free, nxt, events = [0.0] * p, [0] * p, [[] for _ in range(p)]
    while any(nxt[s] < len(ops[s]) for s in range(p)):
        before = sum(nxt)
        for s in range(p):
            if nxt[s] == len(ops[s]):
                continue
            sp = ops[s][nxt[s]]
            kind, i = sp.label[0], int(sp.label[1:])
            dep = (None if kind == "F" and s == 0 else ("F", i, s - 1) if kind == "F"
                   else ("F", i, s) if s == p - 1 else ("B", i, s + 1))
            if dep is None or dep in done:
                start = max(free[s], done.get(dep, 0.0))
                free[s] = done[(kind, i, s)] = start + sp.end - sp.start
                events[s].append({"start": start, "end": free[s]})
                nxt[s] += 1
        if sum(nxt) == before:
            raise ValueError("the orders deadlock")
    return measured_bubble(events)


def longest_op(spans: list[plot.Span], means: dict[str, float], p: int) -> str:
    """One sentence on the compute box longest against the mean of its kind, and on the wait it caused. A long op
    on stage s delays the next message stage s sends after it ends, whichever op sends it (with 1F1B a forward is
    often followed by a backward, which sends a gradient to stage s - 1): a k goes to stage s + 1, g k to stage
    s - 1, whose green receive box of that message holds the wait. Only the op's excess over the mean of its kind
    is the long box's doing; the rest of that wait the schedule has anyway, so the sentence splits the two. Only
    when stage s sends nothing after the op does nobody wait for it."""
    top = max((sp for sp in spans if sp.kind in means), key=lambda sp: (sp.end - sp.start) / means[sp.kind])
    s = int(top.lane.split()[1])
    text = (f"the longest box against the mean of its kind was stage {s}'s {top.label}, "
            f"{(top.end - top.start) / means[top.kind]:.1f}× the mean {top.kind}")
    sends = sorted((sp for sp in spans if sp.lane == f"stage {s} messages" and sp.kind == "send posted"
                    and sp.start >= top.end - 1e-6), key=lambda sp: sp.start)
    if not sends:
        return text + f"; stage {s} sent no message after it, so no other stage waited for it"
    msg = sends[0].label
    waiter = s + 1 if msg.startswith("a") else s - 1
    sender = max((sp for sp in spans if sp.lane == f"stage {s}" and sp.end <= sends[0].start + 1e-6),
                 key=lambda sp: sp.end)  # the op that sent it: the last compute box to end before the send
    via = "" if sender is top else f" (sent after its {sender.label})"
    wait = sum(sp.end - sp.start for sp in spans if sp.lane == f"stage {waiter} messages"
               and sp.kind == "blocked in recv" and sp.label == msg)
    step = max(sp.end for sp in spans) - min(sp.start for sp in spans)
    held = f"stage {s}'s next message, {msg}{via}" if via else f"stage {waiter}, which needed its result"
    if wait < max(0.01 * step, 1.0):  # under 1 % of the step or 1 ms: too short to see in the figure
        if via:
            return text + (f"; it delayed {held}, but stage {waiter} was barely held up: its {msg} receive waited "
                           f"only {wait:.2f} ms")
        return text + (f"; {held}, was barely held up by it: its {msg} receive waited only {wait:.2f} ms")
    if wait < 0.5 * means[top.kind]:
        if via:
            return text + (f"; it delayed {held}, but stage {waiter} was barely held up (its green {msg} box, "
                           f"{wait:.1f} ms)")
        return text + f"; {held}, was barely held up by it (its green {msg} box, {wait:.1f} ms)"
    # Most of a long wait is usually the wait the schedule has anyway (with 1F1B stage 0 always waits for the next
    # stage's F0 and B0 before its g0 arrives); only the op's excess over the mean of its kind is the long box's doing:
    # an op of mean length would have sent the message that much earlier, shortening the wait by at most as much.
    excess = (top.end - top.start) - means[top.kind]
    extra = min(excess, wait)
    blocked = f"stage {waiter} was blocked {wait:.1f} ms in its green {msg} box"
    if extra >= wait - 0.05:
        share = (f", all of it within {top.label}'s excess over the mean {top.kind} ({excess:.1f} ms): "
                 f"a {top.kind} of mean length would have left no wait")
    else:
        share = (f". About {extra:.1f} ms of that is {top.label}'s excess over the mean {top.kind}; the other "
                 f"{wait - extra:.1f} ms it would have waited with a {top.kind} of mean length too")
    if via:
        return text + f". It delayed {held}, and {blocked}{share}"
    return text + f"; {blocked}{share}"


def worker(ctx: RankContext, args: Settings) -> dict | None:
    trace, actions = profiled_step(ctx, args)
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, (trace, actions))
    if not ctx.is_main:
        return None
    path = plot.figure_dir(args) / "pipeline_1f1b.trace.json"
    path.write_text(json.dumps(merge([t for t, _ in gathered]), separators=(",", ":")))
    return {"trace": str(path), "actions": [[f"{k}{i}" for k, i in a] for _, a in gathered]}


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"micro_batch_size": 2, "seq_len": 16, "width": 32,
                                               "layers_per_stage": 1},
                     world_sizes=range(2, 5), world_sizes_text="2..4")
    result = launch(worker, args)
    if result is None:  # torchrun: only rank 0 reports
        return 0
    p, path = args.world_size, Path(result["trace"])
    actions = [[(a[0], int(a[1:])) for a in row] for row in result["actions"]]
    spans, stages = trace_timeline(path)
    seen = [[(sp.label[0], int(sp.label[1:])) for sp in spans if sp.lane == f"stage {s}"] for s in range(p)]
    for s in range(p):  # the trace must show the order the runner ran
        if seen[s] != actions[s]:
            raise cli.SelfCheckFailed(f"stage {s}: the trace shows {seen[s]}, the runner ran {actions[s]}")
    summary = summarize(spans, p, actions)
    print(f"1F1B, p={p} stages x {args.layers_per_stage} blocks (width {args.width}), m={args.micro_batches} "
          f"micro-batches of {args.micro_batch_size} x {args.seq_len} tokens, 1 thread per rank, profiled step")
    print(f"trace of all {stages} stages on one clock: {path}")
    for s in range(p):
        print(f"  stage {s} order of F and B in the trace: {' '.join(f'{k}{i}' for k, i in seen[s])}")
    m = summary["measured"]
    rows = [{"stage": s, "computing ms": round(m["busy"][s], 2), "idle ms": round(summary["idle_ms"][s], 2),
             "blocked in recv ms": round(summary["blocked_ms"][s], 2),
             "posting sends ms": round(summary["sending_ms"][s], 2), "idle share": round(m["per_stage"][s], 3),
             "ideal share": round(summary["ideal_per_stage"][s], 3)} for s in range(p)]
    print(f"\nstep on the trace: {m['span']:.2f} ms; mean forward {summary['forward_ms']:.2f} ms, "
          f"backward {summary['backward_ms']:.2f} ms")
    print(report.table(rows))
    print(f"\nidle share, mean over stages: measured {m['mean']:.3f}, replayed (the trace's op lengths, no gaps) "
          f"{summary['replayed']:.3f}, ideal clock {summary['ideal']:.3f} = (p-1)/(m+p-1) = {summary['formula']:.3f}")
    print(f"{summary['longest_op'][0].upper()}{summary['longest_op'][1:]}")
    print(f"load average: {os.getloadavg()[0]:.1f} on {len(os.sched_getaffinity(0))} cores")
    print(f"figure: {draw(args, spans, p, summary)}")
    if args.json:
        report.write_json(args.json, {**result, **summary, "spans": [vars(sp) for sp in spans]}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
