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

How to run (any world size from 1 to 8)
    python tutorial/part1-distributed/chapter03-collectives/scripts/composed_ops.py -w 4
    torchrun --nproc-per-node 4 tutorial/part1-distributed/chapter03-collectives/scripts/composed_ops.py

Runtime on 2 cores: about 4 s (process start-up dominates), 3 s with --smoke.

Try next
    python tutorial/part1-distributed/chapter03-collectives/scripts/composed_ops.py -w 1
        -> one rank: every composed operation reduces to the single-process numpy answer
    python tutorial/part1-distributed/chapter03-collectives/scripts/composed_ops.py -w 8 --extra-rows 0
        -> even shards (the header says so): averaging the per-rank means would now be right too (still checked)
    torchrun --nproc-per-node 3 tutorial/part1-distributed/chapter03-collectives/scripts/composed_ops.py
        -> the same checks under torchrun
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mlsys import cli, report
from mlsys.launch import RankContext, launch


@dataclass
class Settings(cli.DistArgs):
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
    for name, fn in (("sums", lambda: moments_by_sums(x)), ("chan", lambda: moments_by_chan(x, W))):
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
    probs = sharded_softmax(vec[start:stop])
    report.expect_close(f"softmax on rank {r}", probs, torch.softmax(vec, 0)[start:stop], rtol=1e-5, atol=1e-7)
    value, index = sharded_argmax(vec[start:stop], start)
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
    return results


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "vocab": 12}, world_sizes=range(1, 9),
                     world_sizes_text="1..8")
    result = launch(worker, args)
    if result is None:
        return 0
    print(f"OK: mean, variance (sums and Chan), softmax and argmax match numpy/torch on all {args.world_size} ranks")
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
