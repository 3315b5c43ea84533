"""Gradient synchronisation, seen and checked: each rank's gradient before and after the all-reduce.

What it shows
    1. Every rank computes the tiny GPT's gradient on its own batch (--batch-size sequences from its own shard):
       the gradients differ. BucketedDDP (mlsys.ddp) averages them; afterwards they are identical on every rank.
    2. The computed proof: one process concatenates all ranks' batches and backpropagates the mean loss over the
       whole global batch. Its gradient equals the average of the per-rank gradients (self-check, every tensor):
           grad (1/N) sum_i l_i  =  (1/W) sum_r grad (1/n) sum_{i in rank r} l_i      when N = W n
    3. The caveat: with UNEQUAL per-rank batches (rank r holds --batch-size + r sequences), the plain average is
       no longer the global-batch gradient; weighting rank r by n_r / N is (self-check), the plain average is not
       (its error is printed). The fix that works with an unmodified DDP wrapper (which always divides by W):
       each rank sums its per-token losses and divides by N/W (mlsys.ddp.global_token_mean), then BucketedDDP
       averages as usual; the result is the global-batch gradient again (self-check).
    Figure synced_gradient_vs_one_process_gradient.png: some gradient entries per rank before and after the sync,
    and per parameter tensor the largest distance of the synchronised gradient from the single-process one (equal,
    then unequal batches).

How to run (any world size from 1 to 8)
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/grad_sync.py -w 2
    torchrun --nproc-per-node 4 tutorial/part2-parallelism/chapter05-data-parallel/scripts/grad_sync.py
    ... --param h.1.mlp.c_fc.weight        # look at another parameter

Runtime on 2 cores: about 5 s at -w 2 on idle cores, two to five times that on a busy machine (10 s on heavily
loaded cores), 4 s with --smoke.

Try next
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/grad_sync.py -w 4 --param wte.weight
        -> the tied embedding/head: four ranks' gradients collapse to one average, equal to the one-process gradient
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/grad_sync.py -w 3 --batch-size 1
        -> unequal batches of 1, 2 and 3 sequences: the plain average is off by ~1e-2, the weighted one and the
           per-token loss divided by N/W only by rounding
    torchrun --nproc-per-node 2 tutorial/part2-parallelism/chapter05-data-parallel/scripts/grad_sync.py
        -> the same checks under torchrun
           (torchrun's opening warning that it set OMP_NUM_THREADS to 1 is harmless)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.data import load_splits
from mlsys.ddp import BucketedDDP, global_token_mean, rank_batches
from mlsys.launch import RankContext, launch
from mlsys.model import GPT, GPTConfig


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    batch_size: int = 4
    """Sequences of 64 tokens per rank (in the unequal case rank r has batch-size + r)."""
    param: str = "h.0.attn.c_proj.weight"
    """The parameter whose entries the figure shows."""
    entries: int = 24
    """How many of its entries the figure shows."""
    num_records: int = 1000
    """Records of the synthetic corpus to shard."""

    def validate(self) -> None:
        names = dict(GPT(GPTConfig.preset("tiny")).named_parameters())
        if self.param not in names:
            raise cli.UsageError(f"--param {self.param!r} is not a parameter of the tiny GPT (e.g. wte.weight)")
        if self.batch_size < 1 or self.entries < 1 or self.num_records < 10:
            raise cli.UsageError("--batch-size and --entries must be at least 1, --num-records at least 10")


def model_and_batches(args: Settings, tokens: torch.Tensor, world_size: int, sizes: list[int]):
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig.preset("tiny"))
    T = model.config.block_size
    return model, [rank_batches(tokens, r, world_size, sizes[r], T, args.seed, 1)[0] for r in range(world_size)]


def grads(model: GPT) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def full_batch_gradient(model: GPT, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One process, no communication: the gradient of the mean loss over every rank's batch at once."""
    x = torch.cat([b[0] for b in batches])  # (sum of n_r, T)
    y = torch.cat([b[1] for b in batches])
    model.zero_grad(set_to_none=True)
    model(x, y)[1].backward()
    return grads(model)


