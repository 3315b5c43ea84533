"""Ring all-reduce from send/recv: equal to dist.all_reduce, its step-by-step trace, its bytes, its speed.

What it shows
    1. A trace of mlsys.collectives.ring_all_reduce on a tiny tensor (one element per chunk): after every step, what
       each rank sent, received and holds -- the reduce-scatter phase, then the all-gather phase. The messages are
       read off the trace (ring_schedule) and drawn as an animation, one frame per step: the ranks on a circle,
       an arrow per message labelled with its chunk (ring_steps.gif, and ring_steps_strip.png for print). The
       JSON keeps the drawn messages (ring_schedule) and each frame's values (ring_frames).
    2. For several lengths (1, W-1, W+1, 1001, and a few MiB), ring_all_reduce and dist.all_reduce give the same sum
       as numpy on the concatenated inputs; the bytes each rank handed to isend are counted and compared with
       mlsys.collectives.comm_volume("all_reduce", ...); both are timed (median of --repeats runs).
    (The bytes of every other collective, message by message: bytes_on_the_wire.py.)

How to run (any world size from 1 to 8)
    python tutorial/part1-distributed/chapter03-collectives/scripts/ring_allreduce.py -w 4
    torchrun --nproc-per-node 4 tutorial/part1-distributed/chapter03-collectives/scripts/ring_allreduce.py
    ... --mib 16 --repeats 10     # a bigger tensor, more timing runs

Runtime on 2 idle cores: about 7 s at -w 4 with the default 4 MiB (1 s of it drawing the animation), 5 s with
--smoke; several times that on a busy machine.

Try next
    python tutorial/part1-distributed/chapter03-collectives/scripts/ring_allreduce.py -w 3
        -> a 3-rank trace: 2 reduce-scatter steps, then 2 all-gather steps, every chunk ending at 111; W = 3
           divides no length but the last, so formula_bytes_sent (4/3 N) is fractional per rank, and
           only its total over the ranks is whole
    python tutorial/part1-distributed/chapter03-collectives/scripts/ring_allreduce.py -w 8 --mib 1
        -> 8 ranks: the trace grows to 14 steps, one line per rank and step (112 step lines, plus one start line
           per rank); each rank sends 2(8-1)/8 = 1.75 N bytes. About 45 s on 2 idle cores, longer on a busy
           machine: eight processes start and share them
    python tutorial/part1-distributed/chapter03-collectives/scripts/ring_allreduce.py --mib 16 --repeats 10
        -> a bigger tensor and more timing runs for the comparison with dist.all_reduce
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.bench import load_average, steady_timing
from mlsys.collectives import comm_volume, ring_all_reduce
from mlsys.launch import RankContext, launch


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 4
    """Number of ranks to start (1 to 8). Under torchrun it is taken from WORLD_SIZE."""
    mib: float = 4.0
    """Size of the largest tensor in MiB of float32 (rounded down to a multiple of W elements)."""
    repeats: int = 5
    """Timed runs per length; the median is reported."""

    def validate(self) -> None:
        if self.mib <= 0:
            raise cli.UsageError(f"--mib must be positive, got {self.mib}")
        if self.repeats < 1:
            raise cli.UsageError(f"--repeats must be at least 1, got {self.repeats}")


def lengths(world_size: int, mib: float) -> list[int]:
    """Element counts to test: tiny, shorter than W, not divisible by W, and a big one divisible by W."""
    big = max(world_size, int(mib * 2**20 / 4) // world_size * world_size)
    return sorted({1, max(1, world_size - 1), world_size + 1, 1001, big})


def rank_input(seed: int, rank: int, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 31_337 + rank * 1_000_003 + numel)
    return torch.randn(numel, generator=gen)  # (numel,) float32


# --8<-- [start:trace]
def traced_run(ctx: RankContext) -> list[dict]:
    """Ring all-reduce of W elements (one per chunk), rank r holding 10^r in every slot: sums are readable."""
    x = torch.full((ctx.world_size,), 10.0 ** ctx.rank)  # (W,): chunk k is element k
    steps: list[str] = []
    states = [{"phase": "start", "step": 0, "sent": None, "recv": None, "holds": [int(v) for v in x.tolist()]}]

    def on_step(phase, step, send_i, recv_i, nbytes, chunks):  # called after each step, on every rank
        held = " ".join(f"{int(c.item()):>{ctx.world_size}d}" for c in chunks)  # integers: 1111110 != 1111111
        steps.append(f"{phase:<14} step {step}: sent chunk {send_i}, got chunk {recv_i} -> holds [{held}]")
        states.append({"phase": phase, "step": step, "sent": send_i, "recv": recv_i,
                       "holds": [int(c.item()) for c in chunks]})

    ctx.print_ordered(f"start                                           -> holds "
                      f"[{' '.join(f'{int(v):>{ctx.world_size}d}' for v in x.tolist())}]")
    ring_all_reduce(x, on_step=on_step)
    for line in steps:  # the same number of steps on every rank, so this collective loop lines up
        ctx.print_ordered(line)
    report.expect_equal(f"traced ring on rank {ctx.rank}", x, torch.full((ctx.world_size,), float(sum(
        10.0 ** r for r in range(ctx.world_size)))))
    return states
# --8<-- [end:trace]


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs, each started together on all ranks (barrier)."""
    times = []
    with steady_timing():  # no garbage-collector pass inside a timed call
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


