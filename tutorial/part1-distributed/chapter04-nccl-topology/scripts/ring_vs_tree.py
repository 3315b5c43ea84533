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
      2. the median time per all-reduce of every algorithm and gloo's own at each size (after a warm-up pass;
         each round times every size, and the algorithms take turns at each, so a burst of load hits all of
         them) and the fastest of them all, gloo's included; which of ring and tree was faster where (a tie
         where their ranges over the rounds overlap: no winner is claimed there; the table prints both ranges
         and the verdict per size), ring busbw over gloo's;
      3. an alpha-beta model time = steps*alpha + bytes*beta: ONE (alpha, beta) >= 0 fitted by least squares,
         each point weighted by 1/time (the relative error (model/time - 1)^2: a point above the line costs at
         most 1, one below it without limit), to the ring's and the tree's times at every other size from the
         smallest, plus the largest, then compared with the points it did not see (the sizes in between, and every
         halving-doubling point): measured/model per size, the median and worst factor on the held-out points, the
         model's ring-vs-tree crossover beside the measured one, the model's crossover at those of 8, 64 and 512
         ranks above the run's own, with the same alpha and beta (a prediction: ranks started on one box share its
         cores and memory, so no run here times that many real links), and which algorithm's points the line passes
         nearer; a `note:` line when the fit pins alpha at 0 (then the factors at the small sizes are meaningless)
         or beta at 0 (then no size costs more than another), or is clearly wrong (held-out points off by more
         than 5x in the median, or alpha below a quarter of every measured time per step);
      4. the box's ceilings (memcpy bandwidth of a large torch copy, loopback TCP through a socket) and the best
         busbw at the largest size as a fraction of each.
    Figures: steps.png (every message of the ring, the tree and halving-doubling, step by step, from the schedules
    the three all-reduces follow; kept in the JSON as "steps", counted in "schedule_table"), waits.png (step 0 of
    the ring beside step 0 of the tree: what each rank posts and waits for; "waits" in the JSON), ring_vs_tree.png
    (the measured medians, a bar from each one's fastest to its slowest round), alpha_beta.png (the model against
    the points, fitted and held out, with its latency- and bandwidth-bound ranges shaded), crossover.png (the ring's
    and the tree's model lines on one set of axes with the crossover n* marked) and ceiling.png (busbw under the two
    ceilings); ring_vs_tree, alpha_beta (with crossover) and ceiling are kept in the JSON under "figures", and the
    text of sections 1-2, 3 and 4 under "printed" (the lesson shows each section beside its explanation).
    On one box, the ring's per-link advantage cannot show: summed over all ranks, the ring and the tree copy the
    same 2(p-1) n bytes, and here every "link" shares the same CPUs and memory.
    This file runs the ranks and prints; the schedules, the model and the sentences printed from the times are in
    _rvt_model.py beside it, the figures in _rvt_draw.py.

How to run (any world size >= 2: one rank has nothing to reduce; halving-doubling needs a power of two)
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py -w 8 --max-bytes 2097152
    torchrun --nproc-per-node 4 tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py

Contract flags: --smoke uses 2 ranks and sizes up to 64 KiB; --seed sets the random data of the correctness check.

Runtime on 2 cores: about 20-60 s (4 ranks, 256 B .. 8 MiB; 37 to 56 s at a load near 9.5), longer under heavier load;
--smoke about 10 s.

