"""Composed operations: mean/variance, softmax and argmax over data sharded across ranks, from a few all_reduces.

What it shows
    1. mean and variance over UNEVEN shards (rank r holds rows + r*extra rows of a (n, d) matrix), two ways:
         sums  one all_reduce of [n, sum x, sum x^2] (float64), then var = E[x^2] - E[x]^2;
         chan  all_gather every rank's (n, mean, M2) and merge them pairwise (Chan, Golub & LeVeque).
       Then both again on the same rows shifted by --shift (1e8) in float64: the sums formula cancels
       catastrophically (its variance is visibly wrong), Chan's merge still matches numpy.
    2. softmax of a vector split across ranks: all_reduce MAX of the local maxima, then all_reduce SUM of
       exp(x - max); each rank then normalises its own slice. Nothing of size V ever moves.
    3. argmax with its global index: all_reduce MAX of the values, then all_reduce MIN of the indices whose value is
       the maximum, so ties go to the lowest index, like numpy.argmax.
    Every rank checks its answer against numpy / torch on the full (concatenated) data, rebuilt from the seed.
    The figure (partials.png, printed as `figure: <path>`) draws the vector, coloured by the rank that holds each
    element, above every all_reduce of the run (the sums one of the mean/variance and the four of softmax and
    argmax): what each rank put in, recorded as the call was made (mlsys.trace.recording), and what came out.
    The JSON keeps those calls under `all_reduce_calls`, one list per rank.

How to run (any world size from 1 to 8)
    python tutorial/part1-distributed/chapter03-collectives/scripts/composed_ops.py -w 4
    torchrun --nproc-per-node 4 tutorial/part1-distributed/chapter03-collectives/scripts/composed_ops.py

Runtime on 2 idle cores: about 5 s (process start-up and drawing dominate), 4 s with --smoke; two or three times
that on a busy machine.

Try next
    python tutorial/part1-distributed/chapter03-collectives/scripts/composed_ops.py -w 1
        -> one rank: every composed operation reduces to the single-process numpy answer
    python tutorial/part1-distributed/chapter03-collectives/scripts/composed_ops.py -w 8 --extra-rows 0
        -> even shards (the header says so): averaging the per-rank means would now be right too (still checked)
    torchrun --nproc-per-node 3 tutorial/part1-distributed/chapter03-collectives/scripts/composed_ops.py
        -> the same checks under torchrun, after a warning block of torchrun's own (that it set OMP_NUM_THREADS
           to 1), which is harmless
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.launch import RankContext, launch
from mlsys.trace import recording


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 4
    """Number of ranks to start (1 to 8). Under torchrun it is taken from WORLD_SIZE."""
    rows: int = 5
    """Rows on rank 0; rank r holds rows + r*extra_rows rows (uneven shards)."""
    extra_rows: int = 3
    """How many more rows each next rank holds."""
    dim: int = 4
    """Columns of the matrix whose per-column mean and variance are computed."""
    shift: float = 1e8
    """Added (in float64) to every row for the second mean/variance line, where E[x^2] - E[x]^2 cancels."""
    vocab: int = 50
    """Length V of the vector for softmax and argmax (split unevenly when W does not divide it)."""

    def validate(self) -> None:
        for name in ("rows", "dim", "vocab"):
            if getattr(self, name) < 1:
                raise cli.UsageError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.extra_rows < 0:
            raise cli.UsageError(f"--extra-rows must be >= 0, got {self.extra_rows}")
        if self.vocab < self.world_size:
            raise cli.UsageError(f"--vocab {self.vocab} must be at least the world size {self.world_size}")


# ----------------------------------------------------------------------------------------------- the data
def shard_rows(seed: int, rank: int, args: Settings) -> torch.Tensor:
    """Rank r's rows, shape (rows + r*extra_rows, dim), float32 around a mean of 10."""
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    return 10 + 2 * torch.randn(args.rows + rank * args.extra_rows, args.dim, generator=gen)


def full_vector(seed: int, vocab: int) -> torch.Tensor:
    """The whole (V,) vector, integers 0..9 so that argmax ties happen. Every rank can rebuild it."""
    gen = torch.Generator().manual_seed(seed * 104_729 + 1)
    return torch.randint(0, 10, (vocab,), generator=gen).float()


