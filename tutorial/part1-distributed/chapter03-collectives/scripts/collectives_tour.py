"""A tour of every collective: what each rank holds before and after, checked against numpy.

What it shows
    Each rank builds a small tensor of integers from (seed, rank). Then every collective runs once:
      broadcast, scatter, gather, all_gather (list and flat), reduce, all_reduce (SUM, MAX, MIN, PRODUCT, AVG,
      BAND, BOR, BXOR on integers, and PREMUL_SUM as a
      probe), reduce_scatter (list form and the flat-buffer reduce_scatter_single, called
      reduce_scatter_tensor before torch 2.13), all_to_all (list form and all_to_all_single).
    Rank 0 prints each rank's "before" and "after" in rank order. Every rank can regenerate every other rank's input
    from the seed without any communication, so each rank computes the numpy answer on its own and compares.
    A collective or op the backend refuses is reported as "unsupported on <backend>: <its error>" rather than a
    failure; only a wrong result fails the run (exit 1). The JSON lists each collective, supported?, checked ok.
    The figure shows the (rank, element) grid before and after each of the eight basic collectives, run a second
    time on readable ids (element e of rank r holds 10r+e, or 100r+e when W*k > 10; also checked against numpy),
    each cell coloured by the rank its value came from, so every piece can be followed.

How to run (any world size from 1 to 8)
    python tutorial/part1-distributed/chapter03-collectives/scripts/collectives_tour.py -w 4
    torchrun --nproc-per-node 4 tutorial/part1-distributed/chapter03-collectives/scripts/collectives_tour.py
    ... --per-rank 3 --root 2     # 3 elements per piece, rank 2 is the root of the rooted collectives

Runtime on 2 idle cores: about 4 s at -w 4 (process start-up dominates), 3 s with --smoke; several times that on a
busy machine.

Try next
    python tutorial/part1-distributed/chapter03-collectives/scripts/collectives_tour.py -w 2 --root 1
        -> the smallest grid: read each collective off the figure as a 2-row table
    python tutorial/part1-distributed/chapter03-collectives/scripts/collectives_tour.py --per-rank 3
        -> pieces of 3 elements; the grids in the figure grow, the rules do not change
    python tutorial/part1-distributed/chapter03-collectives/scripts/collectives_tour.py -w 4 --root 4
        -> a usage error (exit 2): the root must be a rank of the world
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.launch import RankContext, launch


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 4
    """Number of ranks to start (1 to 8). Under torchrun it is taken from WORLD_SIZE."""
    per_rank: int = 2
    """k: elements in one piece. Rooted and all_* collectives move pieces of k; scatter-like ones split W*k."""
    root: int = 0
    """The root rank of broadcast, scatter, gather and reduce."""

    def validate(self) -> None:
        if self.per_rank < 1:
            raise cli.UsageError(f"--per-rank must be at least 1, got {self.per_rank}")
        if not 0 <= self.root < self.world_size:
            raise cli.UsageError(f"--root {self.root} is not a rank of a world of {self.world_size}")


# --8<-- [start:inputs]
def rank_input(seed: int, rank: int, world_size: int, k: int) -> torch.Tensor:
    """Rank r's input, shape (W*k,): small integers 1..3, so sums and products are exact in float32."""
    gen = torch.Generator().manual_seed(seed * 10_007 + rank)
    return torch.randint(1, 4, (world_size * k,), generator=gen).float()


def all_inputs(seed: int, world_size: int, k: int) -> np.ndarray:
    """Every rank's input, shape (W, W*k), rebuilt locally: the reference needs no communication."""
    return np.stack([rank_input(seed, r, world_size, k).numpy() for r in range(world_size)])
# --8<-- [end:inputs]


# Each case returns (before, after, expected) for this rank; expected None means "nothing defined here".
Case = Callable[[RankContext, torch.Tensor, np.ndarray, int, int], tuple]


# --8<-- [start:cases]
def broadcast(ctx, x, X, k, root):
    t = x[:k].clone()  # (k,): the root's copy overwrites everyone's
    dist.broadcast(t, src=root)
    return x[:k], t, X[root, :k]


