"""The pipeline bubble, measured: idle time per stage from timestamps, against (p - 1) / (m + p - 1).

What it shows
    BUBBLE    W ranks run the tiny GPT (--layers-per-stage blocks on every stage, so every stage does the same
              work) with GPipe and with 1F1B, for several numbers of micro-batches m. Every forward and backward
              is timed (time.perf_counter, one clock for all processes of a machine). A step lasts from the first
              compute start on any stage to the last compute end on any stage; a stage's bubble is the part of
              that span it did not compute. Two fractions are printed next to the formula: "wall clock" (the
              fastest of --steps steps, mean over stages, load included) and "replayed" (the orders the stages ran,
              each op at its stage's median time, on an ideal clock), each in a table of its own.
              Timing is reported, never a reason to fail.
    MEMORY    the peak number of micro-batches in flight and the bytes of saved activations on each stage, for
              both schedules: the same bubble, very different memory.
    FIGURES   bubble_vs_m.png (measured points, formula curve) and timeline.png (both schedules' measured
              timelines for --timeline-m micro-batches, the critical path outlined in black), into --plot-dir.
    CRITICAL PATH  the chain of operations that sets a step's length: start from the op that ends last and step
              back, each time to whichever of its two inputs ended later, the stage's previous op or the op that
              sent its message (the forward on the stage before, the backward on the stage after).

Honest caveats, printed with the results: each rank gets one thread, so with more ranks than cores the stages
compete for the CPU, and busy steady-state phases run slower than the lone warm-up and cool-down phases; the
first and last stages also carry the embeddings and the head; other programs on the machine add noise.

How to run (world size 2..8; use no more ranks than cores for a clean measurement)
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/bubble.py -w 2
    torchrun --nproc-per-node 2 tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/bubble.py

Runtime on 2 cores: about 10 s with -w 2 on an idle machine (40 s at load 6, 90 s at load 17), 3 s with --smoke.

Try next
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/bubble.py --micro-batches 1 2 4 8 16
        (about twice the default run) -> more micro-batches: the formula's bubble (p-1)/(m+p-1) falls toward 0;
           compare the measured points
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/bubble.py -w 4
        (half a minute or more on two cores, over a minute under load) -> four stages on two cores:
           ranks wait for a core, not only for each other; the line after the tables counts how many
           wall-clock bubbles came out above the formula
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/bubble.py --timeline-m 8
        (as long as the default run) -> the timeline figure drawn at m = 8: GPipe's long run of forwards, 1F1B's
           alternation, the same gaps
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.bench import steady_timing
from mlsys.data import Tokenizer, get_batch, make_corpus
from mlsys.launch import RankContext, launch
from mlsys.model import GPT, GPTConfig
from mlsys.pipeline import bubble_fraction, measured_bubble, run_pipeline_step, simulate, split_gpt

GOAL = 0.15  # relative error the measurement should stay within
NOISE = 0.02  # a wall-clock bubble that moves by less than this (relative) between two m "stayed about the same"


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 2
    """Number of ranks = pipeline stages p. Under torchrun it is taken from WORLD_SIZE."""
    micro_batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """The values of m to measure."""
    micro_batch_size: int = 4
    """Sequences per micro-batch."""
    seq_len: int = 64
    """Tokens per sequence."""
    layers_per_stage: int = 2
    """Transformer blocks on every stage (equal work per stage)."""
    width: int = 128
    """Model width n_embd (4 heads)."""
    steps: int = 5
    """Timed steps per (schedule, m); the fastest one is reported. One untimed warm-up step comes first."""
    timeline_m: int = 4
    """m of the timeline figure (must be one of --micro-batches)."""

    def validate(self) -> None:
        if self.world_size < 2:
            raise cli.UsageError("a pipeline needs at least 2 stages: use -w 2 or more")
        if min(self.micro_batches) < 1 or min(self.micro_batch_size, self.layers_per_stage, self.steps) < 1:
            raise cli.UsageError("--micro-batches, --micro-batch-size, --layers-per-stage, --steps must be >= 1")
        if not 1 <= self.seq_len <= 256 or self.width < 4 or self.width % 4:
            raise cli.UsageError("--seq-len must be 1..256 and --width a positive multiple of 4")
        if self.timeline_m not in self.micro_batches:
            raise cli.UsageError(f"--timeline-m {self.timeline_m} is not among --micro-batches {self.micro_batches}")


def build(args: Settings, m: int) -> tuple[torch.nn.Module, list, list]:
    """This rank's stage and m micro-batches of real tokens (the same on every rank)."""
    torch.manual_seed(args.seed)
    p = dist.get_world_size()
    config = GPTConfig.preset("small", n_layer=p * args.layers_per_stage, n_embd=args.width, n_head=4)
    stage = split_gpt(GPT(config), p)[dist.get_rank()]
    tokens = Tokenizer().encode_corpus(make_corpus(200, args.seed))
    x, y = get_batch(tokens, m * args.micro_batch_size, args.seq_len, torch.Generator().manual_seed(args.seed))
    return stage, list(x.chunk(m)), list(y.chunk(m))


