"""Ring all-reduce from send/recv: equal to dist.all_reduce, its step-by-step trace, its bytes, its speed.

What it shows
    1. A trace of mlsys.collectives.ring_all_reduce on a tiny tensor (one element per chunk): after every step, what
       each rank sent, received and holds -- the reduce-scatter phase, then the all-gather phase; the figure
       draws the same trace as one (rank, chunk) grid per step.
    2. For several lengths (1, W-1, W+1, 1001, and a few MiB), ring_all_reduce and dist.all_reduce give the same sum
       as numpy on the concatenated inputs; the bytes each rank handed to isend are counted and compared with
       mlsys.collectives.comm_volume("all_reduce", ...); both are timed (median of --repeats runs).
    3. The communication-volume table of every collective for this W and the big size, from comm_volume.

How to run (any world size from 1 to 8)
    python tutorial/part1-distributed/chapter03-collectives/scripts/ring_allreduce.py -w 4
    torchrun --nproc-per-node 4 tutorial/part1-distributed/chapter03-collectives/scripts/ring_allreduce.py
    ... --mib 16 --repeats 10     # a bigger tensor, more timing runs

Runtime on 2 cores: about 6 s at -w 4 with the default 4 MiB, 4 s with --smoke.

Try next
    python tutorial/part1-distributed/chapter03-collectives/scripts/ring_allreduce.py -w 3
        -> a 3-rank trace: 2 reduce-scatter steps, then 2 all-gather steps, every chunk ending at 111
    python tutorial/part1-distributed/chapter03-collectives/scripts/ring_allreduce.py -w 8 --mib 1
        -> 8 ranks: the trace grows to 14 steps; each rank sends 2(8-1)/8 = 1.75 N bytes
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
from mlsys.collectives import COLLECTIVES, comm_volume, ring_all_reduce
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
    states = [{"phase": "start", "step": 0, "recv": None, "holds": x.tolist()}]  # for the figure

    def on_step(phase, step, send_i, recv_i, nbytes, chunks):  # called after each step, on every rank
        held = " ".join(f"{c.item():>{ctx.world_size}g}" for c in chunks)
        steps.append(f"{phase:<14} step {step}: sent chunk {send_i}, got chunk {recv_i} -> holds [{held}]")
        states.append({"phase": phase, "step": step, "recv": recv_i, "holds": [c.item() for c in chunks]})

    ctx.print_ordered(f"start                                           -> holds "
                      f"[{' '.join(f'{v:>{ctx.world_size}g}' for v in x.tolist())}]")
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


def draw_trace(trace: list[list[dict]], args: Settings) -> str:
    """One panel per step: the (rank, chunk) grid of partial sums, the chunk each rank just received outlined."""
    plt = plot.pyplot()
    import seaborn as sns

    W, steps = len(trace), len(trace[0])
    fig, axes = plt.subplots(1, steps, figsize=(1.2 + 1.0 * W * steps / 2, 0.9 + 0.45 * W), squeeze=False)
    for i, ax in enumerate(axes[0]):
        grid = np.array([rank[i]["holds"] for rank in trace])  # (W ranks, W chunks)
        sns.heatmap(np.log10(grid), annot=grid, fmt="g", cbar=False, cmap="crest", vmin=0, vmax=W, ax=ax,
                    linewidths=0.5, annot_kws={"fontsize": 7})
        for r, rank in enumerate(trace):
            if rank[i]["recv"] is not None:  # outline the chunk that arrived from rank r-1 in this step
                ax.add_patch(plt.Rectangle((rank[i]["recv"], r), 1, 1, fill=False, edgecolor="red", lw=2))
        state = trace[0][i]
        ax.set_title("start" if state["phase"] == "start" else f"{state['phase']}\nstep {state['step']}",
                     fontsize=9)
        ax.set_xlabel("chunk", fontsize=8)
        ax.set_yticklabels([f"rank {r}" for r in range(W)] if i == 0 else [], rotation=0, fontsize=8)
    fig.suptitle(f"Ring all-reduce on {W} ranks, rank r starting with 10^r: red = the chunk received in that step")
    fig.tight_layout()
    return str(plot.save(fig, args, "ring_trace"))


def volume_table(world_size: int, num_bytes: int) -> list[dict]:
    rows = []
    for name in COLLECTIVES:
        v = comm_volume(name, num_bytes, world_size)
        rows.append({"collective": name, "algorithm": v["algorithm"], "sent_MiB": v["sent"] / 2**20,
                     "received_MiB": v["received"] / 2**20, "sent/N": v["sent"] / num_bytes})
    return rows


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "mib": 0.25, "repeats": 2},
                     world_sizes=range(1, 9), world_sizes_text="1..8")
    result = launch(worker, args)
    if result is None:
        return 0
    print(f"\nmedian times, {load_average()}")
    print(report.table(result["lengths"], floatfmt=".4g"))
    big = max(result["lengths"], key=lambda row: row["numel"])  # the big length (the sorted list ends with it)
    n_bytes = big["numel"] * 4
    print(f"\nbytes each rank sends and receives, W={args.world_size}, N={n_bytes / 2**20:.4g} MiB "
          "(see comm_volume's docstring for what N is per collective):")
    table = volume_table(args.world_size, n_bytes)
    print(report.table(table, floatfmt=".4g"))
    print(f"figure: {draw_trace(result.pop('trace'), args)}")
    exact = [row for row in result["lengths"] if row["numel"] % args.world_size == 0]  # W divides n: exact share
    print("\nOK: ring_all_reduce equals dist.all_reduce and the float64 sum for every length; the bytes sent, summed "
          "over ranks, equal W x comm_volume's 2(W-1)/W*N for every length" +
          (f", and per rank exactly for n = {', '.join(str(r['numel']) for r in exact)} (W divides n)"
           if exact else ""))
    if args.json:
        report.write_json(args.json, {**result, "comm_volume": table}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