Try next
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py -w 2
        -> two ranks: equal steps, so no model crossover; the `time per step` line ends with a ring step over a
           tree step (the model would say 1; the ring's step has twice the messages). Under load a 2-rank fit
           can change several-fold between reruns; a `note:` line says when not to trust it
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py -w 8 --max-bytes 2097152
        -> eight ranks on two cores: more steps, more scheduler noise at small sizes; about a minute on 2 cores
           at a load near 2, up to about L/C times that at a load L on C cores (section 2 prints the load).
           Its sweep has an even number of sizes, so the fit takes both of the two largest (1 and 2 MiB)
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py -w 3
        -> halving-doubling is skipped with a message: it needs a power of two
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from _rvt_draw import draw_alpha_beta, draw_ceiling, draw_steps, draw_times, draw_waits
from _rvt_model import fit_vs_ceilings, print_model, ring_vs_gloo, schedule_table, size_text, summarise

from mlsys import cli, report
from mlsys.bench import busbw, load_average, loopback_tcp_bandwidth, memcpy_bandwidth, steady_timing, time_collective
from mlsys.collectives import (
    halving_doubling_all_reduce,
    is_power_of_two,
    ring_all_reduce,
    tree_all_reduce,
)
from mlsys.launch import RankContext, launch

ELEMENT_BYTES = 4  # float32


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
    """Checked once, warmed up (every algorithm once at every size), then timed in rounds: each round times every
    size once, smallest to largest, and the algorithms take turns at each size. A slow spell of the machine (load
    from elsewhere, or the ranks' own start) then lands on one round of many sizes, not on every round of the
    first sizes, and each size keeps its median round."""
    algos = algorithms(ctx.world_size)
    errors, outputs = check_against_gloo(ctx, args)
    bufs = [torch.zeros(size // ELEMENT_BYTES) for size in sweep_sizes(args)]  # zeros: in-place sums stay finite
    times = [{name: [] for name in algos} for _ in bufs]
    with steady_timing():  # one garbage collection for the whole sweep, not one per timed loop (each rank's costs
        for buf in bufs:  # a tenth of a second, and the barrier waits for the slowest rank's)
            for fn in algos.values():
                fn(buf)  # the warm-up pass, untimed
        for _ in range(args.rounds):
            for buf, rounds in zip(bufs, times):
                iters = max(2, min(args.max_iters, (16 * 2**20) // (buf.numel() * ELEMENT_BYTES)))
                for name, fn in algos.items():  # take turns, so a burst of load hits every algorithm
                    rounds[name].append(time_collective(lambda: fn(buf), warmup=1, iters=iters,  # noqa: B023
                                                        device=ctx.device))
    rows = []
    for buf, rounds in zip(bufs, times):
        size = buf.numel() * ELEMENT_BYTES
        for name, per_round in rounds.items():
            seconds = float(np.median(per_round))
            rows.append({"size (B)": size, "algorithm": name, "time (us)": seconds * 1e6,
                         "busbw (GB/s)": busbw("all_reduce", size, seconds, ctx.world_size),
                         "rounds (us)": [t * 1e6 for t in per_round]})
    return {"rows": rows, "max_abs_error": errors, "check_output": outputs}


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "max_bytes": 64 * 2**10, "max_iters": 3,
                                               "rounds": 1}, world_sizes=lambda w: w >= 2,
                     world_sizes_text=">= 2 (one rank has nothing to reduce)")
    # the output by section (1-2, 3, 4), kept in the JSON: the lesson shows each beside its explanation
    printed = {"measured": [], "model": [], "ceiling": []}
    out12, out4 = (lambda text, k=k: (print(text), printed[k].append(text)) for k in ("measured", "ceiling"))
    if not is_power_of_two(args.world_size):
        out12(f"note: halving-doubling needs a power-of-two world size; skipped for {args.world_size} ranks")
    result = launch(worker, args)
    if result is None:
        return 0
    rows, w = result["rows"], args.world_size
    out12(f"1. correctness vs dist.all_reduce (max abs error over {args.check_numel} elements): "
          + ", ".join(f"{k} {v:.1e}" for k, v in result["max_abs_error"].items()))
    names = list(dict.fromkeys(r["algorithm"] for r in rows))
    time_of = {(r["algorithm"], r["size (B)"]): r["time (us)"] for r in rows}
    summary = summarise(rows, w)
    spread = {(r["algorithm"], r["size (B)"]): (f"{min(r['rounds (us)']):.0f}-{max(r['rounds (us)']):.0f}"
                                                if r.get("rounds (us)") else "-") for r in rows}
    out12(f"\n2. time per all-reduce (us), the median of {args.rounds} round(s), the algorithms taking turns; "
          f"{load_average()}\n   ring / tree range: fastest-slowest round; ring vs tree: the faster median, or tie "
          "where the two ranges overlap")
    out12(report.table([{"size (B)": s, **{n: time_of[n, s] for n in names},
                         "fastest": min(names, key=lambda n: time_of[n, s]),
                         "ring range": spread["ring", s], "tree range": spread["tree", s],
                         "ring vs tree": ("tie" if s in summary["tied_sizes"] else
                                          "ring" if time_of["ring", s] < time_of["tree", s] else "tree")}
                        for s in sorted({r["size (B)"] for r in rows})], floatfmt=".0f"))
    out12(f"measured, ring against tree (a tie where the two's ranges over the {args.rounds} round(s) overlap): "
          f"{summary['measured_text']}")
    shown, summary["ring_vs_gloo_text"] = ring_vs_gloo(summary["ring_over_gloo_busbw"],
                                                       size_text(summary["largest_size"]))
    out12(f"ring busbw / gloo all_reduce busbw at {size_text(summary['largest_size'])}: {shown} "
          f"({summary['ring_vs_gloo_text']})")
    printed["model"].append(print_model(summary, w))
    ceiling = {"memcpy_GBps": memcpy_bandwidth() / 1e9, "loopback_tcp_GBps": loopback_tcp_bandwidth() / 1e9}
    best = max((r for r in rows if r["size (B)"] == summary["largest_size"]), key=lambda r: r["busbw (GB/s)"])
    summary.update(ceiling, best_busbw_GBps=best["busbw (GB/s)"], best_busbw_algorithm=best["algorithm"],
                   fraction_of_tcp=best["busbw (GB/s)"] / ceiling["loopback_tcp_GBps"],
                   fraction_of_memcpy=best["busbw (GB/s)"] / ceiling["memcpy_GBps"])
    summary["fit_bandwidth_text"] = (f"{summary['fit_bandwidth_GBps']:.2f} GB/s" if summary["fit_bandwidth_GBps"]
                                     else "unbounded: the fit found no per-byte cost")
    out4(f"\n4. ceiling: memcpy {ceiling['memcpy_GBps']:.2f} GB/s, loopback TCP {ceiling['loopback_tcp_GBps']:.2f} "
          f"GB/s; best busbw at {size_text(summary['largest_size'])} = {best['busbw (GB/s)']:.3f} GB/s "
          f"({best['algorithm']}) = {summary['fraction_of_tcp']:.1%} of TCP, {summary['fraction_of_memcpy']:.1%} "
          "of memcpy")
    summary["fit_vs_ceilings_text"] = fit_vs_ceilings(summary["fit_bandwidth_GBps"], ceiling, best["busbw (GB/s)"])
    out4(f"fitted 1/beta against them: {summary['fit_vs_ceilings_text']}")
    if summary["fit_bandwidth_GBps"] and summary["fit_bandwidth_GBps"] > ceiling["memcpy_GBps"]:
        out4(f"note: the fitted 1/beta ({summary['fit_bandwidth_GBps']:.2f} GB/s) is above the memcpy ceiling; "
              "nothing on this box moves bytes faster than a memory copy, so the fit's beta is not a speed here")
    figures = {"times": draw_times(rows, w, args), "alpha_beta": draw_alpha_beta(summary, w, args),
               "ceiling": draw_ceiling(rows, ceiling, w, args)}
    steps = draw_steps(w, args)  # the ring's, the tree's and halving-doubling's messages, step by step
    waits = draw_waits(w, args)  # one ring step beside one tree step: what each rank waits for
    if args.json:
        report.write_json(args.json, {"world_size": w, "rows": rows, "max_abs_error": result["max_abs_error"],
                                      "check_numel": args.check_numel, "check_output_rank0": result["check_output"],
                                      "steps_numel": 16 * w, "steps": steps, "waits": waits, "figures": figures,
                                      "schedule_table": schedule_table(steps, w, 16 * w),
                                      **summary,
                                      "printed": {k: "\n".join(v).strip("\n") for k, v in printed.items()}}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