def my_slice(vocab: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank r's slice of the vector: tensor_split sizes, uneven when W does not divide V."""
    sizes = [len(c) for c in torch.arange(vocab).tensor_split(world_size)]
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


# ----------------------------------------------------------------------------------------------- mean and variance
# --8<-- [start:moments]
def moments_by_sums(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One all_reduce of [n | sum x | sum x^2] (1 + 2d values, float64). Population variance."""
    d = x.shape[1]
    x64 = x.double()
    packed = torch.cat([torch.tensor([x.shape[0]], dtype=torch.float64), x64.sum(0), (x64 * x64).sum(0)])  # (1+2d,)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    n, s, ss = packed[0], packed[1:1 + d], packed[1 + d:]
    mean = s / n
    return mean, ss / n - mean * mean  # E[x^2] - E[x]^2: cancels badly when |mean| >> std, hence float64


def chan_merge(a: tuple, b: tuple) -> tuple:
    """Merge (n, mean, M2) of two disjoint sets; M2 = sum of squared deviations from the set's own mean.

    Chan, Golub & LeVeque, "Algorithms for computing the sample variance: analysis and recommendations" (1983),
    https://doi.org/10.1080/00031305.1983.10483115
    """
    (na, ma, m2a), (nb, mb, m2b) = a, b
    n = na + nb
    delta = mb - ma
    return n, ma + delta * (nb / n), m2a + m2b + delta * delta * (na * nb / n)


def moments_by_chan(x: torch.Tensor, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """all_gather each rank's (n, mean, M2) -- 1 + 2d numbers -- and fold them in rank order."""
    x64 = x.double()
    mean = x64.mean(0)
    local = torch.cat([torch.tensor([x.shape[0]], dtype=torch.float64), mean, ((x64 - mean) ** 2).sum(0)])  # (1+2d,)
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local)
    d = x.shape[1]
    merged = (0.0, torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64))
    for p in parts:  # every rank folds the same list in the same order: identical results everywhere
        merged = chan_merge(merged, (p[0].item(), p[1:1 + d], p[1 + d:]))
    n, mean, m2 = merged
    return mean, m2 / n
# --8<-- [end:moments]


# ----------------------------------------------------------------------------------------------- softmax and argmax
# --8<-- [start:softmax]
def sharded_softmax(local: torch.Tensor) -> torch.Tensor:
    """softmax over the concatenation of every rank's `local` (V_r,); returns this rank's (V_r,) slice."""
    m = local.max().clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX)  # global max: exp never overflows
    e = torch.exp(local - m)
    total = e.sum()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)  # the global normaliser
    return e / total
# --8<-- [end:softmax]


# --8<-- [start:argmax]
def sharded_argmax(local: torch.Tensor, offset: int) -> tuple[float, int]:
    """(max value, its global index) over every rank's slice; ties -> the lowest global index."""
    value = local.max().clone()
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    hits = torch.nonzero(local == value).flatten()  # local positions holding the global max (maybe none)
    big = torch.iinfo(torch.int64).max
    index = torch.tensor(offset + hits[0].item() if len(hits) else big, dtype=torch.int64)
    dist.all_reduce(index, op=dist.ReduceOp.MIN)  # the first rank holding the max wins, at its first position
    return value.item(), int(index.item())
# --8<-- [end:argmax]


