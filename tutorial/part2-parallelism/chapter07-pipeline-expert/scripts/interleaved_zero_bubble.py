"""Interleaved 1F1B and zero-bubble schedules beside GPipe and 1F1B: the same step, the bubble counted and timed.

What it shows
    ORACLE    a seeded stack of Linear + tanh blocks (float64) is cut into stages and trained for one SGD step by
              five schedules of torch.distributed.pipelining on real ranks: ScheduleGPipe and Schedule1F1B (one
              stage per rank), ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble (--virtual-stages v
              stages per rank, stage s on rank s mod p) and ScheduleZBVZeroBubble (two stages per rank in a V:
              rank r holds stages r and 2p-1-r). Rank 0 also runs the whole model on the whole batch in one
              process; every schedule's gradients and updated parameters must equal it (float64, 1e-12). The
              orders GPipe and 1F1B ran must be the book's own (mlsys.pipeline.schedule_actions).
    BUBBLE    every stage's forward (F), backward (B), input-gradient (I) and weight-gradient (W) call is wrapped
              and logged. Counted (the primary measurement): the order each rank actually ran is replayed with
              ideal costs (a rank's micro-batch takes T_F = T_I = T_W = 1, a stage of a rank's v the v-th of
              that; messages free), and each rank's idle share is read off that timeline, next to the formula:
              (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(vm+p-1) for interleaved 1F1B, and (p-1)/(3vm+p-1) for
              the zero-bubble schedules (the ramp-up of the forwards is all that is left). Wall clock (secondary):
              the same shares from perf_counter stamps of the fastest of --steps steps. With more ranks than
              cores the ranks also wait for a CPU, which blurs the wall-clock bubble; the script says so.
    MEMORY    the most micro-batch activations a rank holds at once, counted along the order it ran (a stage
              holds its activations from F until its last backward action): GPipe m, 1F1B at most p.
    FIGURES   timelines.png (the replayed timeline of every schedule, one row per rank; the boxes drawn are in
              the JSON as "drawn_ideal") and timelines_measured.png (the same actions on the wall clock), into
              --plot-dir.

How to run (world size 2..8; a pipeline needs 2 ranks, -w 1 is refused with exit 2; --micro-batches >= -w)
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/interleaved_zero_bubble.py
    torchrun --nproc-per-node 4 tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/interleaved_zero_bubble.py

Runtime on 2 cores: about 20 s with the defaults (4 ranks) on an idle machine (about 60 s at load 6 to 9),
6 s with --smoke (2 ranks).

Try next
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/interleaved_zero_bubble.py -w 2
        -> one rank per core: the wall-clock shares come closer to the counted ones
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/interleaved_zero_bubble.py --virtual-stages 4
        -> interleaved 1F1B's bubble falls to (p-1)/(4m+p-1), and its messages per step grow with v
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/interleaved_zero_bubble.py --micro-batches 4
        -> m = p: ZB-V plans 2p-1 micro-batches and leaves holes, so it no longer reaches its formula
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import _schedules as zs
import torch
import torch.distributed as dist
from torch import nn

from mlsys import cli, plot, report
from mlsys.launch import RankContext, launch
from mlsys.pipeline import measured_bubble

TOL = (1e-12, 1e-13)  # rtol, atol in float64: summing m micro-batch gradients rounds differently from one batch


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 4
    """Number of ranks p. Under torchrun it is taken from WORLD_SIZE."""
    micro_batches: int = 8
    """m, micro-batches per step (at least p: torch's Schedule1F1B refuses fewer)."""
    virtual_stages: int = 2
    """v, stages per rank for the interleaved schedules (ZB-V always uses 2, GPipe and 1F1B 1)."""
    rows: int = 128
    """Rows per micro-batch."""
    width: int = 768
    """Width of every Linear layer."""
    steps: int = 2
    """Timed steps per schedule (after one untimed warm-up step); the fastest is reported."""
    lr: float = 0.5
    """SGD learning rate of the one step whose parameters are compared."""

    def validate(self) -> None:
        p, m = self.world_size, self.micro_batches
        if p < 2:
            raise cli.UsageError("a pipeline needs at least 2 ranks: use -w 2 or more")
        if m < p:
            raise cli.UsageError(f"--micro-batches {m} is below -w {p}: torch's Schedule1F1B needs m >= p")
        rounds = max(1, m // p)
        if m % rounds:
            raise cli.UsageError(f"--micro-batches {m} must be a multiple of max(1, m // p) = {rounds} "
                                 "(torch's interleaved schedules run the micro-batches in equal rounds)")
        if not 1 <= self.virtual_stages <= 4:
            raise cli.UsageError(f"--virtual-stages must be 1..4, got {self.virtual_stages}")
        if min(self.rows, self.width, self.steps) < 1 or not self.lr > 0:
            raise cli.UsageError("--rows, --width and --steps must be >= 1 and --lr > 0")


def build(args: Settings, p: int) -> tuple[nn.ModuleList, torch.Tensor, torch.Tensor]:
    """The seeded model (p * blocks_per_rank blocks of Linear + tanh) and the whole batch (m * rows, width)."""
    torch.manual_seed(args.seed)
    n_blocks = p * zs.blocks_per_rank(p, args.virtual_stages)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh()) for _ in range(n_blocks))
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.micro_batches * args.rows, args.width, generator=gen)
    y = torch.randn(args.micro_batches * args.rows, args.width, generator=gen)
    return blocks.double(), x.double(), y.double()


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def reference(args: Settings, p: int) -> tuple[list, list, float]:
    """The oracle: the whole model, the whole batch, one process, one backward, one SGD step."""
    blocks, x, y = build(args, p)
    loss = mse(blocks_forward(blocks, x), y)
    loss.backward()
    grads = [q.grad.clone() for q in blocks.parameters()]
    torch.optim.SGD(blocks.parameters(), lr=args.lr).step()
    return grads, [q.detach().clone() for q in blocks.parameters()], float(loss.detach())