# --8<-- [start:compare]
def compare(ctx: RankContext, numel: int, args: Settings) -> dict:
    W = ctx.world_size
    x = rank_input(args.seed, ctx.rank, numel)
    expected = sum(rank_input(args.seed, r, numel).double() for r in range(W))  # numpy-free float64 reference
    sent = [0]

    def count(phase, step, send_i, recv_i, nbytes, chunks):
        sent[0] += nbytes  # bytes this rank handed to isend in this step

    ring = ring_all_reduce(x.clone(), on_step=count)
    builtin = x.clone()
    dist.all_reduce(builtin)
    tol = dict(rtol=1e-5, atol=1e-5 * W)  # float32 sums in different orders differ in the last bits
    report.expect_close(f"ring, n={numel}, rank {ctx.rank}", ring, expected.float(), **tol)
    report.expect_close(f"all_reduce, n={numel}, rank {ctx.rank}", builtin, expected.float(), **tol)

    per_rank = [0] * W
    dist.all_gather_object(per_rank, sent[0])  # bytes sent by every rank
    formula = comm_volume("all_reduce", numel * 4, W)["sent"]
    # sum over ranks of bytes sent is exactly 2(W-1)N for any chunking; each rank's share only when W divides n
    report.expect_close(f"total ring bytes, n={numel}", sum(per_rank), W * formula, rtol=1e-12, atol=0)
    if numel % W == 0:
        report.expect_equal(f"per-rank ring bytes, n={numel}", np.array(per_rank), np.full(W, formula))
    return {"numel": numel, "ring_ms": 1e3 * timed(lambda: ring_all_reduce(x.clone()), args.repeats),
            "all_reduce_ms": 1e3 * timed(lambda: dist.all_reduce(x.clone()), args.repeats),
            "max_abs_diff": float((ring - builtin).abs().max()), "ring_bytes_sent_max": max(per_rank),
            "formula_bytes_sent": int(formula) if float(formula).is_integer() else formula}
# --8<-- [end:compare]


def worker(ctx: RankContext, args: Settings) -> dict:
    ctx.print(f"world_size={ctx.world_size} backend={ctx.backend}: trace of a ring all-reduce of {ctx.world_size} "
              "elements (rank r starts with 10^r everywhere)")
    trace = [None] * ctx.world_size
    dist.all_gather_object(trace, traced_run(ctx))  # every rank's states, step by step, for rank 0's figure
    rows = [compare(ctx, n, args) for n in lengths(ctx.world_size, args.mib)]
    return {"world_size": ctx.world_size, "backend": ctx.backend, "lengths": rows, "trace": trace}


# --8<-- [start:draw]
def ring_schedule(trace: list[list[dict]]) -> list[dict]:
    """The messages the traced ring really sent, read off every rank's trace: one {step, phase, src, dst, chunk}
    per rank per step, the sender's "sent chunk" checked against what its right neighbour says it received."""
    W, messages = len(trace), []
    for t in range(1, len(trace[0])):  # state 0 is the start; state t is after global step t-1
        for src, states in enumerate(trace):
            dst, chunk = (src + 1) % W, states[t]["sent"]
            report.expect_equal(f"step {t - 1}: rank {dst} got the chunk rank {src} sent", trace[dst][t]["recv"],
                                chunk)
            messages.append({"step": t - 1, "phase": states[t]["phase"], "src": src, "dst": dst, "chunk": chunk})
    return messages