def measure(args: Settings, schedule: str, m: int) -> dict:
    """Run warm-up + timed steps; rank 0 gets every stage's events and the median bubble."""
    stage, xs, ys = build(args, m)
    ranks = list(range(dist.get_world_size()))
    steps = []
    for step in range(args.steps + 1):
        stage.zero_grad(set_to_none=True)
        dist.barrier()  # every stage starts the step together
        with steady_timing():  # no garbage-collector pass inside the timed step
            out = run_pipeline_step(stage, ranks, xs, ys, schedule=schedule)
        timeline: list = [None] * len(ranks)
        dist.all_gather_object(timeline, out["events"])  # timeline[s]: stage s's [{kind, mb, start, end}]
        if step > 0:  # step 0 warms up allocators and connections
            steps.append({"timeline": timeline, **measured_bubble(timeline)})
    best = min(steps, key=lambda s: s["span"])  # the fastest step: the one other programs disturbed least
    memory: list = [None] * len(ranks)
    dist.all_gather_object(memory, (out["peak_in_flight"], out["peak_activation_bytes"]))
    ops = {k: [e["end"] - e["start"] for stage in best["timeline"] for e in stage if e["kind"] == k] for k in "FB"}
    # the replay: the orders the stages ran, each op at its stage's median time over all timed steps, on the ideal
    # clock (messages free): what is left of the bubble once a loaded machine's stretched ops are taken out
    median = {k: [statistics.median(e["end"] - e["start"] for st in steps for e in st["timeline"][s] if e["kind"] == k)
                  for s in ranks] for k in "FB"}
    orders = [[(e["kind"], e["mb"]) for e in stage] for stage in best["timeline"]]
    replayed = measured_bubble(simulate(lambda s, p_, m_: orders[s], len(ranks), m, median["F"], median["B"]))
    return {"measured": best["mean"], "replayed": replayed["mean"],
            "median_ms": {k: [1000 * t for t in v] for k, v in median.items()},
            "forward_ms": 1000 * statistics.mean(ops["F"]),
            "backward_ms": 1000 * statistics.mean(ops["B"]), "per_stage": best["per_stage"], "span_s": best["span"],
            "all_steps": [s["mean"] for s in steps], "timeline": best["timeline"], "memory": memory}


def worker(ctx: RankContext, args: Settings) -> dict:
    torch.set_num_threads(1)  # equal, predictable compute per stage; p ranks share the cores
    p, rows, replay_rows = ctx.world_size, [], []
    results: dict = {"world_size": ctx.world_size, "runs": []}
    for m in args.micro_batches:
        for schedule in ("gpipe", "1f1b"):
            res = measure(args, schedule, m)
            predicted = bubble_fraction(p, m)
            rel = (res["replayed"] - predicted) / predicted if predicted else 0.0
            res.update(schedule=schedule, m=m, predicted=predicted, rel_error=rel, goal_met=abs(rel) <= GOAL)
            results["runs"].append(res)
            rows.append({"schedule": schedule, "m": m, "predicted": round(predicted, 3),
                         "wall clock": round(res["measured"], 3),
                         "per stage": " ".join(f"{b:.3f}" for b in res["per_stage"]),
                         "step ms": round(1000 * res["span_s"], 1), "F ms": round(res["forward_ms"], 1),
                         "B ms": round(res["backward_ms"], 1)})
            replay_rows.append({"schedule": schedule, "m": m, "predicted": round(predicted, 3),
                                "replayed": round(res["replayed"], 3), "rel. error": f"{100 * rel:+.1f}%",
                                f"within {GOAL:.0%}": "yes" if abs(rel) <= GOAL else "no",
                                "median F ms per stage": " ".join(f"{t:.1f}" for t in res["median_ms"]["F"]),
                                "median B ms per stage": " ".join(f"{t:.1f}" for t in res["median_ms"]["B"])})
    for run in results["runs"]:  # the chain drawn in timeline.png, recorded for its test
        if run["m"] == args.timeline_m:
            run["critical_path"] = [[s, *(run["timeline"][s][j][k] for k in ("kind", "mb"))]
                                    for s, j in critical_path(run["timeline"])]
    if ctx.is_main:
        print_report(args, p, rows, replay_rows, results)
        draw(args, p, results)
    for run in results["runs"]:  # keep the JSON small: only the timeline that was drawn
        if run["m"] != args.timeline_m:
            del run["timeline"]
    return results