# ----------------------------------------------------------------------------------------------- the job
def worker(ctx: RankContext, args: Settings) -> dict:
    W, r = ctx.world_size, ctx.rank
    x = shard_rows(args.seed, r, args)  # (n_r, d)
    full = np.concatenate([shard_rows(args.seed, q, args).numpy() for q in range(W)]).astype(np.float64)
    shards = "uneven" if args.extra_rows and W > 1 else "even"
    ctx.print(f"world_size={W}: mean/var of {full.shape[0]} rows x {args.dim} columns, in {shards} shards")
    ctx.print_ordered(f"rows {x.shape[0]:3d}  local mean[0] {x[:, 0].mean().item():.4f}")
    results = {"world_size": W, "rows_per_rank": [args.rows + q * args.extra_rows for q in range(W)]}
    calls: list[dict] = []  # every all_reduce of the picture: what this rank put in, what came out
    for name, fn in (("sums", lambda: moments_by_sums(x)), ("chan", lambda: moments_by_chan(x, W))):
        with recording(calls if name == "sums" else [], also=("all_reduce",), values=True):
            mean, var = fn()
        report.expect_close(f"{name} mean on rank {r}", mean, full.mean(0), rtol=1e-10, atol=1e-10)
        report.expect_close(f"{name} var on rank {r}", var, full.var(0), rtol=1e-9, atol=1e-10)
        ctx.print(f"{name:>5}: mean {np.round(mean.numpy(), 4).tolist()}  var {np.round(var.numpy(), 4).tolist()}")
        results[f"{name}_max_abs_err_var"] = float(np.abs(var.numpy() - full.var(0)).max())
        results[f"{name}_mean"], results[f"{name}_var"] = mean.tolist(), var.tolist()  # what this rank computed
    ctx.print(f"numpy: mean {np.round(full.mean(0), 4).tolist()}  var {np.round(full.var(0), 4).tolist()}")

    # the same rows shifted by a large mean, in float64: the sums formula subtracts two numbers near 1e16
    shifted, full_shifted = x.double() + args.shift, full + args.shift
    ctx.print(f"the same rows + {args.shift:g} (float64); only the variance, which the shift leaves unchanged:")
    for name, fn in (("sums", lambda: moments_by_sums(shifted)), ("chan", lambda: moments_by_chan(shifted, W))):
        _, var = fn()
        err = float(np.abs(var.numpy() - full_shifted.var(0)).max())
        ctx.print(f"{name:>5}: var {np.round(var.numpy(), 4).tolist()}  largest error {err:.2g}")
        results[f"shifted_{name}_max_abs_err_var"] = err
        results[f"shifted_{name}_var"] = var.tolist()
        if name == "chan":  # Chan's merge must survive the shift; the sums formula is shown failing, not checked
            report.expect_close(f"chan var after the shift on rank {r}", var, full_shifted.var(0), rtol=1e-6)
    ctx.print(f"numpy: var {np.round(full_shifted.var(0), 4).tolist()}")

    vec = full_vector(args.seed, args.vocab)  # (V,): every rank rebuilds it, then keeps only its slice
    start, stop = my_slice(args.vocab, r, W)
    with recording(calls, also=("all_reduce",), values=True):
        probs = sharded_softmax(vec[start:stop])
        value, index = sharded_argmax(vec[start:stop], start)
    report.expect_close(f"softmax on rank {r}", probs, torch.softmax(vec, 0)[start:stop], rtol=1e-5, atol=1e-7)
    ctx.print_ordered(f"slice [{start:3d}, {stop:3d})  local max {vec[start:stop].max().item():g}  "
                      f"softmax slice sum {probs.sum().item():.4f}")
    expected = int(np.argmax(vec.numpy()))
    report.expect_equal(f"argmax index on rank {r}", index, expected)
    report.expect_equal(f"argmax value on rank {r}", value, vec[expected].item())
    ctx.print(f"argmax: value {value:g} at global index {index} (numpy.argmax: {expected}); "
              f"the max occurs {int((vec == value).sum())} time(s)")
    # observations, for a test to check against its own numpy: the input, this rank's slice of the softmax, argmax
    results.update(vector=vec.tolist(), slice=[start, stop], softmax_slice=probs.tolist(), argmax_index=index,
                   argmax_value=value, max_ties=int((vec == value).sum()))
    mine = [{"what": what, "op": c["op"], "in": c["in"], "out": c["out"]} for what, c in zip(ALL_REDUCES, calls)]
    everyone: list = [None] * W
    dist.all_gather_object(everyone, {"rank": r, "slice": [start, stop], "calls": mine})
    results["all_reduce_calls"] = everyone  # rank order: everyone[q] is what rank q put in and got
    return results


# the all_reduces the worker records, in the order it makes them
ALL_REDUCES = ("mean/var: [n, Σx, Σx²]", "softmax: max", "softmax: Σ exp(x − max)", "argmax: max",
               "argmax: first index of the max")