def draw_ring(trace: list[list[dict]], messages: list[dict], args: Settings) -> tuple[str, str]:
    """One frame per step: the W ranks on a circle, each with its W chunks (the value 10^r summed over the ranks
    whose data a chunk holds), an arrow per message of that step labelled with its chunk, received chunks in red."""
    plt = plot.pyplot()
    from matplotlib.patches import FancyArrowPatch, Rectangle

    W, frames = len(trace), len(trace[0])
    angles = [np.pi / 2 - 2 * np.pi * r / W for r in range(W)]  # rank 0 on top, clockwise
    centre = [(1.25 * np.cos(a), 1.25 * np.sin(a)) for a in angles]
    cell, font = 0.36 if W <= 4 else 2.2 / (W * 1.6), 9 if W <= 4 else 6
    fig, ax = plt.subplots(figsize=(6.4, 6.4))
    colours = plt.get_cmap("crest")

    def edge(cx: float, cy: float) -> tuple[float, float]:
        """The point just outside a rank's row of cells, on the way to the centre: where its arrows start or end."""
        ux, uy = -cx / np.hypot(cx, cy), -cy / np.hypot(cx, cy)
        t = min((W * cell / 2 + 0.08) / max(abs(ux), 1e-9), (cell / 2 + 0.08) / max(abs(uy), 1e-9))
        return cx + ux * t, cy + uy * t

    def draw(i: int) -> None:
        ax.clear()
        ax.set_axis_off()
        ax.set_xlim(-2.1, 2.1)
        ax.set_ylim(-2.1, 2.2)
        ax.set_aspect("equal")
        for r, (cx, cy) in enumerate(centre):  # one row of W chunk cells per rank
            x0 = cx - W * cell / 2
            ax.text(cx, cy + cell * 0.85, f"rank {r}", ha="center", va="bottom", fontsize=9, weight="bold")
            for k, value in enumerate(trace[r][i]["holds"]):
                ranks_in = str(value).count("1")  # 10^r summed over ranks: one digit 1 per rank included
                red = trace[r][i]["recv"] == k
                ax.add_patch(Rectangle((x0 + k * cell, cy - cell / 2), cell, cell, lw=2.5 if red else 0.8,
                                       edgecolor="red" if red else "white", zorder=3 if red else 2,
                                       facecolor=colours(0.15 + 0.8 * ranks_in / W)))
                ax.text(x0 + (k + 0.5) * cell, cy, str(value), ha="center", va="center", fontsize=font, zorder=4,
                        color="white" if ranks_in > W / 2 else "black")
            for k in range(W):  # the chunks' names under every rank's row (the same order on every rank)
                ax.text(x0 + (k + 0.5) * cell, cy - cell * 0.58, f"c{k}", ha="center", va="top",
                        fontsize=font - 1, color="#444444")
        step = [m for m in messages if m["step"] == i - 1]
        for m in step:  # an arc from the sender to its right neighbour, labelled with the chunk it carries
            (x1, y1), (x2, y2) = centre[m["src"]], centre[m["dst"]]
            ax.add_patch(FancyArrowPatch(edge(x1, y1), edge(x2, y2), arrowstyle="-|>", zorder=5,
                                         mutation_scale=16, lw=1.6, color="C3", connectionstyle="arc3,rad=0.3"))
            mx, my = 0.45 * (x1 + x2), 0.45 * (y1 + y2)  # near the middle of the arc
            ax.text(mx, my, f"c{m['chunk']}", ha="center", va="center", fontsize=8, color="C3",
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "C3", "lw": 0.6})
        head = ("start: rank r holds 10^r in every chunk" if i == 0 else
                f"{step[0]['phase']} step {trace[0][i]['step']}: each rank sends one chunk to rank (r+1) mod {W}")
        ax.set_title(f"ring all-reduce, {W} ranks, frame {i} of {frames - 1}\n{head}", fontsize=10)
        ax.text(0, -2.0, f"chunks c0..c{W - 1}, in the same order on every rank; red = just received\n"
                f"a value's digits name the ranks whose data it holds ({'1' * W} = all {W})", ha="center",
                fontsize=7)

    gif, strip = plot.animate(fig, draw, frames, args, "ring_steps", fps=0.8, strip_columns=4, dpi=100)
    return str(gif), str(strip)
# --8<-- [end:draw]


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "mib": 0.25, "repeats": 2},
                     world_sizes=range(1, 9), world_sizes_text="1..8")
    result = launch(worker, args)
    if result is None:
        return 0
    print(f"\nmedian times, {load_average()}")
    # the formula's bytes are fractional where W does not divide the length: two decimals (.4g would print 5339)
    rows = [{**row, "formula_bytes_sent": f"{row['formula_bytes_sent']:.2f}".removesuffix(".00").rjust(18)}
            for row in result["lengths"]]
    print(report.table(rows, floatfmt=".4g"))
    trace = result.pop("trace")
    messages = ring_schedule(trace)
    for path in draw_ring(trace, messages, args):
        print(f"figure: {path}")
    exact = [row for row in result["lengths"] if row["numel"] % args.world_size == 0]  # W divides n: exact share
    print("\nOK: ring_all_reduce equals dist.all_reduce and the float64 sum for every length; the bytes sent, summed "
          "over ranks, equal W x comm_volume's 2(W-1)/W*N for every length" +
          (f", and per rank exactly for n = {', '.join(str(r['numel']) for r in exact)} (W divides n)"
           if exact else ""))
    if args.json:
        frames = [[rank[i]["holds"] for rank in trace] for i in range(len(trace[0]))]  # (frames, W ranks, W chunks)
        report.write_json(args.json, {**result, "ring_schedule": messages,
                                      "ring_frames": frames}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