def weighted_average(local: dict[str, torch.Tensor], n_local: int) -> dict[str, torch.Tensor]:
    """sum_r (n_r / N) g_r: the correct average when ranks hold different numbers of tokens."""
    total = torch.tensor([float(n_local)])
    dist.all_reduce(total)  # N
    flat = torch.cat([g.flatten() for g in local.values()]) * (n_local / total.item())
    dist.all_reduce(flat)
    pieces = flat.split([g.numel() for g in local.values()])
    return {name: piece.view_as(g) for (name, g), piece in zip(local.items(), pieces)}


def per_token_recipe(args: Settings, tokens: torch.Tensor, world_size: int, sizes: list[int], rank: int,
                     divide=global_token_mean) -> dict[str, torch.Tensor]:
    """Unequal batches through an unmodified DDP wrapper: backpropagate the sum of this rank's per-token losses
    divided by N/W (`divide`), let BucketedDDP average (it divides by W), return the synchronised gradient."""
    model, batches = model_and_batches(args, tokens, world_size, sizes)
    ddp = BucketedDDP(model, bucket_mb=1.0)
    x, y = batches[rank]
    n_tokens = y.numel()  # no padding here: every target is a real token
    loss_sum = ddp(x, y)[1] * n_tokens  # the model returns the mean over its tokens
    divide(loss_sum, n_tokens).backward()
    ddp.finish_gradient_synchronization()
    return grads(model)


def gather_rows(t: torch.Tensor, world_size: int) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(out, t)
    return torch.stack(out)  # (W, len)


def worker(ctx: RankContext, args: Settings) -> dict:
    tokens, _ = load_splits(args.num_records, args.seed)
    W, k = ctx.world_size, args.entries

    model, batches = model_and_batches(args, tokens, W, [args.batch_size] * W)
    ddp = BucketedDDP(model, bucket_mb=1.0)
    x, y = batches[ctx.rank]  # this rank's own (B, T) batch
    ddp(x, y)[1].backward()
    before = grads(model)  # this rank's gradient: differs from rank to rank
    ddp.finish_gradient_synchronization()  # all-reduce: sum of g_r / W
    after = grads(model)  # the average: the same on every rank
    fresh, _ = model_and_batches(args, tokens, W, [args.batch_size] * W)  # same init, no gradients yet
    reference = full_batch_gradient(fresh, batches)  # every rank's batch, one backward, no communication

    rows = []
    for name in ("wte.weight", "wpe.weight", args.param, "h.1.mlp.c_fc.weight", "ln_f.weight"):
        norms = gather_rows(before[name].norm().reshape(1), W)[:, 0]
        row = {"parameter": name, **{f"|g| rank {r}": norms[r].item() for r in range(W)},
               "|average|": after[name].norm().item(), "|full batch|": reference[name].norm().item(),
               "max |avg - full|": (after[name] - reference[name]).abs().max().item()}
        rows.append(row)
    seqs = "sequence" if args.batch_size == 1 else "sequences"
    ctx.print(f"equal batches, {args.batch_size} {seqs} per rank, W={W}: gradient norms before the sync, "
              "after it, and from one process on the global batch")
    ctx.print(report.table(rows, ".3g"))
    worst_equal = max((after[n] - reference[n]).abs().max().item() for n in reference)
    for n in reference:
        report.expect_close(f"average of rank gradients == full-batch gradient ({n}, rank {ctx.rank})",
                            after[n], reference[n], rtol=1e-4, atol=1e-6)
    spread = gather_rows(after[args.param].flatten(), W)
    report.expect_equal("after the sync every rank holds the same gradient", spread.max(0).values,
                        spread.min(0).values)
    ctx.print(f"all {len(reference)} tensors: max |average - full batch| = {worst_equal:.2e}; "
              "identical on every rank after the sync")

    # Unequal batches: rank r holds batch_size + r sequences.
    sizes = [args.batch_size + r for r in range(W)]
    model_u, batches_u = model_and_batches(args, tokens, W, sizes)
    model_u(*batches_u[ctx.rank])[1].backward()
    local_u = grads(model_u)
    plain = {n: g.clone() / W for n, g in local_u.items()}
    for g in plain.values():
        dist.all_reduce(g)  # what DDP does: (1/W) sum_r g_r, whatever n_r is
    weighted = weighted_average(local_u, sizes[ctx.rank])
    ref_u = full_batch_gradient(model_and_batches(args, tokens, W, sizes)[0], batches_u)
    per_token = per_token_recipe(args, tokens, W, sizes, ctx.rank)
    err_plain = max((plain[n] - ref_u[n]).abs().max().item() for n in ref_u)
    err_weighted = max((weighted[n] - ref_u[n]).abs().max().item() for n in ref_u)
    err_token = max((per_token[n] - ref_u[n]).abs().max().item() for n in ref_u)
    for n in ref_u:
        report.expect_close(f"weighted average == full-batch gradient ({n})", weighted[n], ref_u[n],
                            rtol=1e-4, atol=1e-6)
        report.expect_close(f"per-token loss / (N/W) through DDP == full-batch gradient ({n})", per_token[n],
                            ref_u[n], rtol=1e-4, atol=1e-6)
    ctx.print(f"\nunequal batches {sizes}: max |plain average - full batch| = {err_plain:.2e}, "
              f"max |weighted by n_r/N - full batch| = {err_weighted:.2e}, "
              f"max |per-token loss sum / (N/W), then DDP - full batch| = {err_token:.2e}")

    per_rank = gather_rows(before[args.param].flatten()[:k], W)  # (W, k)
    if ctx.is_main:
        draw(args, per_rank, after[args.param].flatten()[:k], reference, after, plain, weighted, per_token, ref_u)
    return {"world_size": W, "rows": rows, "max_err_equal": worst_equal, "unequal_sizes": sizes,
            "max_err_plain_unequal": err_plain, "max_err_weighted_unequal": err_weighted,
            "max_err_per_token_unequal": err_token,
            "param": args.param, "before": per_rank.tolist(), "after": after[args.param].flatten()[:k].tolist(),
            "full_batch": reference[args.param].flatten()[:k].tolist()}