def blocks_forward(blocks, x):
    for block in blocks:
        x = block(x)
    return x


# --8<-- [start:instrument]
def instrument(stage, events: list, device: torch.device) -> None:
    """Log every forward, backward, input-gradient and weight-gradient call of a PipelineStage with its times."""

    def clock() -> float:
        if device.type == "cuda":  # kernels run asynchronously: wait for them, or we time only the launches
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def wrap(method: str, kind: str) -> None:
        inner = getattr(stage, method)

        def timed(mb: int, *a, **kw):
            full = kw.get("full_backward", True)  # backward_one_chunk(full_backward=False) is I; W follows
            start = clock()
            out = inner(mb, *a, **kw)
            events.append({"kind": kind if full else "I", "stage": stage.stage_index, "mb": mb,
                           "start": start, "end": clock()})
            return out

        setattr(stage, method, timed)  # the schedules call stage.<method>: the instance attribute wins

    wrap("forward_one_chunk", "F")
    wrap("backward_one_chunk", "B")
    wrap("backward_weight_one_chunk", "W")
# --8<-- [end:instrument]


def run_schedule(ctx: RankContext, args: Settings, name: str) -> dict:
    """Build this rank's stages for `name`, run a warm-up step and --steps timed steps, then one SGD step."""
    from torch.distributed.pipelining import PipelineStage, schedules

    p, m, v = ctx.world_size, args.micro_batches, args.virtual_stages
    where = zs.placement(name, p, v)  # rank of every stage
    mine = [s for s, r in enumerate(where) if r == ctx.rank]
    blocks, x, y = build(args, p)
    per_stage = len(blocks) // len(where)
    events: list[dict] = []
    stages = []
    for s in mine:  # stage s holds blocks [s * per_stage, (s + 1) * per_stage)
        module = nn.Sequential(*blocks[s * per_stage:(s + 1) * per_stage]).to(ctx.device)
        stage = PipelineStage(module, s, len(where), ctx.device)
        instrument(stage, events, ctx.device)
        stages.append(stage)
    cls = getattr(schedules, zs.SCHEDULES[name][0])
    single = zs.SCHEDULES[name][1] == "single"
    schedule = cls(stages[0] if single else stages, n_microbatches=m,
                   loss_fn=mse)  # scale_grads=True: gradients of the mean loss, as one process
    inputs = (x.to(ctx.device),) if 0 in mine else ()
    steps = []
    for step in range(args.steps + 1):
        for stage in stages:
            stage.submod.zero_grad(set_to_none=True)
        events.clear()
        losses: list = []
        dist.barrier()  # all ranks start the step together
        if len(where) - 1 in mine:
            schedule.step(*inputs, target=y.to(ctx.device), losses=losses)
        else:
            schedule.step(*inputs)
        timeline: list = [None] * p
        dist.all_gather_object(timeline, list(events))
        if step > 0:  # step 0 warms up: shapes, buffers, connections
            steps.append({"timeline": timeline, **measured_bubble(timeline)})
    grads = {s: [q.grad.detach().cpu().clone() for q in st.submod.parameters()] for s, st in zip(mine, stages)}
    params = [q for st in stages for q in st.submod.parameters()]
    torch.optim.SGD(params, lr=args.lr).step()
    after = {s: [q.detach().cpu().clone() for q in st.submod.parameters()] for s, st in zip(mine, stages)}
    loss = float(torch.stack(losses).mean().detach()) if losses else None
    best = min(steps, key=lambda s: s["span"])  # the step other programs disturbed least
    return {"grads": grads, "params": after, "loss": loss, "best": best, "per_stage": per_stage}


