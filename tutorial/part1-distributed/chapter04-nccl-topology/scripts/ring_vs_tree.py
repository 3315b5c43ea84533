"""Ring vs tree vs recursive halving-doubling all-reduce, by hand, against gloo's own, and an alpha-beta model.

What it shows
    Three all-reduce algorithms written from isend/irecv (mlsys/collectives.py), each checked equal to
    dist.all_reduce (float32 tolerance, an odd length that most world sizes do not divide) before it is timed:
      ring      reduce-scatter + all-gather around a ring, 2(p-1) steps, each rank sends 2(p-1)/p * n bytes
                (bandwidth-optimal, latency grows with p);
      tree      reduce up a binary (heap-order) tree to rank 0, then broadcast down: 2 floor(log2 p) steps, but
                a parent takes the whole n from each of its two children (and sends n to each on the way down);
      halving-doubling  Rabenseifner: reduce-scatter by recursive halving, all-gather by recursive doubling,
                2 log2(p) steps AND 2(p-1)/p * n bytes; power-of-two p only (skipped otherwise, with a message).
    The output has four sections:
      1. correctness: each algorithm's largest difference from dist.all_reduce;
      2. the median time per all-reduce of every algorithm and gloo's own at each size (they take turns, so a
         burst of load hits all of them) and the fastest of them all, gloo's included; which of ring and tree was
         faster where (a tie where their ranges over the rounds overlap: no winner is claimed there; the table
         prints both ranges and the verdict per size), ring busbw over gloo's;
      3. an alpha-beta model time = steps*alpha + bytes*beta: ONE (alpha, beta) >= 0 fitted by least squares,
         each point weighted by 1/time (the relative error (model/time - 1)^2: a point above the line costs at
         most 1, one below it without limit), to the ring's and the tree's times at every other size from the
         smallest, plus the largest, then compared with the points it did not see (the sizes in between, and every
         halving-doubling point): measured/model per size, the median and worst factor on the held-out points, the
         model's ring-vs-tree crossover beside the measured one, the model's crossover at those of 8, 64 and 512
         ranks above the run's own, with the same alpha and beta (a prediction: ranks started on one box share its
         cores and memory, so no run here times that many real links), and which algorithm's points the line passes
         nearer; a `note:` line when the fit pins alpha at 0 (then the factors at the small sizes are meaningless)
         or beta at 0 (then no size costs more than another);
      4. the box's ceilings (memcpy bandwidth of a large torch copy, loopback TCP through a socket) and the best
         busbw at the largest size as a fraction of each.
    Figures: steps.png (every message of the tree and of halving-doubling, step by step, from the schedules the
    two all-reduces follow; kept in the JSON as "steps"), ring_vs_tree.png (the measured times), alpha_beta.png
    (the model against the points, fitted and held out, with its latency- and bandwidth-bound ranges shaded, and
    below, the ring's and the tree's model lines on one set of axes with the crossover n* marked) and
    ceiling.png (busbw under the two ceilings); the last two are kept in the JSON under "figures".
    On one box, the ring's per-link advantage cannot show: summed over all ranks, the ring and the tree copy the
    same 2(p-1) n bytes, and here every "link" shares the same CPUs and memory.

How to run (any world size >= 2: one rank has nothing to reduce; halving-doubling needs a power of two)
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py -w 8 --max-bytes 2097152
    torchrun --nproc-per-node 4 tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py

Contract flags: --smoke uses 2 ranks and sizes up to 64 KiB; --seed sets the random data of the correctness check.

Runtime on 2 cores: about 20-60 s (4 ranks, 256 B .. 8 MiB; 37 to 56 s at a load near 9.5), longer under heavier load;
--smoke about 10 s.

Try next
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py -w 2
        -> two ranks: equal steps, so the model has no crossover; the ring sends twice as many messages (2 sends
           and 2 receives per rank against the tree's 1 and 1), which the model does not see; a `note:` line, if
           printed, says what in the fit not to trust
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py -w 8 --max-bytes 2097152
        -> eight ranks on two cores: more steps, more scheduler noise at small sizes; about a minute on 2 cores
           at a load near 2, up to about L/C times that at a load L on C cores (section 2 prints the load).
           Its sweep has an even number of sizes, so the fit takes both of the two largest (1 and 2 MiB)
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py -w 3
        -> halving-doubling is skipped with a message: it needs a power of two
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.bench import busbw, load_average, loopback_tcp_bandwidth, memcpy_bandwidth, steady_timing, time_collective
from mlsys.collectives import (
    halving_doubling_all_reduce,
    halving_doubling_plan,
    is_power_of_two,
    ring_all_reduce,
    tree_all_reduce,
    tree_children,
    tree_parent,
)
from mlsys.launch import RankContext, launch

ELEMENT_BYTES = 4  # float32
FITTED = ("ring", "tree")  # the algorithms whose points the alpha-beta fit sees
MODELLED = ("ring", "tree", "halving-doubling")  # the algorithms the model gives a time for


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 4
    """Number of ranks to start. Under torchrun it is taken from WORLD_SIZE."""
    min_bytes: int = 256
    """Smallest message size in bytes."""
    max_bytes: int = 8 * 2**20
    """Largest message size in bytes (always measured, even off the x4 grid)."""
    max_iters: int = 10
    """Timed calls per algorithm at small sizes; large sizes get fewer (at least 2)."""
    rounds: int = 3
    """The algorithms take turns this many times at each size; the median round counts (the CPU is shared)."""
    check_numel: int = 1001
    """Length of the random tensor each algorithm must all-reduce exactly like dist.all_reduce."""

    def validate(self) -> None:
        if self.min_bytes < ELEMENT_BYTES or self.max_bytes < self.min_bytes:
            raise cli.UsageError(f"need {ELEMENT_BYTES} <= --min-bytes <= --max-bytes")
        if self.max_iters < 1 or self.rounds < 1 or self.check_numel < 1:
            raise cli.UsageError("need --max-iters, --rounds and --check-numel >= 1")


def gloo_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)  # the library's own algorithm (gloo picks it), in place
    return tensor


def algorithms(world_size: int) -> dict:
    algos = {"ring": ring_all_reduce, "tree": tree_all_reduce}
    if is_power_of_two(world_size):
        algos["halving-doubling"] = halving_doubling_all_reduce
    algos["gloo all_reduce"] = gloo_all_reduce
    return algos


# --8<-- [start:schedules]
def tree_schedule(world_size: int, numel: int) -> list[dict]:
    """Every message tree_all_reduce sends, from the same tree_parent/tree_children: a rank sends its subtree's sum
    up once all its children's sums have arrived (a leaf at step 0); the root's total then goes down one level a
    step. One dict per message: step, phase, src, dst, the element range [lo, hi) and what the receiver does."""
    p = world_size

    def up_step(r: int) -> int:  # the step at which r's subtree sum is complete and leaves r
        return 1 + max((up_step(c) for c in tree_children(r, p)), default=-1)

    def depth(r: int) -> int:
        return 0 if r == 0 else 1 + depth(tree_parent(r))

    top = up_step(0)  # the step at which the root holds the total and starts sending it down
    up = [{"step": up_step(r), "phase": "reduce up", "src": r, "dst": tree_parent(r), "lo": 0, "hi": numel,
           "op": "add"} for r in range(1, p)]
    down = [{"step": top + depth(tree_parent(r)), "phase": "broadcast down", "src": tree_parent(r), "dst": r,
             "lo": 0, "hi": numel, "op": "copy"} for r in range(1, p)]
    return sorted(up + down, key=lambda m: (m["step"], m["src"]))


def halving_doubling_schedule(world_size: int, numel: int) -> list[dict]:
    """Every message halving_doubling_all_reduce sends, from the same halving_doubling_plan: step i of the
    reduce-scatter gives the half it does not keep (the receiver adds it); the all-gather replays the plan
    backwards, each rank sending the range it owns (the receiver copies it)."""
    out = []
    for rank in range(world_size):
        plan = halving_doubling_plan(rank, world_size, numel)
        for i, (partner, _, give) in enumerate(plan):
            out.append({"step": i, "phase": "reduce-scatter (halving)", "src": rank, "dst": partner,
                        "lo": give[0], "hi": give[1], "op": "add"})
        for j, (partner, keep, _) in enumerate(reversed(plan)):
            out.append({"step": len(plan) + j, "phase": "all-gather (doubling)", "src": rank, "dst": partner,
                        "lo": keep[0], "hi": keep[1], "op": "copy"})
    return sorted(out, key=lambda m: (m["step"], m["src"]))
# --8<-- [end:schedules]


# --8<-- [start:draw_steps]
def draw_steps(world_size: int, args: Settings) -> dict[str, list[dict]]:
    """One row per algorithm, one panel per step: who sends to whom and how much (as a fraction of the n-element
    buffer), from the schedules above. Returns the schedules it drew."""
    from fractions import Fraction

    from matplotlib.patches import FancyArrowPatch

    p, numel = world_size, 16 * world_size  # a size every step divides evenly, so the labels are exact fractions
    drawn = {"tree": tree_schedule(p, numel)}
    if is_power_of_two(p):
        drawn["halving-doubling"] = halving_doubling_schedule(p, numel)
    tree_pos = {}
    for r in range(p):  # heap layout: depth d on row -d, spread evenly within the row
        d = (r + 1).bit_length() - 1
        tree_pos[r] = ((r + 1 - 2**d + 0.5) / 2**d * (p - 1), -1.2 * d)
    line_pos = {r: (float(r), 0.0) for r in range(p)}
    plt = plot.pyplot()
    cols = max(m["step"] for sched in drawn.values() for m in sched) + 1
    size = 0.55 * p + 0.8  # inches per panel
    fig, axes = plt.subplots(len(drawn), cols, figsize=(size * cols, (size + 0.3) * len(drawn)), squeeze=False)
    for row, (name, sched) in enumerate(drawn.items()):
        pos = tree_pos if name == "tree" else line_pos
        sent = [sum(Fraction(m["hi"] - m["lo"], numel) for m in sched if m["src"] == r) for r in range(p)]
        for step in range(cols):
            ax = axes[row, step]
            ax.set_axis_off()
            ax.set_aspect("equal")
            ys = [y for _, y in pos.values()]
            ax.set_xlim(-0.6, p - 0.4)
            ax.set_ylim(min(ys) - 1.0, max(ys) + 1.0)
            for r, (x, y) in pos.items():
                ax.add_patch(plt.Circle((x, y), 0.25, color="C0", zorder=3))
                ax.text(x, y, str(r), ha="center", va="center", color="white", fontsize=9, zorder=4)
            mine = [m for m in sched if m["step"] == step]
            for m in mine:
                (x1, y1), (x2, y2) = pos[m["src"]], pos[m["dst"]]
                colour = "C3" if m["op"] == "add" else "C2"
                ax.add_patch(FancyArrowPatch((x1, y1), (x2, y2), arrowstyle="-|>", mutation_scale=10, lw=1.3,
                                             color=colour, shrinkA=7, shrinkB=7, connectionstyle="arc3,rad=0.35"))
                frac = Fraction(m["hi"] - m["lo"], numel)
                label = "n" if frac == 1 else f"n/{frac.denominator}" if frac.numerator == 1 else f"{frac}n"
                dx, dy = x2 - x1, y2 - y1
                ax.text((x1 + x2) / 2 + 0.3 * dy, (y1 + y2) / 2 - 0.3 * dx, label, fontsize=7, color=colour,
                        ha="center", va="center")
            ax.set_title(f"{name}, step {step}\n{mine[0]['phase'] if mine else '(done)'}", fontsize=8)
        footer = "bytes sent, per rank: " + ", ".join(f"{r}: {v}n".replace(": 1n", ": n") for r, v in enumerate(sent))
        axes[row, 0].text(0, -0.02, footer, transform=axes[row, 0].transAxes, fontsize=7, ha="left", va="top",
                          clip_on=False)
    fig.suptitle(f"all-reduce on {p} ranks, step by step\norange: the receiver adds it, green: the receiver copies it; "
                 "n = the buffer's size", fontsize=9)
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'steps')}")
    return drawn
# --8<-- [end:draw_steps]


# --8<-- [start:model]
def cost_terms(algorithm: str, world_size: int) -> tuple[float, float]:
    """(latency steps a, bytes factor b) of the model time = a * alpha + b * n * beta for an n-byte all-reduce.

    ring: 2(p-1) steps, 2(p-1)/p * n bytes per rank; halving-doubling: 2 log2(p) steps and the ring's bytes.
    tree (the heap-order tree built above): floor(log2 p) levels, each crossed once up and once down; at a level
    whose parent has k children, k * n bytes go through that parent's link (k messages of n in, or out), so the
    critical path carries 2 * sum over levels of k * n. (Alpha-beta model: Hockney, "The communication challenge
    for MPP", Parallel Computing 1994, https://doi.org/10.1016/0167-8191(94)90032-9.)
    """
    p = world_size
    levels = p.bit_length() - 1  # floor(log2 p): the depth of the deepest rank in heap order
    return {"ring": (2 * (p - 1), 2 * (p - 1) / p), "tree": (2 * levels, 2 * sum(tree_level_fans(p))),
            "halving-doubling": (2 * levels, 2 * (p - 1) / p)}[algorithm]


def tree_level_fans(world_size: int) -> list[int]:
    """For each depth d of the heap-order tree that has parents, the most children any parent at depth d has: 2,
    except where the last level is cut short. [2, 1] for 4 ranks: the root has two children, rank 1 one."""
    p = world_size
    return [max(len(tree_children(r, p)) for r in range(2**d - 1, min(2 ** (d + 1) - 1, p)))
            for d in range(p.bit_length() - 1)]


def fit_alpha_beta(steps: np.ndarray, bytes_moved: np.ndarray, time_s: np.ndarray) -> tuple[float, float]:
    """Least squares for (alpha s/step, beta s/byte) in time = steps*alpha + bytes_moved*beta, one row per measured
    point (points of different algorithms can be mixed: each row carries its own steps and bytes). Each row is
    divided by its time, so that 100 us and 100 ms measurements weigh the same (relative error). Both values are
    kept >= 0: when noise drives one negative, the other is refitted alone (a two-variable non-negative fit)."""
    design = np.stack([steps, bytes_moved], axis=1).astype(float) / time_s[:, None]  # [points, 2]
    target = np.ones_like(time_s, dtype=float)
    (alpha, beta), *_ = np.linalg.lstsq(design, target, rcond=None)
    if alpha >= 0 and beta >= 0:
        return float(alpha), float(beta)
    only_alpha = (np.linalg.lstsq(design[:, :1], target, rcond=None)[0][0], 0.0)
    only_beta = (0.0, np.linalg.lstsq(design[:, 1:], target, rcond=None)[0][0])
    residual = lambda ab: float(np.sum((design @ np.array(ab) - target) ** 2))
    alpha, beta = min(only_alpha, only_beta, key=residual)
    return float(alpha), float(beta)


def split_sizes(sizes: list[int]) -> tuple[list[int], list[int]]:
    """(sizes the model is fitted on, sizes held out to test it): every other size of the sweep counting from the
    smallest, plus the largest, so that every held-out size lies between two fitted ones. With an even number of
    sizes the two largest are both fitted (e.g. 1 MiB and 2 MiB of -w 8 --max-bytes 2097152)."""
    fit = sizes[::2] + ([sizes[-1]] if len(sizes) % 2 == 0 else [])
    return fit, [s for s in sizes if s not in fit]


def fit_on(rows: list[dict], world_size: int, fit_sizes: list[int]) -> tuple[float, float]:
    """One (alpha, beta) for the ring and the tree together, from their measured times at `fit_sizes` only: the
    same two numbers must explain both algorithms, each with its own steps and bytes."""
    points = [(*cost_terms(r["algorithm"], world_size), r["size (B)"], r["time (us)"] * 1e-6) for r in rows
              if r["algorithm"] in FITTED and r["size (B)"] in fit_sizes]
    steps, factor, size, seconds = (np.array(col, dtype=float) for col in zip(*points))
    return fit_alpha_beta(steps, factor * size, seconds)


def model_vs_measured(rows: list[dict], world_size: int, fit_sizes: list[int], alpha: float,
                      beta: float) -> list[dict]:
    """Every measured point of a modelled algorithm beside the model's time for it. Role "fit": a ring or tree
    point the fit saw; "held out": every other point (halving-doubling's were never fitted at all)."""
    out = []
    for r in rows:
        if r["algorithm"] not in MODELLED:
            continue
        a, b = cost_terms(r["algorithm"], world_size)
        model_us = 1e6 * (a * alpha + b * r["size (B)"] * beta)
        fitted = r["algorithm"] in FITTED and r["size (B)"] in fit_sizes
        out.append({"algorithm": r["algorithm"], "size (B)": r["size (B)"], "role": "fit" if fitted else "held out",
                    "measured (us)": r["time (us)"], "model (us)": model_us,
                    "measured/model": r["time (us)"] / model_us if model_us > 0 else math.inf})
    return out


def crossover_bytes(alpha: float, beta: float, world_size: int) -> float | None:
    """Size where the model's ring and tree times are equal (tree faster below it); None if there is none."""
    (a_ring, b_ring), (a_tree, b_tree) = cost_terms("ring", world_size), cost_terms("tree", world_size)
    if a_ring <= a_tree or b_tree <= b_ring or beta <= 0 or alpha <= 0:
        return None  # the ring has no more steps than the tree (p = 2), or the fit pinned alpha or beta at 0
    return alpha * (a_ring - a_tree) / (beta * (b_tree - b_ring))


MORE_RANKS = (8, 64, 512)  # rank counts whose real links one box cannot show; the model's crossover, off the fit


def crossover_at_more_ranks(alpha: float, beta: float, ranks: tuple[int, ...] = MORE_RANKS) -> dict[int, float]:
    """The model's n* at larger rank counts, with this run's fitted alpha and beta: a prediction of the model (the
    same formula, each p with its own steps and bytes), not a measurement. Empty when the fit pinned alpha or beta
    at 0 (no crossover at any p)."""
    return {p: crossover_bytes(alpha, beta, p) for p in ranks} if alpha > 0 and beta > 0 else {}


def more_ranks_text(crossovers: dict[int, float]) -> str:
    if not crossovers:
        return "none: the fit pinned alpha or beta at 0, so the model has no crossover at any number of ranks"
    return ", ".join(f"{p} ranks: {size_text(n)}" for p, n in crossovers.items())


def more_ranks_line(summary: dict, world_size: int, cores: int | None) -> str | None:
    """The printed line for the model's n* at the rank counts of MORE_RANKS above this run's: a prediction. This
    box can start that many ranks (a -w 8 run works), but they share its cores and its memory, so no run here
    times that many real links. None when the run already has at least the largest of them."""
    if world_size >= max(MORE_RANKS):
        return None
    why = (f" (a prediction, not a measurement: this box can start that many ranks, but they share its "
           f"{cores or 'few'} cores and one memory, so its timings cannot show that many real links)"
           if summary["more_ranks_crossover_bytes"] else "")
    return (f"the model's crossover at more ranks, with this fit's alpha and beta: "
            f"{summary['more_ranks_crossover_text']}{why}")
# --8<-- [end:model]


def rank_data(rank: int, numel: int, seed: int) -> torch.Tensor:
    """Rank `rank`'s random input of length `numel`: reproducible anywhere, so a test can sum it with numpy."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed * 7919 + 131 * rank + numel))


def all_reduce_every_way(numels: list[int], seed: int) -> dict[str, list[list[float]]]:
    """On every rank: each algorithm (and dist.all_reduce) applied to fresh copies of this rank's data.
    Plain lists, not tensors, so that the results can travel back through the launcher's pipe."""
    rank = dist.get_rank()
    return {name: [fn(rank_data(rank, n, seed)).tolist() for n in numels]
            for name, fn in algorithms(dist.get_world_size()).items()}


def check_against_gloo(ctx: RankContext, args: Settings) -> tuple[dict, dict]:
    """Every hand algorithm on random data of an odd length must match dist.all_reduce. Returns (largest error of
    each, what each returned on this rank: an observation a test can hold against its own sum of the inputs)."""
    results = all_reduce_every_way([args.check_numel], args.seed)
    reference = torch.tensor(results["gloo all_reduce"][0])
    errors = {}
    for name, (values,) in results.items():
        got = torch.tensor(values)
        report.expect_close(f"rank {ctx.rank}: {name} vs dist.all_reduce", got, reference, rtol=1e-5, atol=1e-5)
        errors[name] = float((got - reference).abs().max())
    return errors, {name: values for name, (values,) in results.items()}


def sweep_sizes(args: Settings) -> list[int]:
    out, size = [], args.min_bytes
    while size < args.max_bytes:
        out.append(size)
        size *= 4
    return out + [args.max_bytes]


def worker(ctx: RankContext, args: Settings) -> dict:
    algos = algorithms(ctx.world_size)
    errors, outputs = check_against_gloo(ctx, args)
    rows = []
    with steady_timing():  # one garbage collection for the whole sweep, not one per timed loop (each rank's costs
        for size in sweep_sizes(args):  # a tenth of a second, and the barrier waits for the slowest rank's)
            count = size // ELEMENT_BYTES
            buf = torch.zeros(count)  # zeros: repeated in-place sums stay finite
            iters = max(2, min(args.max_iters, (16 * 2**20) // size))
            rounds = {name: [] for name in algos}
            for _ in range(args.rounds):  # take turns, so a burst of load from elsewhere hits every algorithm
                for name, fn in algos.items():
                    rounds[name].append(time_collective(lambda: fn(buf), warmup=1, iters=iters,  # noqa: B023
                                                        device=ctx.device))
            for name, times in rounds.items():
                seconds = float(np.median(times))
                rows.append({"size (B)": count * ELEMENT_BYTES, "algorithm": name, "time (us)": seconds * 1e6,
                             "busbw (GB/s)": busbw("all_reduce", count * ELEMENT_BYTES, seconds, ctx.world_size),
                             "rounds (us)": [t * 1e6 for t in times]})
    return {"rows": rows, "max_abs_error": errors, "check_output": outputs}


def tied(a: dict, b: dict) -> bool:
    """Whether two algorithms' times at one size are a tie within the measurement's own spread: the ranges of
    their rounds (fastest to slowest round) overlap. A row without its rounds counts as one round at its time."""
    lo_a, hi_a = min(a.get("rounds (us)") or [a["time (us)"]]), max(a.get("rounds (us)") or [a["time (us)"]])
    lo_b, hi_b = min(b.get("rounds (us)") or [b["time (us)"]]), max(b.get("rounds (us)") or [b["time (us)"]])
    return max(lo_a, lo_b) <= min(hi_a, hi_b)


def summarise(rows: list[dict], world_size: int) -> dict:
    """The measured comparison (which of ring and tree was faster where, ring against gloo), then the alpha-beta
    model fitted on every other size and tested on the sizes it did not see. A size where the ring's and the
    tree's round-to-round ranges overlap is a tie: neither is named faster there, and a crossover is only claimed
    between sizes where the winner is clear."""
    sizes = sorted({r["size (B)"] for r in rows})
    row_of = {(r["algorithm"], r["size (B)"]): r for r in rows}
    time_of = {key: r["time (us)"] for key, r in row_of.items()}
    busbw_of = {key: r["busbw (GB/s)"] for key, r in row_of.items()}
    ties = [s for s in sizes if tied(row_of["ring", s], row_of["tree", s])]
    ring_faster = [s for s in sizes if s not in ties and time_of["ring", s] < time_of["tree", s]]
    tree_faster = [s for s in sizes if s not in ties and s not in ring_faster]
    clear = [s for s in sizes if s not in ties]  # the sizes with a clear winner, in order
    every = f"every size, {size_text(sizes[0])} to {size_text(sizes[-1])}"
    tie_note = (f". The ring and the tree were a tie within the rounds' spread at {', '.join(map(size_text, ties))}"
                if ties else "")  # a sentence of its own, after the verdict
    measured_text = (f"the ring and the tree were a tie within the rounds' spread at {every}" if not clear else
                     f"the tree was faster than the ring at {every}" if not ring_faster and not ties else
                     f"the ring was faster than the tree at {every}" if not tree_faster and not ties else
                     "; ".join(part for part in (
                         f"the ring was faster at {', '.join(map(size_text, ring_faster))}" if ring_faster else "",
                         f"the tree was faster at {', '.join(map(size_text, tree_faster))}" if tree_faster else "",
                         f"a tie within the rounds' spread at {', '.join(map(size_text, ties))}" if ties else "")
                               if part))
    fit_sizes, held_sizes = split_sizes(sizes)
    alpha, beta = fit_on(rows, world_size, fit_sizes)
    points = model_vs_measured(rows, world_size, fit_sizes, alpha, beta)
    off = lambda p: max(p["measured/model"], 1 / p["measured/model"])  # how many times off, either way
    held, fitted = ([p for p in points if p["role"] == role] for role in ("held out", "fit"))
    cross = crossover_bytes(alpha, beta, world_size)
    # among the sizes with a clear winner: tree at every one below clear[split], ring at every one from it on
    split = next((i for i in range(1, len(clear)) if set(clear[:i]) == set(tree_faster) and set(clear[i:]) ==
                  set(ring_faster)), None)
    backwards = next((i for i in range(1, len(clear)) if set(clear[:i]) == set(ring_faster) and set(clear[i:]) ==
                      set(tree_faster)), None)  # one switch the other way: ring faster below clear[i], tree above
    # "even above n*" only where a clear tree win lies above the model's crossover; wins at or below it agree with it;
    # where every size above n* is a tie, the run does not test the crossover at all, and the sentence says so
    where = (f"the model's crossover n* ({size_text(cross)}) lies beyond the largest size"
             if cross and cross > sizes[-1] else
             f"even above the model's crossover n* ({size_text(cross)})"
             if cross and max(tree_faster, default=0) > cross else
             f"but the sizes above the model's crossover n* ({size_text(cross)}) were ties, so this run does not "
             "test the model's crossover"
             if cross and any(s > cross for s in sizes) and all(s in ties for s in sizes if s > cross) else
             f"none of those sizes above the model's crossover n* ({size_text(cross)})"
             if cross else "and the model has no crossover")
    wherever = "at every size" if not ties else "at every size where the winner was clear"
    crossover_measured_text = (
        "does not show a crossover: the ring and the tree were a tie within the rounds' spread at every size"
        if not clear else
        f"does not show a crossover: the tree was faster {wherever}, {where}{tie_note}" if not ring_faster else
        f"does not show a crossover: the ring was faster {wherever}{tie_note}" if not tree_faster else
        f"shows a crossover: the tree was faster up to {size_text(clear[split - 1])}, the ring from "
        f"{size_text(clear[split])} (the model's n*: {size_text(cross) if cross else 'none'}){tie_note}"
        if split else
        f"shows one switch, the opposite way to the model's: the ring was faster up to "
        f"{size_text(clear[backwards - 1])}, the tree from {size_text(clear[backwards])} (the model has the tree "
        f"faster below n* and the ring above){tie_note}" if backwards else
        "does not show a clean crossover: which of the two was faster flips back and forth between "
        f"neighbouring sizes{tie_note}")
    more = tuple(p for p in MORE_RANKS if p > world_size)  # a -w 8 run's own n* is not printed again as 8's
    gloo_beaten = [s for s in sizes if time_of["tree", s] < time_of["gloo all_reduce", s]]
    names = list(dict.fromkeys(r["algorithm"] for r in rows))
    gap = lambda s: max(time_of[n, s] for n in names) / min(time_of[n, s] for n in names)
    widest = max(sizes, key=gap)  # the size where the fastest and the slowest algorithm are furthest apart
    fast, slow = (sorted(names, key=lambda n: time_of[n, widest])[i] for i in (0, -1))
    crossover_kind = ("all ties" if not clear else "tree everywhere" if not ring_faster else
                      "ring everywhere" if not tree_faster else "as the model" if split else
                      "opposite to the model" if backwards else "back and forth")
    return {"crossover_measured_text": crossover_measured_text, "crossover_kind": crossover_kind,
            "sizes_count": len(sizes),
            "tree_faster_than_gloo_count": len(gloo_beaten),
            "tree_faster_than_gloo_text": ", ".join(map(size_text, gloo_beaten)) or "no size",
            "largest_size": sizes[-1], "measured_text": measured_text,
            "widest_gap_text": f"at {size_text(widest)}, the {fast} took 1/{gap(widest):.1f} of the {slow}'s "
                               "median time",
            "tied_sizes": ties,
            "faster_at_largest": "ring" if sizes[-1] in ring_faster else "tree" if sizes[-1] in tree_faster else
            "tie",
            "tree_faster_at_every_size": not ring_faster and not ties,
            "ring_over_gloo_busbw": busbw_of["ring", sizes[-1]] / busbw_of["gloo all_reduce", sizes[-1]],
            "fit_sizes": fit_sizes, "held_out_sizes": held_sizes, "alpha_s": alpha, "beta_s_per_byte": beta,
            "fit_bandwidth_GBps": 1 / beta / 1e9 if beta > 0 else None, "model_points": points,
            "alpha_pinned_at_zero": alpha == 0 and beta > 0,
            "held_out_points": len(held), "held_out_worst_factor": max(map(off, held), default=None),
            "held_out_median_factor": float(np.median([off(p) for p in held])) if held else None,
            "held_out_off_by_2x": sum(off(p) > 2 for p in held),
            "fit_worst_factor": max(map(off, fitted)), "predicted_crossover_bytes": cross,
            **{f"{name}_median_ratio": float(np.median([p["measured/model"] for p in points if p["algorithm"] == name]))
               for name in dict.fromkeys(p["algorithm"] for p in points)},
            "predicted_crossover_text": size_text(cross) if cross else "none",
            "more_ranks_crossover_bytes": crossover_at_more_ranks(alpha, beta, more),
            "more_ranks_crossover_text": more_ranks_text(crossover_at_more_ranks(alpha, beta, more)) if more else
            "no larger rank count to predict",
            "ring_latency_bound_text": ring_latency_bound_text(alpha, beta, world_size, sizes),
            "step_cost_text": step_cost_text(time_of, world_size, sizes[0], alpha),
            "line_nearer_text": line_nearer_text(points, time_of, sizes)}


def ring_latency_bound_text(alpha: float, beta: float, world_size: int, sizes: list[int]) -> str:
    """At how many of the sweep's sizes the fitted model puts more of the ring's time on its steps (a * alpha) than
    on its bytes (b * n * beta): where the per-message cost dominates, the ring's fewer bytes cannot pay off."""
    if alpha <= 0:
        return "none of the sizes: this fit pinned alpha at 0 (its `note:` line), so it cannot show the fixed cost"
    a, b = cost_terms("ring", world_size)
    below = [s for s in sizes if a * alpha > b * s * beta]
    knee = f" (below its knee, {size_text(a * alpha / (b * beta))})" if beta > 0 else ""
    return f"{len(below)} of the {len(sizes)} sizes{knee}"


def step_cost_text(time_of: dict, world_size: int, size: int, alpha: float) -> str:
    """Each algorithm's median time at `size` over the steps it takes (gloo's ring: 2(p-1), as ours), also in
    units of the fitted alpha: a model with one cost per step would give every algorithm the same."""
    steps = {"ring": cost_terms("ring", world_size)[0], "tree": cost_terms("tree", world_size)[0],
             "gloo all_reduce": 2 * (world_size - 1)}
    return f"at {size_text(size)}, " + ", ".join(
        f"a step of {'gloo' if name.startswith('gloo') else 'our ' + name} took {time_of[name, size] / a:.0f} us "
        f"({time_of[name, size]:.0f} us over {a} steps" + (f", {time_of[name, size] / a / (alpha * 1e6):.2f} alpha)"
                                                         if alpha > 0 else ")") for name, a in steps.items())


def line_nearer_text(points: list[dict], time_of: dict, sizes: list[int]) -> str:
    """Which of the ring's and the tree's points the one fitted line passes nearer (the smaller median of
    |log(measured/model)|), and which of the two had the lower median time at more sizes: both read off the run,
    so the sentence never claims the line follows the faster one when it does not."""
    ratio = {name: [p["measured/model"] for p in points if p["algorithm"] == name] for name in FITTED}
    off = {name: float(np.median(np.abs(np.log(r)))) for name, r in ratio.items()}
    near, far = sorted(FITTED, key=lambda n: off[n])
    wins = {name: sum(time_of[name, s] < time_of[other, s] for s in sizes) for name, other in (FITTED, FITTED[::-1])}
    faster = ("the faster of the two" if wins[near] > wins[far] else "the slower of the two" if wins[near] < wins[far]
              else "neither the faster nor the slower of the two")
    return (f"the line passes nearer the {near}'s points (median {float(np.median(ratio[near])):.2f}x the line) "
            f"than the {far}'s ({float(np.median(ratio[far])):.2f}x); the {near}, {faster}, had the lower median "
            f"time at {wins[near]} of the {len(sizes)} sizes (medians only; section 2's ties compare ranges)")


def draw_times(rows: list[dict], world_size: int, args: Settings) -> None:
    """Time per all-reduce of every algorithm against size, as measured (no model)."""
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, name in enumerate(dict.fromkeys(r["algorithm"] for r in rows)):
        mine = sorted((r["size (B)"], r["time (us)"]) for r in rows if r["algorithm"] == name)
        ax.loglog(*zip(*mine), "o-", color=f"C{i}", label=name)
    ax.set(xlabel="message size (bytes)", ylabel="time per all-reduce (us), median")
    ax.legend(fontsize=8)
    ax.set_title(f"all-reduce algorithms, {world_size} ranks, gloo on CPU (measured)", fontsize=10)
    print(f"figure: {plot.save(fig, args, 'ring_vs_tree')}")


# --8<-- [start:draw_model]
def draw_alpha_beta(summary: dict, world_size: int, args: Settings) -> dict:
    """Top row, one panel per modelled algorithm: its measured points (filled: seen by the fit; hollow: held out,
    with measured/model written beside them), the model a*alpha + b*n*beta (dashed) and its two terms (dotted), and
    the sizes where the latency term is the larger (latency-bound) or the byte term (bandwidth-bound) shaded.
    Bottom, across the width: the ring's and the tree's model lines on one set of axes, their measured medians as
    dots, and the model's crossover n* (the printed one, summary["predicted_crossover_bytes"]) marked, the size
    range widened to include it. Returns what it drew."""
    plt = plot.pyplot()
    alpha, beta, points = summary["alpha_s"], summary["beta_s_per_byte"], summary["model_points"]
    names = list(dict.fromkeys(p["algorithm"] for p in points))
    fig = plt.figure(figsize=(max(4.3 * len(names), 9.0), 8.6))
    grid_spec = fig.add_gridspec(3, len(names), height_ratios=[4.0, 0.45, 3.6])
    axes = np.array([[fig.add_subplot(grid_spec[0, i]) for i in range(len(names))]])
    for ax in axes[0, 1:]:
        ax.sharey(axes[0, 0])
        ax.tick_params(labelleft=False)
    lo, hi = min(p["size (B)"] for p in points), max(p["size (B)"] for p in points)
    grid = np.geomspace(lo, hi, 64)
    panels, ratios = {}, []
    for ax, name in zip(axes[0], names):
        a, b = cost_terms(name, world_size)
        knee = a * alpha / (b * beta) if beta > 0 else math.inf  # latency term == byte term
        ax.axvspan(lo, min(max(knee, lo), hi), color="C1", alpha=0.15, label="latency-bound")
        if knee < hi:
            ax.axvspan(max(knee, lo), hi, color="C0", alpha=0.10, label="bandwidth-bound")
        ax.loglog(grid, 1e6 * (a * alpha + b * grid * beta), "--", color="0.2", label="model a·α + b·n·β")
        ax.loglog(grid, np.full_like(grid, 1e6 * a * alpha), ":", color="C1", lw=1.2, label="latency term a·α")
        if beta > 0:
            ax.loglog(grid, 1e6 * b * grid * beta, ":", color="C0", lw=1.2, label="byte term b·n·β")
        mine = [p for p in points if p["algorithm"] == name]
        for role, face in (("fit", "C3"), ("held out", "none")):
            pts = [p for p in mine if p["role"] == role]
            if pts:
                ax.loglog([p["size (B)"] for p in pts], [p["measured (us)"] for p in pts], "o", color="C3",
                          mfc=face, label=f"measured, {'seen by the fit' if role == 'fit' else 'held out'}")
        held = [p for p in mine if p["role"] == "held out"]
        for i, p in enumerate(held):  # away from the model line, which rises to the right: above the line, up
            above = p["measured/model"] >= 1  # and to the left; below it, down and to the right; every other
            dy = 4 + 9 * (i % 2)  # label further out, so that neighbours at the same height do not collide
            # at the panel's left or right end the label turns inwards, so that it stays inside the axes
            left = (above and p["size (B)"] > lo) or (not above and p["size (B)"] >= hi)
            ratio = p["measured/model"]  # two digits, without an exponent: x1.2, x43, x104
            text = f"×{ratio:.2g}" if ratio < 100 else f"×{ratio:.0f}"  # overlaps are moved apart at the end
            ratios.append(ax.annotate(text, (p["size (B)"], p["measured (us)"]),
                                      xytext=(-2 if left else 2, dy if above else -dy), ha="right" if left else "left",
                                      va="bottom" if above else "top", textcoords="offset points", fontsize=7,
                                      color="C3", bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none",
                                                        "alpha": 0.7}))
        ax.set_title(f"{name}: {a:g}α + {b:.3g}·nβ", fontsize=10)
        ax.set_xlabel("message size n (bytes)")
        panels[name] = {"steps": a, "bytes_factor": b, "knee_bytes": knee if math.isfinite(knee) else None,
                        "points": mine}
    axes[0, 0].set_ylabel("time per all-reduce (us)")
    shown = [p["measured (us)"] for p in points] + [p["model (us)"] for p in points]
    # the term lines may run far below: keep the points, with room above the highest for its label
    axes[0, 0].set_ylim(0.5 * min(shown), 3 * max(shown))
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_legend_handles_labels()[0]}
    legend_ax = fig.add_subplot(grid_spec[1, :])  # the top row's legend, right under it
    legend_ax.axis("off")
    legend_ax.legend(list(handles.values()), list(handles), loc="center", ncol=4, fontsize=8, frameon=False)
    crossover = draw_ring_and_tree(fig.add_subplot(grid_spec[2, :]), summary, world_size, lo, hi)
    bandwidth = f"1/β = {1 / beta / 1e9:.2f} GB/s" if beta > 0 else "β = 0"
    fig.suptitle(f"one alpha-beta model, fitted to ring and tree at {len(summary['fit_sizes'])} of "
                 f"{len(summary['fit_sizes']) + len(summary['held_out_sizes'])} sizes: α = {alpha * 1e6:.0f} us "
                 f"per step, {bandwidth} ({world_size} ranks)", fontsize=10)
    fig.tight_layout()
    _separate_labels(fig, ratios)
    print(f"figure: {plot.save(fig, args, 'alpha_beta')}")
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "fit_sizes": summary["fit_sizes"],
            "held_out_sizes": summary["held_out_sizes"], "panels": panels, "crossover": crossover}


def draw_ring_and_tree(ax, summary: dict, world_size: int, lo: float, hi: float) -> dict:
    """The ring's and the tree's model lines on one set of axes, their measured medians as dots, and the model's
    crossover n* as a vertical line (when there is one), the size range widened to include it. Returns what it
    drew: n* and the size range."""
    alpha, beta, cross = summary["alpha_s"], summary["beta_s_per_byte"], summary["predicted_crossover_bytes"]
    left, right = min(lo, cross / 4) if cross else lo, max(hi, cross * 4) if cross else hi
    left, right = left / 1.4, right * 1.4  # a margin, so that the end points are not cut in half
    sizes = np.geomspace(left, right, 128)
    for name, color, style in (("ring", "C0", "-"), ("tree", "C2", "--")):  # dashed: visible where they coincide
        a, b = cost_terms(name, world_size)
        ax.loglog(sizes, 1e6 * (a * alpha + b * sizes * beta), style, color=color, lw=1.8,
                  label=f"{name} model {a:g}α + {b:.3g}·nβ")
        mine = sorted((p["size (B)"], p["measured (us)"]) for p in summary["model_points"] if p["algorithm"] == name)
        ax.loglog(*zip(*mine), "o", color=color, ms=5, alpha=0.7, label=f"{name} measured (median)")
    if cross:
        a, b = cost_terms("ring", world_size)
        ax.axvline(cross, color="0.2", ls=":", lw=1.4, label=f"model crossover n* = {size_text(cross)}")
        ax.plot([cross], [1e6 * (a * alpha + b * cross * beta)], "o", color="0.2", ms=7, mfc="white")
    ax.set_title("ring and tree models on one set of axes: tree faster left of n*, ring right of it" if cross else
                 "ring and tree models on one set of axes: no crossover in the model", fontsize=10)
    ax.set(xlabel="message size n (bytes)", ylabel="time per all-reduce (us)", xlim=(left, right))
    ax.legend(fontsize=8, loc="best")
    return {"n_star_bytes": cross, "size_range": [float(left), float(right)]}
# --8<-- [end:draw_model]


def _separate_labels(fig, labels: list) -> None:
    """Move each label that would overlap an earlier one of its panel further out (away from its point), in steps."""
    renderer = fig.canvas.get_renderer()
    placed: dict = {}
    for label in labels:
        earlier = placed.setdefault(label.axes, [])
        dx, dy = label.xyann
        for _ in range(4):  # 10 points further out per try; after that, it stays where the last try put it
            box = label.get_window_extent(renderer).expanded(1.05, 1.2)
            if not any(box.overlaps(e) for e in earlier):
                break
            dy += 10 if dy > 0 else -10
            label.xyann = (dx, dy)
        earlier.append(label.get_window_extent(renderer).expanded(1.05, 1.2))


def draw_ceiling(rows: list[dict], ceiling: dict, world_size: int, args: Settings) -> dict:
    """busbw of every algorithm against size, under the box's two ceilings. Returns the lines it drew."""
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    lines = {}
    for i, name in enumerate(dict.fromkeys(r["algorithm"] for r in rows)):
        mine = sorted((r["size (B)"], r["busbw (GB/s)"]) for r in rows if r["algorithm"] == name)
        ax.loglog(*zip(*mine), "o-", color=f"C{i}", label=name)
        lines[name] = {"size (B)": [s for s, _ in mine], "busbw (GB/s)": [b for _, b in mine]}
    ax.axhline(ceiling["memcpy_GBps"], color="0.2", ls="--", label=f"memcpy {ceiling['memcpy_GBps']:.2f} GB/s")
    ax.axhline(ceiling["loopback_tcp_GBps"], color="0.4", ls=":",
               label=f"loopback TCP {ceiling['loopback_tcp_GBps']:.2f} GB/s")
    ax.set(xlabel="message size (bytes)", ylabel="busbw (GB/s): algbw × 2(p-1)/p for every algorithm")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"busbw under the ceilings of this box, {world_size} ranks", fontsize=10)
    print(f"figure: {plot.save(fig, args, 'ceiling')}")
    return {"lines": lines, **ceiling}