def scatter(ctx, x, X, k, root):
    out = x.new_empty(k)  # (k,): piece r of the root's (W*k,) input
    dist.scatter(out, list(x.chunk(ctx.world_size)) if ctx.rank == root else None, src=root)
    return x, out, X[root].reshape(ctx.world_size, k)[ctx.rank]


def gather(ctx, x, X, k, root):
    pieces = [x.new_empty(k) for _ in range(ctx.world_size)] if ctx.rank == root else None
    dist.gather(x[:k].clone(), pieces, dst=root)  # only the root receives: (W, k)
    got = torch.cat(pieces) if pieces else None
    return x[:k], got, X[:, :k].ravel() if ctx.rank == root else None


def all_gather(ctx, x, X, k, root):
    pieces = [x.new_empty(k) for _ in range(ctx.world_size)]
    dist.all_gather(pieces, x[:k].clone())  # every rank receives (W, k)
    return x[:k], torch.cat(pieces), X[:, :k].ravel()


def reduce(ctx, x, X, k, root):
    t = x[:k].clone()
    dist.reduce(t, dst=root, op=dist.ReduceOp.SUM)  # only the root's result is defined
    return x[:k], t if ctx.rank == root else None, X[:, :k].sum(0) if ctx.rank == root else None


def all_reduce(op_name: str, reference: Callable) -> Case:
    def case(ctx, x, X, k, root):
        # PREMUL_SUM (NCCL only) multiplies every input by a factor, here 2, before summing; torch builds the op
        # with a private helper, _make_nccl_premul_sum, which may change between releases
        op = dist._make_nccl_premul_sum(2.0) if op_name == "PREMUL_SUM" else getattr(dist.ReduceOp, op_name)
        t = x[:k].clone()
        dist.all_reduce(t, op=op)
        return x[:k], t, reference(X[:, :k])
    return case


def all_reduce_bits(op_name: str, reference: Callable) -> Case:
    """BAND, BOR, BXOR: bitwise reductions, on integer tensors (the float inputs as int64)."""
    def case(ctx, x, X, k, root):
        t = x[:k].long()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op_name))
        return x[:k].long(), t, reference.reduce(X[:, :k].astype(np.int64), axis=0)  # numpy's ufunc reduce
    return case


# torch 2.13 names the flat all-gather all_gather_single (all_gather_into_tensor before); use what this torch has
ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_flat(ctx, x, X, k, root):
    out = x.new_empty(ctx.world_size * k)  # (W*k,): one flat output buffer instead of a list of W tensors
    ALL_GATHER_FLAT(out, x[:k].clone())
    return x[:k], out, X[:, :k].ravel()


def reduce_scatter(ctx, x, X, k, root):
    out = x.new_empty(k)  # (k,): piece r of the sum over ranks of the (W*k,) inputs
    dist.reduce_scatter(out, list(x.clone().chunk(ctx.world_size)))
    return x, out, X.sum(0).reshape(ctx.world_size, k)[ctx.rank]


# torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single (the old name warns); use what this torch has
REDUCE_SCATTER_FLAT = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter_flat(ctx, x, X, k, root):
    out = x.new_empty(k)  # same result, from one flat (W*k,) input buffer instead of a list
    REDUCE_SCATTER_FLAT(out, x.clone())
    return x, out, X.sum(0).reshape(ctx.world_size, k)[ctx.rank]


def all_to_all(ctx, x, X, k, root):
    outs = [x.new_empty(k) for _ in range(ctx.world_size)]  # out[j] = piece r of rank j's input
    dist.all_to_all(outs, list(x.clone().chunk(ctx.world_size)))
    return x, torch.cat(outs), X.reshape(ctx.world_size, ctx.world_size, k)[:, ctx.rank].ravel()


def all_to_all_single(ctx, x, X, k, root):
    out = torch.empty_like(x)  # (W*k,): a transpose of the (rank, piece) grid
    dist.all_to_all_single(out, x.clone())
    return x, out, X.reshape(ctx.world_size, ctx.world_size, k)[:, ctx.rank].ravel()
# --8<-- [end:cases]