def analyse(name: str, p: int, v: int, m: int, timeline: list) -> dict:
    """Counted bubble (replay of the orders run), formula, peak activations, messages; all from the timeline."""
    chunks = zs.chunks_per_rank(name, v)
    ran = {r: [(e["kind"], e["stage"], e["mb"]) for e in evs] for r, evs in enumerate(timeline)}
    planned = zs.planned_orders(name, p, v, m)  # GPipe, 1F1B: the book's mlsys.pipeline.schedule_actions
    for r in range(p):
        report.expect_equal(f"{name} rank {r}: the actions run vs the plan", [f"{k}{s}.{i}" for k, s, i in ran[r]],
                            [f"{k}{s}.{i}" for k, s, i in planned[r]])
    ideal = zs.replay(ran, zs.placement(name, p, v), chunks)
    counted = zs.idle_shares(ideal)
    span = max(e["end"] for evs in ideal.values() for e in evs)
    return {"formula": zs.formula(name, p, v, m), "formula_holds": zs.formula_holds(name, p, v, m),
            "counted": sum(counted) / p, "counted_per_rank": counted,
            "idle_units": float(span - 3 * m),  # per rank, in x-axis units (one forward on a rank = 1)
            "peak_held": [zs.peak_held(ran[r], chunks) for r in range(p)],
            "p2p_messages": zs.p2p_messages(name, p, v, m), "chunks": chunks,
            "order": {r: " ".join(f"{k}{s}.{i}" for k, s, i in ran[r]) for r in range(p)},
            "ideal": {r: [{**e, "start": float(e["start"]), "end": float(e["end"])} for e in ideal[r]]
                      for r in range(p)}}