def draw(results: dict, args: Settings) -> str:
    """Top: the vector, one cell per element coloured by the rank that holds it, the maximum's cells outlined and
    the argmax in red. Below: one column per recorded all_reduce, what each rank put in (a row per rank, in its
    colour) and, under the line, what the all_reduce returned (the same on every rank). For the mean/variance call
    only n and the first column's Σx and Σx² are shown (the call carries all d columns)."""
    plt = plot.pyplot()
    import seaborn as sns

    per_rank = results["all_reduce_calls"]
    W, vec, d = len(per_rank), results["vector"], args.dim
    palette = [tuple(0.55 + 0.45 * c for c in rgb) for rgb in sns.color_palette("colorblind", W)]  # light tints
    fig, (top, low) = plt.subplots(2, 1, figsize=(max(9.0, 0.2 * len(vec) + 1.5), 1.9 + 0.42 * (W + 3)),
                                   gridspec_kw={"height_ratios": [1.0, 0.42 * (W + 3)]})
    best, where = max(vec), results["argmax_index"]
    for p in per_rank:
        start, stop = p["slice"]
        for e in range(start, stop):
            top.add_patch(plt.Rectangle((e, 0), 1, 1, facecolor=palette[p["rank"]], edgecolor="white"))
            top.text(e + 0.5, 0.5, f"{vec[e]:g}", ha="center", va="center", fontsize=7,
                     fontweight="bold" if vec[e] == best else "normal")
        top.text((start + stop) / 2, 1.15, f"rank {p['rank']}: [{start}, {stop})", ha="center", fontsize=8)
    for e, v in enumerate(vec):
        if v == best:
            top.add_patch(plt.Rectangle((e, 0), 1, 1, fill=False, lw=2.2 if e == where else 1.0,
                                        edgecolor="red" if e == where else "black"))
    top.set_xlim(0, len(vec))
    top.set_ylim(0, 1.45)
    top.set_axis_off()
    top.set_title(f"The vector of {len(vec)} elements, split over {W} ranks; its maximum {best:g} outlined, "
                  f"the argmax (index {where}) in red", fontsize=9, loc="left")

    big = torch.iinfo(torch.int64).max

    def shown(what: str, values: list) -> str:
        if what.startswith("mean/var"):
            return f"n={values[0]:g}  Σx={values[1]:.1f}  Σx²={values[1 + d]:.0f}"
        if "index" in what:
            return "none here" if values == big else f"{values}"
        return f"{values:.4g}"

    columns = [p["calls"] for p in per_rank]
    widths = [3.0] + [1.6] * (len(ALL_REDUCES) - 1)
    edges = np.concatenate([[0.0], np.cumsum(widths)])
    for k, what in enumerate(ALL_REDUCES):
        x0, x1 = edges[k], edges[k + 1]
        header = what + (f" (column 0 of {d})" if k == 0 else "")
        low.text((x0 + x1) / 2, W + 1.6, f"{header}\nall_reduce {columns[0][k]['op']}", ha="center", va="center",
                 fontsize=8)
        for q in range(W):
            y = W - q + 0.5
            low.add_patch(plt.Rectangle((x0 + 0.05, y - 0.45), x1 - x0 - 0.1, 0.9, facecolor=palette[q]))
            low.text((x0 + x1) / 2, y, shown(what, columns[q][k]["in"]), ha="center", va="center", fontsize=8)
        low.add_patch(plt.Rectangle((x0 + 0.05, 0.05), x1 - x0 - 0.1, 0.9, facecolor="0.85", edgecolor="black"))
        low.text((x0 + x1) / 2, 0.5, shown(what, columns[0][k]["out"]), ha="center", va="center", fontsize=8,
                 fontweight="bold")
    for q in range(W):
        low.text(-0.1, W - q + 0.5, f"rank {q} puts in", ha="right", va="center", fontsize=8)
    low.text(-0.1, 0.5, "every rank gets", ha="right", va="center", fontsize=8, fontweight="bold")
    low.plot([0, edges[-1]], [1.0, 1.0], color="black", lw=1)
    low.set_xlim(-2.0, edges[-1])
    low.set_ylim(0, W + 2.2)
    low.set_axis_off()
    fig.tight_layout()
    return str(plot.save(fig, args, "partials"))


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "vocab": 12}, world_sizes=range(1, 9),
                     world_sizes_text="1..8")
    result = launch(worker, args)
    if result is None:
        return 0
    print(f"OK: mean, variance (sums and Chan), softmax and argmax match numpy/torch on all {args.world_size} ranks")
    print(f"figure: {draw(result, args)}")
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