CASES: dict[str, Case] = {
    "broadcast": broadcast, "scatter": scatter, "gather": gather, "all_gather": all_gather, "reduce": reduce,
    "all_reduce SUM": all_reduce("SUM", lambda a: a.sum(0)),
    "all_reduce MAX": all_reduce("MAX", lambda a: a.max(0)),
    "all_reduce MIN": all_reduce("MIN", lambda a: a.min(0)),
    "all_reduce PRODUCT": all_reduce("PRODUCT", lambda a: a.prod(0)),
    "all_reduce AVG": all_reduce("AVG", lambda a: a.mean(0)),
    "all_reduce PREMUL_SUM": all_reduce("PREMUL_SUM", lambda a: 2.0 * a.sum(0)),  # NCCL-only: a probe
    "all_reduce BAND": all_reduce_bits("BAND", np.bitwise_and),
    "all_reduce BOR": all_reduce_bits("BOR", np.bitwise_or),
    "all_reduce BXOR": all_reduce_bits("BXOR", np.bitwise_xor),
    ALL_GATHER_FLAT.__name__: all_gather_flat,
    "reduce_scatter": reduce_scatter, REDUCE_SCATTER_FLAT.__name__: reduce_scatter_flat,
    "all_to_all": all_to_all, "all_to_all_single": all_to_all_single,
}


def fmt(t) -> str:
    return "-" if t is None else " ".join(f"{v:g}" for v in (t.tolist() if hasattr(t, "tolist") else t))


def run_case(ctx: RankContext, name: str, case: Case, x, X, args: Settings) -> dict:
    """Run one collective; a refusal by the backend is reported, a wrong answer raises SelfCheckFailed."""
    try:
        before, after, expected = case(ctx, x, X, args.per_rank, args.root)
    except (RuntimeError, ValueError) as err:  # refused on every rank alike, before any byte moved
        reason = str(err).strip().splitlines()[0]
        ctx.print(f"{name}: unsupported on {ctx.backend}: {reason}")
        return {"collective": name, "supported": False, "after": None, "reason": reason}
    ctx.print(f"{name}:")
    ctx.print_ordered(f"before {fmt(before):<{2 * ctx.world_size * args.per_rank + 1}} after {fmt(after)}")
    if expected is not None:
        report.expect_close(f"{name} on rank {ctx.rank}", after, np.asarray(expected, dtype=np.float32), rtol=1e-6)
    return {"collective": name, "supported": True, "after": _values(after)}  # what this rank holds after it


def id_base(world_size: int, k: int) -> int:
    """10 when a rank's W*k elements fit in one digit, else 100: element e of rank r is then base*r + e."""
    return 10 if world_size * k <= 10 else 100


def figure_run(ctx: RankContext, name: str, args: Settings) -> list:
    """Run `name` again on readable ids (element e of rank r holds base*r + e) for the figure, checked against
    numpy like the tour; returns every rank's (before, after) for rank 0 to draw."""
    W, k = ctx.world_size, args.per_rank
    ids = np.arange(W)[:, None] * id_base(W, k) + np.arange(W * k)[None, :]  # (W, W*k)
    x = torch.tensor(ids[ctx.rank], dtype=torch.float32, device=ctx.device)
    before, after, expected = CASES[name](ctx, x, ids.astype(np.float64), k, args.root)
    if expected is not None:
        report.expect_close(f"{name} on ids, rank {ctx.rank}", after, np.asarray(expected, dtype=np.float32))
    held = [None] * W
    dist.all_gather_object(held, (_values(before), _values(after)))
    return held


def _values(t) -> list | None:
    return None if t is None else [float(v) for v in (t.tolist() if hasattr(t, "tolist") else t)]


DRAWN = ["broadcast", "scatter", "gather", "reduce", "all_gather", "all_reduce SUM", "reduce_scatter", "all_to_all"]
REDUCING = {"reduce", "all_reduce SUM", "reduce_scatter"}  # their results are sums, not pieces that moved