def worker(ctx: RankContext, args: Settings) -> dict:
    p, v, m = ctx.world_size, args.virtual_stages, args.micro_batches
    ref_grads, ref_params, ref_loss = reference(args, p) if ctx.is_main else (None, None, None)
    results: dict = {"p": p, "v": v, "m": m, "reference_loss": ref_loss, "schedules": {},
                     "cores": len(os.sched_getaffinity(0))}
    for name in zs.SCHEDULES:
        out = run_schedule(ctx, args, name)
        gathered: list = [None] * p
        mine = {k: out[k] for k in ("grads", "params", "loss")}
        dist.gather_object(mine, gathered if ctx.is_main else None, dst=0)
        if not ctx.is_main:
            continue
        row = analyse(name, p, v, m, out["best"]["timeline"])
        row.update(compare(name, gathered, ref_grads, ref_params, ref_loss, out["per_stage"]))
        row.update(wall_clock=out["best"]["mean"], wall_clock_per_rank=out["best"]["per_stage"],
                   step_ms=1000 * out["best"]["span"], measured=out["best"]["timeline"],
                   busy_ranks=sum(out["best"]["busy"]) / out["best"]["span"])  # ranks computing at once, mean
        results["schedules"][name] = row
    if ctx.is_main:
        results["load_avg"] = os.getloadavg()[0]  # other programs' load stretches the wall clock, not the counts
        print_report(args, results)
        drawn = draw(args, results)
        for name, row in results["schedules"].items():  # the JSON keeps the numbers and the boxes drawn
            del row["ideal"], row["measured"]
            row["drawn_ideal"] = drawn[name]
    return results


def compare(name: str, gathered: list, ref_grads: list, ref_params: list, ref_loss: float, per_stage: int) -> dict:
    """Every stage's gradients and updated parameters against the one-process step (2 tensors per block)."""
    dgrad = dparam = 0.0
    prints: dict[int, list[float]] = {}
    for got in gathered:
        for s in got["grads"]:
            first = 2 * s * per_stage  # index of the stage's first tensor in blocks.parameters()
            for j, (g, q) in enumerate(zip(got["grads"][s], got["params"][s]), start=first):
                report.expect_close(f"{name}: stage {s} grad {j}", g, ref_grads[j], *TOL)
                report.expect_close(f"{name}: stage {s} parameter {j} after SGD", q, ref_params[j], *TOL)
                dgrad = max(dgrad, float((g - ref_grads[j]).abs().max()))
                dparam = max(dparam, float((q - ref_params[j]).abs().max()))
                prints[j] = fingerprint(q, j)
    (loss,) = [g["loss"] for g in gathered if g["loss"] is not None]
    report.expect_close(f"{name}: loss", loss, ref_loss, *TOL)
    return {"loss": loss, "max_grad_diff": dgrad, "max_param_diff": dparam,
            "param_fingerprints": [prints[j] for j in sorted(prints)]}


def fingerprint(t: torch.Tensor, j: int) -> list[float]:
    """Three numbers that pin down parameter tensor j after the step (sum, sum of squares, a seeded random
    projection), so the JSON lets a test compare every parameter with its own one-process step."""
    direction = torch.randn(t.numel(), generator=torch.Generator().manual_seed(j), dtype=torch.float64)
    flat = t.detach().double().flatten()
    return [float(flat.sum()), float(flat @ flat), float(flat @ direction)]


def print_report(args: Settings, results: dict) -> None:
    p, v, m = results["p"], results["v"], results["m"]
    cores = len(os.sched_getaffinity(0))
    print(f"p={p} ranks, m={m} micro-batches of {args.rows} rows, v={v} stages per rank for the interleaved "
          f"schedules, {p * zs.blocks_per_rank(p, v)} blocks Linear({args.width}) + tanh, float64, "
          f"torch {torch.__version__}")
    print(f"one process on the whole batch: loss {results['reference_loss']:.6f}\n")
    rows = []
    for name, r in results["schedules"].items():
        rows.append({"schedule": name, "stages/rank": r["chunks"], "formula": round(r["formula"], 4),
                     "counted": round(r["counted"], 4), "idle units": round(r["idle_units"], 3),
                     "wall clock": round(r["wall_clock"], 3), "step ms": round(r["step_ms"]),
                     "busy ranks": round(r["busy_ranks"], 2),
                     "peak held": max(r["peak_held"]), "p2p msgs": r["p2p_messages"],
                     "max|dparam|": r["max_param_diff"]})
    print(report.table(rows))
    print("\ncounted: idle share of the ideal timeline of the actions each rank ran (T_F = T_I = T_W, messages "
          "free);\n  idle units: idle time per rank, in units of one micro-batch's forward on a rank")
    misses = [n for n, r in results["schedules"].items() if abs(r["counted"] - r["formula"]) > 1e-9]
    print("counted = formula for every schedule" if not misses else f"counted differs from the formula for: "
          f"{', '.join(misses)}" + (" (ZB-V needs m >= 2p - 1)" if misses == ["zbv"] else ""))
    print("\npeak micro-batch activations held per rank (in micro-batches of the rank's layers):")
    for name, r in results["schedules"].items():
        print(f"  {name:17s} " + "  ".join(f"r{i}: {h:g}" for i, h in enumerate(r["peak_held"])))
    print("\nfirst actions on rank 0 (kind, stage.micro-batch):")
    for name, r in results["schedules"].items():
        print(f"  {name:17s} {' '.join(r['order'][0].split()[:14])} ...")
    note = (f"{p} ranks share {cores} cores, so ranks also wait for a CPU: the wall-clock shares are blurred "
            "and the counted ones are the measurement" if p > cores else
            "one core per rank; Python and message overheads still add to the wall-clock shares")
    print(f"\nwall clock: idle share from perf_counter stamps, fastest of {args.steps} steps; {note}.")
    print(f"busy ranks: ranks computing at once, on average over the measured step ({cores} cores here, load "
          f"average {results['load_avg']:.1f} when it ended); at or above the core count the cores, not the "
          "schedule's gaps, set the step time")
    print("\ngradients and parameters after one SGD step equal one process for every schedule: OK")