def draw(args: Settings, per_rank, after, reference, avg_all, plain_u, weighted_u, per_token_u, ref_u) -> None:
    plt = plot.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12.5, 4), gridspec_kw={"wspace": 0.3})
    idx = range(per_rank.shape[1])
    for r, row in enumerate(per_rank):
        left.plot(idx, row, "o", ms=4, alpha=0.7, label=f"rank {r} before sync")
    left.plot(idx, after, "-", color="black", lw=2, label="every rank after sync")
    left.plot(idx, reference[args.param].flatten()[:len(after)], "--", color="crimson", label="full batch, 1 process")
    left.set(xlabel=f"entry of {args.param}", ylabel="gradient", title="Before and after the all-reduce")
    left.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)  # below: covers no dot
    names = list(reference)
    for label, got, want, marker in (("equal batches: average", avg_all, reference, "o"),
                                     ("unequal: plain average", plain_u, ref_u, "x"),
                                     ("unequal: weighted by n_r/N", weighted_u, ref_u, "+"),
                                     ("unequal: per-token loss / (N/W), DDP", per_token_u, ref_u, "d")):
        errs = [max((got[n] - want[n]).abs().max().item(), 1e-12) for n in names]  # floor: log axis
        right.plot(range(len(names)), errs, marker, label=label)
    right.set(yscale="log", xlabel="parameter tensor (model order)", ylabel="max |synced - full batch|",
              title="Distance from the one-process gradient")
    right.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    # the file's name is the figure's caption on the script page (the lesson shows it from a -w 3 run)
    print(f"figure: {plot.save(fig, args, 'synced_gradient_vs_one_process_gradient')}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"num_records": 200, "entries": 8},
                     world_sizes=range(1, 9), world_sizes_text="1 to 8")
    results = launch(worker, args)
    if results is not None and args.json:
        report.write_json(args.json, results, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