def size_text(num_bytes: float) -> str:
    """256 B, 64.0 KiB, 8.0 MiB: the unit that keeps the number readable."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def fit_vs_ceilings(fit_GBps: float | None, ceiling: dict, best_busbw_GBps: float) -> str:
    """The fitted 1/beta held against the two measured ceilings and the best busbw the run reached."""
    if not fit_GBps:
        return "no per-byte cost was fitted, so there is no bandwidth to compare"
    side = lambda limit: "above" if fit_GBps > limit else "below"
    return (f"{fit_GBps:.2f} GB/s is {side(ceiling['loopback_tcp_GBps'])} the loopback TCP ceiling "
            f"({ceiling['loopback_tcp_GBps']:.2f} GB/s), {side(ceiling['memcpy_GBps'])} the memcpy one "
            f"({ceiling['memcpy_GBps']:.2f} GB/s), and {fit_GBps / best_busbw_GBps:.1f}x the best busbw any "
            f"algorithm reached at the largest size ({best_busbw_GBps:.3f} GB/s)")


def alpha_pinned_note(summary: dict) -> str | None:
    """The `note:` line for a fit that pinned alpha at 0 (the unconstrained least-squares alpha was negative, so
    fit_alpha_beta kept beta alone): the model then gives a small size little more than its few bytes' time, and
    measured/model there runs into the hundreds or thousands. None for a fit with a positive alpha."""
    if summary["alpha_s"] > 0 or not summary["beta_s_per_byte"]:
        return None
    return ("note: the fit pinned alpha at 0 us per step (the best least-squares alpha was negative): the small "
            "sizes' fixed cost could not be separated from the noise and the size term, so the model gives a small "
            "size only its bytes' time, and the measured/model factors at the small sizes are meaningless (only "
            "the large sizes test the model). This happens under load or with 2 ranks; rerun on a quieter machine")


def beta_pinned_note(summary: dict) -> str | None:
    """The `note:` line for a fit that pinned beta at 0 (fit_alpha_beta kept alpha alone): the model then charges
    the bytes nothing, so every size gets the same model time, and there is no 1/beta to hold against
    the ceilings. None for a fit with a positive beta."""
    if summary["beta_s_per_byte"] > 0 or not summary["alpha_s"]:
        return None
    return ("note: the fit pinned beta at 0 ns per byte (no per-byte cost): the model gives every size the same "
            "time, its steps times alpha, so the measured/model factors only show how the measured times vary with "
            "the size, and section 4 has no fitted bandwidth to compare. This happens under load or with 2 ranks; "
            "rerun on a quieter machine")


def ring_vs_gloo(ratio: float, largest: str) -> tuple[str, str]:
    """(the ratio as printed, its label): the label is read off the printed three digits, so "0.995" says
    below 1 and a ratio that prints as 1.000 says about 1, never a direction the printed number does not show."""
    shown = f"{ratio:.3f}"
    label = (f"above 1: our Python ring finished faster than gloo's own all-reduce at {largest}" if float(shown) > 1
             else f"below 1: gloo's own all-reduce finished faster than our Python ring at {largest}"
             if float(shown) < 1 else f"about 1: the two took the same time to three digits at {largest}")
    return shown, label


def print_model(summary: dict, w: int) -> None:
    """Section 3 of the output: the fit, measured/model at every size, and the model's crossover."""
    fit, held = summary["fit_sizes"], summary["held_out_sizes"]
    print(f"\n3. alpha-beta model: one (alpha, beta) fitted to the ring's and the tree's times at "
          f"{', '.join(map(size_text, fit))}; held out: " + (", ".join(map(size_text, held)) or "no size")
          + (" and every halving-doubling point" if any(p["algorithm"] == "halving-doubling"
                                                          for p in summary["model_points"]) else ""))
    print(f"fit: alpha = {summary['alpha_s'] * 1e6:.1f} us per step, beta = {summary['beta_s_per_byte'] * 1e9:.3f} "
          "ns per byte " + (f"(1/beta = {summary['fit_bandwidth_GBps']:.2f} GB/s)" if summary["fit_bandwidth_GBps"]
                            else "(no per-byte cost: the fit put all of every time into alpha)"))
    print(f"time per step, measured: {summary['step_cost_text']}")
    ratio = {(p["algorithm"], p["size (B)"]): p["measured/model"] for p in summary["model_points"]}
    names = list(dict.fromkeys(p["algorithm"] for p in summary["model_points"]))
    print(report.table([{"size (B)": s, "ring, tree points": "fit" if s in fit else "held out",
                         **{f"{n} measured/model": ratio[n, s] for n in names}} for s in sorted(fit + held)],
                       floatfmt=".2f"))
    if summary["held_out_points"]:
        print(f"held out: {summary['held_out_points']} points, measured/model off by a factor of "
              f"{summary['held_out_median_factor']:.2f} (median) and {summary['held_out_worst_factor']:.2f} at worst;"
              f" {summary['held_out_off_by_2x']} of them more than 2x off (on the fitted points themselves: "
              f"{summary['fit_worst_factor']:.2f} at worst)")
    for note in (alpha_pinned_note(summary), beta_pinned_note(summary)):
        if note:
            print(note)
    print("median measured/model over every size: " + ", ".join(f"{n} {summary[f'{n}_median_ratio']:.2f}"
                                                                  for n in names))
    (a_ring, _), (a_tree, _) = cost_terms("ring", w), cost_terms("tree", w)
    cross = summary["predicted_crossover_bytes"]
    print("the model's ring-vs-tree crossover: " + (
        f"{size_text(cross)} (tree faster below, ring above); measured: {summary['measured_text']}" if cross else
        f"none: with {w} ranks the ring takes {a_ring} steps, the tree {a_tree}, and the ring moves fewer bytes, so "
        "in the model (not necessarily in the measurement) the ring is never slower" if a_ring <= a_tree else
        "none: the fit pinned alpha at 0 (see the note above), so in the model the ring, with fewer bytes, is faster "
        "at every size" if summary["alpha_s"] <= 0 else
        "none: the fit found no per-byte cost (beta = 0), so the model has the ring slower at every size"))
    line = more_ranks_line(summary, w, os.cpu_count())
    if line:
        print(line)
    print(f"the one line against the two algorithms: {summary['line_nearer_text']}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "max_bytes": 64 * 2**10, "max_iters": 3,
                                               "rounds": 1}, world_sizes=lambda w: w >= 2,
                     world_sizes_text=">= 2 (one rank has nothing to reduce)")
    if not is_power_of_two(args.world_size):
        print(f"note: halving-doubling needs a power-of-two world size; skipped for {args.world_size} ranks")
    result = launch(worker, args)
    if result is None:
        return 0
    rows, w = result["rows"], args.world_size
    print(f"1. correctness vs dist.all_reduce (max abs error over {args.check_numel} elements): "
          + ", ".join(f"{k} {v:.1e}" for k, v in result["max_abs_error"].items()))
    names = list(dict.fromkeys(r["algorithm"] for r in rows))
    time_of = {(r["algorithm"], r["size (B)"]): r["time (us)"] for r in rows}
    summary = summarise(rows, w)
    spread = {(r["algorithm"], r["size (B)"]): (f"{min(r['rounds (us)']):.0f}-{max(r['rounds (us)']):.0f}"
                                                if r.get("rounds (us)") else "-") for r in rows}
    print(f"\n2. time per all-reduce (us), the median of {args.rounds} round(s), the algorithms taking turns; "
          f"{load_average()}\n   ring / tree range: fastest-slowest round; ring vs tree: the faster median, or tie "
          "where the two ranges overlap")
    print(report.table([{"size (B)": s, **{n: time_of[n, s] for n in names},
                         "fastest": min(names, key=lambda n: time_of[n, s]),
                         "ring range": spread["ring", s], "tree range": spread["tree", s],
                         "ring vs tree": ("tie" if s in summary["tied_sizes"] else
                                          "ring" if time_of["ring", s] < time_of["tree", s] else "tree")}
                        for s in sorted({r["size (B)"] for r in rows})], floatfmt=".0f"))
    print(f"measured, ring against tree (a tie where the two's ranges over the {args.rounds} round(s) overlap): "
          f"{summary['measured_text']}")
    shown, summary["ring_vs_gloo_text"] = ring_vs_gloo(summary["ring_over_gloo_busbw"],
                                                       size_text(summary["largest_size"]))
    print(f"ring busbw / gloo all_reduce busbw at {size_text(summary['largest_size'])}: {shown} "
          f"({summary['ring_vs_gloo_text']})")
    print_model(summary, w)
    ceiling = {"memcpy_GBps": memcpy_bandwidth() / 1e9, "loopback_tcp_GBps": loopback_tcp_bandwidth() / 1e9}
    best = max((r for r in rows if r["size (B)"] == summary["largest_size"]), key=lambda r: r["busbw (GB/s)"])
    summary.update(ceiling, best_busbw_GBps=best["busbw (GB/s)"], best_busbw_algorithm=best["algorithm"],
                   fraction_of_tcp=best["busbw (GB/s)"] / ceiling["loopback_tcp_GBps"],
                   fraction_of_memcpy=best["busbw (GB/s)"] / ceiling["memcpy_GBps"])
    summary["fit_bandwidth_text"] = (f"{summary['fit_bandwidth_GBps']:.2f} GB/s" if summary["fit_bandwidth_GBps"]
                                     else "unbounded: the fit found no per-byte cost")
    print(f"\n4. ceiling: memcpy {ceiling['memcpy_GBps']:.2f} GB/s, loopback TCP {ceiling['loopback_tcp_GBps']:.2f} "
          f"GB/s; best busbw at {size_text(summary['largest_size'])} = {best['busbw (GB/s)']:.3f} GB/s "
          f"({best['algorithm']}) = {summary['fraction_of_tcp']:.1%} of TCP, {summary['fraction_of_memcpy']:.1%} "
          "of memcpy")
    summary["fit_vs_ceilings_text"] = fit_vs_ceilings(summary["fit_bandwidth_GBps"], ceiling, best["busbw (GB/s)"])
    print(f"fitted 1/beta against them: {summary['fit_vs_ceilings_text']}")
    if summary["fit_bandwidth_GBps"] and summary["fit_bandwidth_GBps"] > ceiling["memcpy_GBps"]:
        print(f"note: the fitted 1/beta ({summary['fit_bandwidth_GBps']:.2f} GB/s) is above the memcpy ceiling; "
              "nothing on this box moves bytes faster than a memory copy, so the fit's beta is not a speed here")
    draw_times(rows, w, args)
    figures = {"alpha_beta": draw_alpha_beta(summary, w, args), "ceiling": draw_ceiling(rows, ceiling, w, args)}
    steps = draw_steps(w, args)  # the tree's and halving-doubling's messages, step by step
    if args.json:
        report.write_json(args.json, {"world_size": w, "rows": rows, "max_abs_error": result["max_abs_error"],
                                      "check_numel": args.check_numel, "check_output_rank0": result["check_output"],
                                      "steps_numel": 16 * w, "steps": steps, "figures": figures, **summary}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