def draw(args: Settings, results: dict) -> dict:
    """One Gantt chart per schedule and rank: F blue, B orange, I red, W green, white = idle; paler = 2nd+ stage.
    Returns the boxes of the ideal chart, per schedule: [rank, kind, stage, micro-batch, start, end]."""
    drawn: dict = {name: [] for name in results["schedules"]}
    plt = plot.pyplot()
    colors = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}
    p, names = results["p"], list(results["schedules"])
    for key, fname, unit in (("ideal", "timelines", "time (one micro-batch's forward on a rank = 1)"),
                             ("measured", "timelines_measured", "time since the step started (ms)")):
        fig, axes = plt.subplots(len(names), 1, figsize=(11, 0.9 + 0.42 * p * len(names)), sharex=True)
        for ax, name in zip(axes, names):
            row = results["schedules"][name]
            timeline = row[key] if key == "ideal" else dict(enumerate(row[key]))
            t0 = min(e["start"] for evs in timeline.values() for e in evs)
            scale = 1 if key == "ideal" else 1000
            for r, evs in timeline.items():
                for e in evs:
                    x0, w = scale * (e["start"] - t0), scale * (e["end"] - e["start"])
                    pale = e["stage"] >= p  # a rank's later stages (interleaved and V placements)
                    ax.broken_barh([(x0, w)], (r - 0.4, 0.8), facecolors=colors[e["kind"]],
                                   alpha=0.55 if pale else 1.0, edgecolor="white", linewidth=0.4)
                    if key == "ideal":
                        drawn[name].append([r, e["kind"], e["stage"], e["mb"], x0, x0 + w])
            share = row["counted"] if key == "ideal" else row["wall_clock"]
            ax.set(yticks=range(p), yticklabels=[f"rank {r}" for r in range(p)], ylim=(p - 0.5, -0.5))
            ax.set_title(f"{name}: idle {share:.3f} ({'counted' if key == 'ideal' else 'wall clock'}), "
                         f"formula {row['formula']:.3f}", fontsize=9, loc="left")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
        handles.append(plt.Rectangle((0, 0), 1, 1, color=colors["F"], alpha=0.55))
        axes[0].legend(handles, ["F forward", "B backward", "I input grad", "W weight grad",
                                 "paler: a rank's second stage"], ncol=5,
                       fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.15))
        axes[-1].set_xlabel(unit)
        fig.tight_layout()
        print(f"figure: {plot.save(fig, args, fname)}")
    return drawn


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "rows": 8, "width": 32, "steps": 1},
                     world_sizes=range(2, 9), world_sizes_text="2..8")
    results = launch(worker, args)
    if args.json:
        report.write_json(args.json, results, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