def critical_path(timeline: list) -> list[tuple[int, int]]:
    """(stage, index in its list) of each op on the critical path, first to last. An op waits for two things: the
    previous op of its stage and its message, sent by F i on stage s - 1 (a forward) or B i on stage s + 1 (a
    backward). From the op that ends last, step back to whichever of the two ended later, down to stage 0's F0."""
    where = {(s, e["kind"], e["mb"]): (s, j) for s, ops in enumerate(timeline) for j, e in enumerate(ops)}

    def end(sj: tuple[int, int]) -> float:
        return timeline[sj[0]][sj[1]]["end"]

    path = [max(((s, j) for s, ops in enumerate(timeline) for j in range(len(ops))), key=end)]
    while True:
        s, j = path[-1]
        e = timeline[s][j]
        sender = (s - 1, "F", e["mb"]) if e["kind"] == "F" else (s + 1, "B", e["mb"])
        inputs = ([(s, j - 1)] if j else []) + ([where[sender]] if sender in where else [])
        if not inputs:
            return path[::-1]
        path.append(max(inputs, key=end))


def trend_word(x: float, y: float) -> str:
    """How a wall-clock bubble moved from x to y; a change within NOISE of the larger is load noise, not a trend."""
    if abs(y - x) <= NOISE * max(x, y):
        return f"stayed about the same (within {NOISE:.0%})"
    return "rose" if y > x else "fell"


def print_report(args: Settings, p: int, rows: list, replay_rows: list, results: dict) -> None:
    print(f"p={p} stages x {args.layers_per_stage} blocks (width {args.width}), micro-batches of "
          f"{args.micro_batch_size} x {args.seq_len} tokens, 1 thread per rank, "
          f"fastest of {args.steps} steps")
    print("bubble = idle fraction of a stage; predicted (p - 1) / (m + p - 1)\n"
          "wall clock: the fastest step's own timestamps (per stage: that column split by stage), load included\n"
          "F ms / B ms: mean time of one forward / backward. The formula assumes they do not depend on m; when\n"
          "they grow with m, stages that compute at the same time are slowing each other down (shared cores).\n")
    print(report.table(rows))
    wall = sum(abs(r["measured"] - r["predicted"]) <= GOAL * r["predicted"] for r in results["runs"])
    ms = sorted(set(args.micro_batches))
    if len(ms) >= 2:  # the formula's bubble always falls from one m to the next; say what the wall clock did
        a, b = ms[-2], ms[-1]
        wall_at = {(r["schedule"], r["m"]): r["measured"] for r in results["runs"]}
        moves = [(s, wall_at[s, a], wall_at[s, b]) for s in ("gpipe", "1f1b")]
        words = [f"{trend_word(x, y)} under {name} ({x:.3f} to {y:.3f})"
                 for (s, x, y), name in zip(moves, ("GPipe", "1F1B"))]
        results["wall_trend"] = f"from m = {a} to m = {b} the wall-clock bubble {words[0]} and {words[1]}"
        print(f"\n{results['wall_trend']}; the formula's fell from {bubble_fraction(p, a):.3f} to "
              f"{bubble_fraction(p, b):.3f}")
    print("\nthe replay: the orders the stages ran, each forward / backward at its stage's median time over the\n"
          "timed steps, on an ideal clock (messages free); rel. error compares it with predicted. It equals the\n"
          "formula only when every stage has the same times (the median columns, stage 0, 1, ...):\n")
    print(report.table(replay_rows))
    met = sum(r["goal_met"] for r in results["runs"])
    # as the runs table prints them (3 decimals), so the count never calls two equal-looking numbers different
    above = sum(round(r["measured"], 3) > round(r["predicted"], 3) for r in results["runs"])
    results.update(replayed_met=met, wall_met=wall, runs_total=len(results["runs"]), wall_above=above)
    print(f"\nwithin {GOAL:.0%} of the formula: replayed {met} of {len(results['runs'])}, "
          f"wall clock {wall} of {len(results['runs'])}")
    below = [r for r in results["runs"] if round(100 * r["rel_error"], 1) < 0]  # as the rel. error column shows it
    if below:  # the lesson names the row where the replay came out under the formula, if any
        low = min(below, key=lambda r: r["rel_error"])
        results["replay_below"] = (f"the replay came out below the formula in {len(below)} of "
                                   f"{len(results['runs'])} rows, furthest under {low['schedule']} at m = "
                                   f"{low['m']} ({100 * low['rel_error']:+.1f}%)")
    else:
        results["replay_below"] = "no replayed bubble came out below the formula (by 0.1 % or more)"
    print(results["replay_below"])
    print("\npeak micro-batches in flight (saved activations, KiB) per stage:")
    for run in results["runs"]:
        if run["m"] == max(args.micro_batches):
            held = "  ".join(f"s{s}: {n} ({b / 1024:.0f} KiB)" for s, (n, b) in enumerate(run["memory"]))
            print(f"  {run['schedule']:5s} m={run['m']}: {held}")
    cores = len(os.sched_getaffinity(0))
    results.update(load_avg=os.getloadavg()[0], cores=cores)
    print(f"\nload average during the run: {os.getloadavg()[0]:.1f} on {cores} cores (other programs running "
          "at the same time stretch some operations and not others, which moves the measured bubble off the formula)")
    if p > cores:
        print(f"\nnote: {p} ranks share {cores} cores, so stages that run at the same time slow each other down")
    print(f"the wall-clock bubble came out above the formula in {above} of {len(results['runs'])} rows")


