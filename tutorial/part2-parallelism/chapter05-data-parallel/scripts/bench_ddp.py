"""Step time of the hand-written DDP versions against torch's DistributedDataParallel, as the bucket size changes.

What it shows
    One data-parallel training step (forward, backward, gradient averaging, SGD update) of a GPT big enough that
    its gradients take a while to all-reduce (default 4 layers x 256 wide: 3.2M parameters, 12 MiB of float32
    gradients), timed for:
        local        no communication at all (each rank steps on its own: the floor)
        naive        one all-reduce per parameter, after backward                      (mlsys.ddp.NaiveDDP)
        bucketed     one all-reduce per bucket, after backward, per --bucket-mb         (mlsys.ddp.BucketedDDP)
        overlapped   buckets all-reduced from gradient hooks during backward, per size  (mlsys.ddp.OverlappedDDP)
        torch        torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=size)
    All versions live in the same job and are measured side by side: each repeat runs every version in turn (a
    barrier before each), so a noisy neighbour slows them all alike. A version's time is the slowest rank's, and
    the table reports the median over --repeats, with the garbage collector frozen and the load average printed.
    A version whose median comes out below 'local' (no communication at all) is flagged: no version can really
    beat its own floor, so the gap is noise, and that row is left out of the headline. The headline, the line
    starting "each at its fastest bucket size", is overlapped / torch, each at the bucket size where its median
    was lowest, ignoring the sizes whose median fell below local's (the book's target: at most 1.25 times, the
    constant GOAL, reported as goal_met in --json), or, when every row of overlapped or of torch fell below local,
    names which one and says there is no ratio; it is reported, not enforced, because timings on a shared CPU are noisy.
    The line under the table gives naive against local, and whether every other row's median was below naive's.
    The line starting "take-away" gives naive's cost over local and what the fastest other row (not below local's
    median; said to lie inside or above local's band) saved against naive, each only where it is larger than local's
    own spread (an overlapped row with a single bucket is named as such: nothing overlapped there).
    The line starting "one bucket" compares overlapped with bucketed at the largest size that holds the gradients in
    one bucket, where both do the same work: a gap within local's own spread is called noise.
    The line starting "what this run shows" names the versions whose median lies above local's slowest round (a
    cost that noise alone did not give), or says that none does and the run measured only the machine's noise.
    The buckets column counts the hand-written versions' buckets: at a size larger than all the gradients there is
    one, filled only by the last gradient of the backward, so overlapped has nothing to overlap there. A sentence
    says at which sizes overlapped's step was shorter or longer than bucketed's, and which gaps are wider than the
    spread of local's own rounds. The line
    "overlapped / torch at the same bucket size" divides the two medians at each size; it is no steadier than the
    medians it divides.
    Writes bench_ddp.png (step time against bucket size, local's min-to-max range shaded) to --plot-dir and
    everything to --json.

How to run (2 to 8 ranks)
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/bench_ddp.py -w 2
    torchrun --nproc-per-node 2 tutorial/part2-parallelism/chapter05-data-parallel/scripts/bench_ddp.py
    ... --n-embd 512 --bucket-mb 1 4 16 64     # a 4x bigger model, other bucket sizes

On gloo the all-reduce runs on the same CPU cores as the backward pass, so overlap gains less than on GPUs,
where NCCL runs on its own stream. Runtime on 2 cores: about 20 s at -w 2 on idle cores, two to five times that on a
busy machine (40 s at a load average of 8), 4 s with --smoke.

Try next
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/bench_ddp.py --bucket-mb 0.01 0.1 1 10
        -> very small buckets pay the per-call latency many times: bucketed moves toward naive; overlapped can
           hide part of it behind the backward
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/bench_ddp.py --n-embd 512 --repeats 5
        -> a 4x bigger model: communication is a larger share of the step, and the versions spread apart
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/bench_ddp.py -w 4
        -> four ranks on two cores: the ranks compete for the CPU; compare each version with local in the same
           run, not with the 2-rank run's milliseconds
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.bench import load_average, steady_timing
from mlsys.collectives import comm_volume
from mlsys.ddp import wrap
from mlsys.launch import RankContext, launch
from mlsys.model import GPT, GPTConfig, num_params

GOAL = 1.25  # overlapped hand-written DDP within 25% of torch's DDP
WARMUP = 2  # untimed steps per version (torch's DDP rebuilds its buckets after its first step)


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    n_layer: int = 4
    """Transformer blocks of the benchmarked GPT."""
    n_embd: int = 256
    """Width of the benchmarked GPT (4 heads); parameters grow as n_layer x 12 x n_embd^2."""
    batch_size: int = 2
    """Sequences of 64 tokens per rank per step."""
    bucket_mb: list[float] = field(default_factory=lambda: [0.25, 2.0, 16.0])
    """Bucket sizes in MiB to measure (bucketed, overlapped and torch's bucket_cap_mb)."""
    repeats: int = 7
    """Timed rounds over all versions; each version's median over the rounds is reported."""
    steps: int = 1
    """Training steps per version per round (the time is their mean)."""

    def validate(self) -> None:
        if self.n_layer < 1 or self.n_embd < 4 or self.n_embd % 4:
            raise cli.UsageError(f"--n-embd must be a positive multiple of 4 and --n-layer >= 1, got "
                                 f"{self.n_embd}, {self.n_layer}")
        if self.batch_size < 1 or self.repeats < 1 or self.steps < 1:
            raise cli.UsageError("--batch-size, --repeats and --steps must be at least 1")
        if not self.bucket_mb or min(self.bucket_mb) <= 0:
            raise cli.UsageError(f"--bucket-mb needs positive sizes, got {self.bucket_mb}")


def build(base: GPT, kind: str, bucket_mb: float) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    """A copy of `base` (the same init on every rank), wrapped in one DDP version, with its own plain SGD."""
    model = copy.deepcopy(base)
    wrapped = model if kind == "local" else wrap(kind, model, bucket_mb)
    return model, wrapped, torch.optim.SGD(model.parameters(), lr=1e-4)


def train_steps(model, wrapped, opt, x, y, steps: int) -> float:
    """Seconds per step on the SLOWEST rank, for `steps` steps started together after a barrier."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        _, loss = wrapped(x, y)
        loss.backward()  # overlapped and torch: all-reduces start in here
        if wrapped is not model:
            wrapped.finish_gradient_synchronization()  # wait for (or run) the all-reduces
        opt.step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is done when the last rank is done
    return elapsed.item() / steps


def versions(args: Settings) -> list[tuple[str, float]]:
    sizes = sorted(set(args.bucket_mb))
    return [("local", 0.0), ("naive", 0.0)] + [(k, mb) for k in ("bucketed", "overlapped", "torch") for mb in sizes]


def worker(ctx: RankContext, args: Settings) -> dict:
    torch.manual_seed(args.seed)
    base = GPT(GPTConfig.preset("small", n_layer=args.n_layer, n_embd=args.n_embd, block_size=64))
    built = {v: build(base, *v) for v in versions(args)}
    model = built[("local", 0.0)][0]
    grad_bytes = num_params(model) * 4
    gen = torch.Generator().manual_seed(args.seed + ctx.rank)  # each rank its own batch
    x = torch.randint(0, model.config.vocab_size, (args.batch_size, 64), generator=gen)  # (B, T)
    y = torch.randint(0, model.config.vocab_size, (args.batch_size, 64), generator=gen)  # (B, T)
    ctx.print(f"GPT {args.n_layer} layers x {args.n_embd}: {num_params(model):,} parameters, "
              f"{grad_bytes / 2**20:.1f} MiB of gradients; {len(built)} versions x {args.repeats} rounds "
              f"on {ctx.world_size} ranks ({ctx.backend})")
    for v, (m, w, opt) in built.items():  # warm-up: torch's DDP also rebuilds its buckets on its first steps  # noqa: B007
        train_steps(m, w, opt, x, y, WARMUP)
    times: dict[tuple[str, float], list[float]] = {v: [] for v in built}
    order = list(built)
    with steady_timing():  # no garbage-collector pause inside a timed step
        for r in range(args.repeats):  # interleaved: round r runs every version once, from a rotating start
            for v in order[r % len(order):] + order[:r % len(order)]:
                m, w, opt = built[v]
                times[v].append(train_steps(m, w, opt, x, y, args.steps))
    med = {v: statistics.median(t) for v, t in times.items()}

    rows = [{"version": k, "bucket MiB": "" if k in ("local", "naive") else f"{mb:g}",
             "buckets": len(getattr(built[(k, mb)][1], "buckets", [])) or "",
             "allreduce/step": _calls(built[(k, mb)][1], args), "step ms": 1e3 * med[(k, mb)],
             "x local": med[(k, mb)] / med[("local", 0.0)]} for k, mb in built]
    ctx.print(report.table(rows, ".3g"))

    floor = med[("local", 0.0)]
    below_floor = [(k, mb) for (k, mb), t in med.items() if k != "local" and t < floor]
    trusted = [v for v in med if v not in below_floor]  # a row below the floor measured noise, not its cost
    best = {k: min((mb for kk, mb in trusted if kk == k), key=lambda mb: med[(k, mb)], default=None)
            for k in ("bucketed", "overlapped", "torch")}
    ratio = (med[("overlapped", best["overlapped"])] / med[("torch", best["torch"])]
             if best["overlapped"] is not None and best["torch"] is not None else None)
    per_size = {f"{mb:g}": med[("overlapped", mb)] / med[("torch", mb)] for mb in sorted(set(args.bucket_mb))}
    volume = comm_volume("all_reduce", grad_bytes, ctx.world_size)["sent"]
    naive_text = _naive_vs_rest(med)
    ctx.print(f"\n{naive_text}")
    ctx.print(f"each rank sends 2(W-1)/W x {grad_bytes / 2**20:.1f} MiB = {volume / 2**20:.1f} MiB per step")
    ctx.print("overlapped / torch at the same bucket size: " + ", ".join(f"{k} MiB {v:.2f}x" for k, v in
                                                                         per_size.items()))
    below_text = ", ".join(f"{k} at {mb:g} MiB" if k != "naive" else k for k, mb in below_floor)
    if below_floor:
        ctx.print(f"note: {below_text} came out below 'local' (no communication), which no version can "
                  "really beat: the difference is noise between rounds, not a gain; left out of the headline")
    headline = _headline(med, best, floor)
    load = load_average()  # read once: the printed line and the JSON must show the same value
    ctx.print(f"each at its fastest bucket size, ignoring sizes whose median fell below local's (noise): "
              f"{headline}  ({load})")
    local_ms = [1e3 * t for t in times[("local", 0.0)]]
    ctx.print(f"local's own {len(local_ms)} rounds ranged from {min(local_ms):.1f} to {max(local_ms):.1f} ms: "
              "the spread that noise alone gives a row here")
    # the rows this run separates from local: a median above local's slowest round is a cost noise alone did not give
    above, above_rows, above_text = _above_noise(med, max(local_ms))
    verdict = _verdict(med, min(local_ms), max(local_ms))
    ctx.print(f"what this run shows: {verdict}")
    vs_bucketed = _overlapped_vs_bucketed(med, sorted(set(args.bucket_mb)), max(local_ms) - min(local_ms))
    ctx.print(vs_bucketed)
    takeaway = _takeaway(med, min(local_ms), max(local_ms),
                         {mb: len(built[("overlapped", mb)][1].buckets) for mb in sorted(set(args.bucket_mb))})
    ctx.print(f"take-away: {takeaway}")
    one_bucket = _one_bucket(med, {mb: len(built[("overlapped", mb)][1].buckets) for mb in sorted(set(args.bucket_mb))},
                             max(local_ms) - min(local_ms))
    ctx.print(f"one bucket: {one_bucket}")
    if ctx.is_main:
        draw(args, med, local_ms)
    return {"num_params": num_params(model), "grad_bytes": grad_bytes, "rows": rows,
            "step_ms": {f"{k}@{mb:g}": 1e3 * t for (k, mb), t in med.items()},
            "samples_ms": {f"{k}@{mb:g}": [1e3 * s for s in t] for (k, mb), t in times.items()},
            "best_bucket_mb": best, "overlapped_over_torch": ratio, "overlapped_over_torch_per_size": per_size,
            "goal": GOAL, "goal_met": ratio is not None and ratio <= GOAL, "allreduce_sent_bytes_per_rank": volume,
            "below_floor": [f"{k}@{mb:g}" for k, mb in below_floor], "load_average": load,
            "headline_text": headline, "above_noise": [f"{k}@{mb:g}" for k, mb in above],
            "above_noise_text": above_text, "above_noise_rows": above_rows,
            "below_floor_text": (f"{below_text} came out below local" if below_floor
                                 else "no version came out below local"),
            "num_buckets": {f"{mb:g}": len(built[("overlapped", mb)][1].buckets) for mb in sorted(set(args.bucket_mb))},
            "overlapped_over_bucketed": {f"{mb:g}": med[("overlapped", mb)] / med[("bucketed", mb)]
                                         for mb in sorted(set(args.bucket_mb))},
            "overlapped_vs_bucketed_text": vs_bucketed, "naive_text": naive_text, "verdict_text": verdict,
            "takeaway_text": takeaway, "one_bucket_text": one_bucket,
            "grad_mib": grad_bytes / 2**20, "local_min_ms": min(local_ms), "local_max_ms": max(local_ms),
            "best_ms": {k: 1e3 * med[(k, best[k])] for k in best if best[k] is not None}
            | {k: 1e3 * med[(k, 0.0)] for k in ("local", "naive")},
            "world_size": ctx.world_size, "backend": ctx.backend}


def _headline(med: dict, best: dict, floor: float) -> str:
    """The headline: overlapped / torch at each one's best trusted size, or which variant had no row above local."""
    if best["overlapped"] is not None and best["torch"] is not None:
        ratio = med[("overlapped", best["overlapped"])] / med[("torch", best["torch"])]
        return (f"overlapped DDP took {1e3 * med[('overlapped', best['overlapped'])]:.1f} ms "
                f"({best['overlapped']:g} MiB buckets), torch's DDP {1e3 * med[('torch', best['torch'])]:.1f} ms "
                f"({best['torch']:g} MiB) and local {1e3 * floor:.1f} ms: overlapped / torch = {ratio:.2f}x")
    gone = [k for k in ("overlapped", "torch") if best[k] is None]  # every row of these came out below local
    rows = ", ".join(f"{k} " + "/".join(f"{1e3 * t:.0f}" for (kk, _), t in med.items() if kk == k) for k in gone)
    return (f"no headline ratio: every {' and every '.join(gone)} row came out below local's median "
            f"({1e3 * floor:.0f} ms; {rows} ms), so this run cannot rank overlapped against torch")


def _naive_vs_rest(med: dict) -> str:
    """The run's plainest result: naive against local, and whether every bucketed, overlapped and torch row beat it."""
    local, naive = med[("local", 0.0)], med[("naive", 0.0)]
    rest = {v: t for v, t in med.items() if v[0] not in ("local", "naive")}
    slowest = max(rest, key=rest.get)
    if rest[slowest] < naive:
        return (f"naive took {naive / local:.2f}x local's median; every bucketed, overlapped and torch row took less "
                f"(the slowest, {slowest[0]} at {slowest[1]:g} MiB, {rest[slowest] / local:.2f}x)")
    beat = [f"{k} at {mb:g} MiB" for (k, mb), t in rest.items() if t >= naive]
    return (f"naive took {naive / local:.2f}x local's median, and this run did not rank it last: "
            f"{', '.join(beat)} took as long or longer")


def _above_noise(med: dict, local_max_ms: float) -> tuple[list, str, str]:
    """The rows whose median lies above local's slowest round (a cost noise alone did not give), as (keys, the
    rows for the lesson's sentence, the printed line); "every row" when that is all of them."""
    others = [v for v in med if v[0] != "local"]
    above = [(k, mb) for k, mb in others if 1e3 * med[(k, mb)] > local_max_ms]
    if above and len(above) == len(others):
        rows = f"every row (the fastest at {min(1e3 * med[v] for v in above):.0f} ms)"
    else:
        rows = ", ".join(f"{k} ({1e3 * med[(k, mb)]:.0f} ms)" if k == "naive"
                         else f"{k} at {mb:g} MiB ({1e3 * med[(k, mb)]:.0f} ms)" for k, mb in above) or "none"
    text = (f"medians above local's slowest round, outside the noise: {rows}" if above else
            "no median lies above local's slowest round: this run separates no version from local")
    return above, rows, text


def _verdict(med: dict, local_min_ms: float, local_max_ms: float) -> str:
    """What the run shows, plainly: which versions cost measurably more than not communicating (a median above
    local's slowest round), or that none did and the run measured the machine's noise."""
    others = [v for v in med if v[0] != "local"]
    above = [v for v in others if 1e3 * med[v] > local_max_ms]
    if not above:
        return (f"no measured cost of communicating: every version's median lies at or below local's slowest round "
                f"({local_max_ms:.0f} ms; local's rounds ran from {local_min_ms:.0f}), so on this machine, at this "
                "load, the run cannot tell any version from not communicating at all, nor rank the versions")
    if len(above) == len(others):
        return (f"every version cost measurably more than local: every median lies above local's slowest round "
                f"({local_max_ms:.0f} ms)")
    names = ", ".join(k if k == "naive" else f"{k} at {mb:g} MiB" for k, mb in above)
    return (f"of the rows, only {names} had a median above local's band (its slowest round, {local_max_ms:.0f} ms); "
            "the others lie inside or below the band and cannot be told from not communicating at all")


def _takeaway(med: dict, local_min_ms: float, local_max_ms: float, buckets: dict | None = None) -> str:
    """The one number to keep from the run: what naive's per-parameter all-reduces cost over local, and how much of
    that the fastest bucketed, overlapped or torch row saved, each said only where it exceeds local's own spread.
    `buckets` (bucket MiB -> the hand-written versions' bucket count): an overlapped row with one bucket is named
    with the warning that nothing overlapped there (its one all-reduce starts when the backward ends)."""
    local, naive = 1e3 * med[("local", 0.0)], 1e3 * med[("naive", 0.0)]
    rest = {v: 1e3 * t for v, t in med.items() if v[0] not in ("local", "naive") and t >= med[("local", 0.0)]}
    spread = local_max_ms - local_min_ms  # rows below local's median (noise, see below_floor) are left out of rest
    if naive <= local_max_ms:
        return (f"naive's median ({naive:.0f} ms) lies within local's rounds ({local_min_ms:.0f} to "
                f"{local_max_ms:.0f} ms): at this load the run measured no cost of communicating that stands out "
                "from the noise, so it gives no number to keep")
    head = (f"one all-reduce per parameter (naive) cost {naive - local:.0f} ms per step over not communicating "
            f"({naive / local:.2f}x local's median)")
    if not rest:
        return (f"{head}; every other row came out below local's median (noise), so the run cannot say what "
                "buckets saved")
    best = min(rest, key=rest.get)
    one = (", one bucket: nothing overlapped there"
           if best[0] == "overlapped" and (buckets or {}).get(best[1]) == 1 else "")
    if naive - rest[best] > spread:
        band = "above local's band" if rest[best] > local_max_ms else "inside local's band"
        return (f"{head}; the fastest bucketed, overlapped or torch row ({best[0]} at {best[1]:g} MiB{one}, "
                f"{band}) took {naive - rest[best]:.0f} ms less than naive, more than local's own spread "
                f"({spread:.0f} ms): that is what fewer, larger all-reduces saved against naive")
    return (f"{head}; no bucketed, overlapped or torch row was faster than naive by more than local's own spread "
            f"({spread:.0f} ms), so this run does not measure what buckets save")


def _one_bucket(med: dict, buckets: dict, spread_ms: float) -> str:
    """Overlapped against bucketed at the largest size with one bucket (launched when the backward ends: nothing
    overlaps, so both do the same work); the gap is called noise when it is within local's own spread."""
    single = [mb for mb, n in buckets.items() if n == 1]
    if not single:
        return "no bucket size of this run holds all the gradients in one bucket"
    mb = max(single)
    gap = 1e3 * (med[("bucketed", mb)] - med[("overlapped", mb)])  # > 0: overlapped's median lower
    head = (f"at {mb:g} MiB all the gradients fit in one bucket, launched when the backward ends, so overlapped has "
            f"nothing to overlap; its median lies {abs(gap):.1f} ms {'below' if gap > 0 else 'above'} bucketed's")
    if round(abs(gap), 1) <= round(spread_ms, 1):  # as printed, one decimal like the per-size gaps
        return f"{head}, within local's own spread ({spread_ms:.1f} ms): noise between rounds"
    return (f"{head}, more than local's own spread ({spread_ms:.1f} ms), though the two did the same work there: "
            "a gap this run does not explain")


def _and(items: list[str]) -> str:
    return " and ".join(items) if len(items) < 3 else ", ".join(items[:-1]) + " and " + items[-1]


def _overlapped_vs_bucketed(med: dict, sizes: list[float], spread_ms: float) -> str:
    """One plain sentence: at which bucket sizes overlapped's step was shorter or longer than bucketed's, by how
    much, and which gaps are wider than local's own spread (the noise of a row, compared as printed: one decimal)."""
    gaps = {mb: 1e3 * (med[("bucketed", mb)] - med[("overlapped", mb)]) for mb in sizes}  # > 0: overlapped faster
    parts = []
    for first, later, sign in (("shorter than bucketed's", "shorter", 1), ("longer than bucketed's", "longer", -1),
                               ("the same as bucketed's", "the same", 0)):
        mbs = [mb for mb in sizes if (gaps[mb] > 0) - (gaps[mb] < 0) == sign]
        if mbs:  # the first part names bucketed, the later ones do not repeat it
            every = "every bucket size, " if len(mbs) == len(sizes) > 1 else ""
            each = [f"{mb:g} MiB (by {abs(gaps[mb]):.1f} ms)" for mb in mbs]
            parts.append(f"{later if parts else first} at {every}{_and(each)}")
    wide = [mb for mb in sizes if round(abs(gaps[mb]), 1) > round(spread_ms, 1)]  # as printed: 7.0 is not > 7.0
    spread = f"the spread of local's own rounds ({spread_ms:.1f} ms)"
    noise = (f"none of these gaps is wider than {spread}, so none is more than noise" if not wide else
             f"every gap is wider than {spread}" if len(wide) == len(sizes) else
             f"only the gap{'s' * (len(wide) > 1)} at {_and([f'{mb:g}' for mb in wide])} MiB "
             f"{'are' if len(wide) > 1 else 'is'} wider than {spread}")
    return f"overlapped's step was {', and '.join(parts)}; {noise}"


def _calls(wrapped, args: Settings) -> str:
    calls = getattr(wrapped, "allreduce_calls", None)
    if calls is None:
        return "0" if not hasattr(wrapped, "finish_gradient_synchronization") else "(torch)"
    return str(calls // (args.repeats * args.steps + WARMUP))


def draw(args: Settings, med: dict, local_ms: list[float]) -> None:
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    sizes = sorted(set(args.bucket_mb))
    # local's own rounds, slowest to fastest: a median inside this band is within the noise of the run
    ax.axhspan(min(local_ms), max(local_ms), color="gray", alpha=0.15, label="local's rounds, min to max (noise)")
    for kind, marker in (("bucketed", "s"), ("overlapped", "o"), ("torch", "^")):
        ax.plot(sizes, [1e3 * med[(kind, mb)] for mb in sizes], marker=marker, label=kind)
    for kind, style, what in (("naive", "--", "one all-reduce per parameter"), ("local", ":", "no communication")):
        ax.axhline(1e3 * med[(kind, 0.0)], linestyle=style, color="gray", label=f"{kind} ({what})")
    ax.set(xscale="log", xlabel="bucket size (MiB)", ylabel="step time (ms, median)",
           title="Data-parallel step time against bucket size")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside the axes: covers no marker
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'bench_ddp')}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"n_layer": 1, "n_embd": 64, "repeats": 2, "steps": 1,
                                               "bucket_mb": [0.05, 1.0]},
                     world_sizes=range(2, 9), world_sizes_text="2 to 8")
    results = launch(worker, args)
    if results is not None and args.json:
        report.write_json(args.json, results, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