def draw(held: dict[str, list], args: Settings) -> str:
    """One column per collective: the (rank, element) grid before (top) and after (bottom), each cell coloured by
    the rank its value came from and labelled with it (rank r's element e holds base*r + e); the sum of
    element e over all ranks, what the reductions leave, is labelled "\u03a3e" (sigma e) and drawn grey."""
    plt = plot.pyplot()
    import seaborn as sns

    W, k = args.world_size, args.per_rank
    base, palette = id_base(W, k), sns.color_palette("colorblind", W)
    ncols = min(4, len(held))  # at most four collectives side by side; the rest in a second band below
    bands = -(-len(held) // ncols)
    fig, axes = plt.subplots(2 * bands, ncols, figsize=(2.9 * ncols, bands * (1.4 + 1.0 * W) + 0.6), squeeze=False)
    for index in range(len(held), bands * ncols):  # the unused places of an incomplete last band
        band, col = divmod(index, ncols)
        axes[2 * band, col].set_axis_off()
        axes[2 * band + 1, col].set_axis_off()
    for index, (name, rows) in enumerate(held.items()):
        band, col = divmod(index, ncols)
        for line, label in enumerate(["before", "after"]):
            cells = [h[line] for h in rows]
            width = max(len(c) for c in cells if c is not None)
            ax = axes[2 * band + line, col]
            image = np.ones((W, width, 3))  # white where a rank holds nothing defined
            for r, values in enumerate(cells):
                for j, v in enumerate(values or []):
                    src, e = divmod(int(v), base)
                    summed = (v - base * W * (W - 1) / 2) / W  # the sum over ranks of element e, if that is what v is
                    is_sum = line == 1 and W > 1 and name in REDUCING and summed.is_integer()
                    image[r, j] = (0.8, 0.8, 0.8) if is_sum else palette[src % W]
                    text = f"\u03a3{int(summed)}" if is_sum else f"{int(v)}"
                    ax.text(j, r, text, ha="center", va="center", fontsize=7 if width <= 8 else 5)
            ax.imshow(image, aspect="auto")
            ax.set_xticks(np.arange(width + 1) - 0.5, minor=True)
            ax.set_yticks(np.arange(W + 1) - 0.5, minor=True)
            ax.grid(which="minor", color="white", lw=1)
            ax.grid(which="major", visible=False)
            ax.tick_params(which="minor", length=0)
            ax.set_title(f"{name}\n{label}" if line == 0 else label, fontsize=9)
            ax.set_yticks(range(W), [f"rank {r}" for r in range(W)], fontsize=7)
            ax.set_xticks([])
    fig.suptitle(f"What each of {W} ranks holds before (upper) and after (lower) each collective.\nRank r's element e "
                 f"starts as {base}r+e, coloured by r; \u03a3e = element e summed over the ranks (root = rank "
                 f"{args.root}; blank = not defined)", fontsize=9)
    fig.tight_layout()
    return str(plot.save(fig, args, "each_collective_before_and_after"))


def worker(ctx: RankContext, args: Settings) -> list[dict]:
    x = rank_input(args.seed, ctx.rank, ctx.world_size, args.per_rank).to(ctx.device)  # (W*k,) this rank's data
    X = all_inputs(args.seed, ctx.world_size, args.per_rank)  # (W, W*k) everyone's, for the reference
    ctx.print(f"world_size={ctx.world_size} backend={ctx.backend} root={args.root} k={args.per_rank}")
    rows = [run_case(ctx, name, case, x, X, args) for name, case in CASES.items()]
    figure = {name: figure_run(ctx, name, args) for name in DRAWN}  # the same collectives on readable ids
    dist.barrier()  # every rank has passed its own checks (a failing rank raised before this)
    return {"rows": rows, "figure": figure}


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2}, world_sizes=range(1, 9), world_sizes_text="1..8")
    result = launch(worker, args)
    if result is None:  # a non-zero torchrun rank: rank 0 reports
        return 0
    rows = result["rows"]
    print()
    print(report.table([{"collective": r["collective"], "supported": "yes" if r["supported"] else "no",
                         "checked": "ok" if r["supported"] else "-"} for r in rows]))  # a wrong one raised
    supported = [r for r in rows if r["supported"]]
    print(f"figure: {draw(result['figure'], args)}")
    print(f"OK: {len(supported)} of {len(rows)} collectives supported on {args.backend} with W={args.world_size}; "
          "every supported one matches numpy on every rank")
    if args.json:
        report.write_json(args.json, {"world_size": args.world_size, "backend": args.backend,
                                      "collectives": rows, "figure_ids_base": id_base(args.world_size, args.per_rank),
                                      "figure": result["figure"]},
                          args)
    return 0


if __name__ == "__main__":
    cli.run(main)