def draw(args: Settings, p: int, results: dict) -> None:
    plt = plot.pyplot()
    ms = sorted(args.micro_batches)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    grid = [m / 4 for m in range(4, 4 * max(ms) + 1)]
    ax.plot(grid, [bubble_fraction(p, m) for m in grid], color="gray", label="(p-1)/(m+p-1)")
    for schedule, marker in (("gpipe", "o"), ("1f1b", "x")):
        runs = [r for r in results["runs"] if r["schedule"] == schedule]
        ax.scatter([r["m"] for r in runs], [r["measured"] for r in runs], marker=marker, s=60,
                   label=f"{schedule}, wall clock")
        ax.scatter([r["m"] for r in runs], [r["replayed"] for r in runs], marker=marker, s=60, facecolors="none"
                   if marker == "o" else None, edgecolors="black" if marker == "o" else None,
                   color=None if marker == "o" else "black", label=f"{schedule}, replayed")
    ax.set(xlabel="micro-batches m", ylabel="bubble (idle fraction)", title=f"Pipeline bubble, p = {p}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)  # outside: no point hidden
    fig.tight_layout()
    plot.save(fig, args, "bubble_vs_m")

    fig, axes = plt.subplots(2, 1, figsize=(9, 1.0 + 0.55 * p * 2), sharex=True)
    runs = [r for r in results["runs"] if r["m"] == args.timeline_m]
    colors = {"F": "#4c72b0", "B": "#dd8452"}
    for ax, run in zip(axes, runs):
        start = min(e["start"] for stage in run["timeline"] for e in stage)
        chain = {(s, kind, mb) for s, kind, mb in run["critical_path"]}
        for s, events in enumerate(run["timeline"]):
            for e in events:
                x0, w = 1000 * (e["start"] - start), 1000 * (e["end"] - e["start"])
                on = (s, e["kind"], e["mb"]) in chain  # the critical path: a black outline
                ax.broken_barh([(x0, w)], (s - 0.4, 0.8), facecolors=colors[e["kind"]], zorder=3 if on else 2,
                               edgecolor="black" if on else "white", linewidth=1.8 if on else 1.0)
                ax.text(x0 + w / 2, s, f"{e['kind']}{e['mb']}", ha="center", va="center", fontsize=7, color="white")
        ax.set(yticks=range(p), yticklabels=[f"stage {s}" for s in range(p)], ylim=(p - 0.5, -0.5),
               title=f"{run['schedule']}: m={run['m']}, bubble measured {run['measured']:.2f}, "
                     f"predicted {run['predicted']:.2f}; black outline: the critical path")
    axes[-1].set_xlabel("time since the step started (ms)")
    fig.tight_layout(h_pad=1.5)  # room for the lower panel's title above it, clear of the upper panel's axis
    plot.save(fig, args, "timeline")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"micro_batches": [1, 2], "timeline_m": 2, "steps": 2,
                                               "seq_len": 16, "width": 32, "layers_per_stage": 1},
                     world_sizes=range(2, 9), world_sizes_text="2..8")
    results = launch(worker, args)
    if args.json:
        report.write_json(args.json, results, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
