"""Data-parallel training of the tiny GPT: every rank reads its own shard, the averaged gradients keep them in step.

What it shows
    1. The synthetic JSON corpus (mlsys.data) cut into W contiguous, disjoint shards: rank r trains only on its
       shard, drawing random windows with a generator seeded from (--seed, r).
    2. --steps steps of AdamW with the book's recipe (mlsys.train: warmup + cosine learning rate, gradient
       clipping), the gradients averaged by --ddp: torch's DistributedDataParallel, or one of the chapter's
       hand-written versions (mlsys.ddp). The global batch is W x --batch-size sequences.
    3. A loss table: each rank's own training loss (different data, so different numbers), their mean, and the
       validation loss of the shared model. Figure dp_training.png: the same curves,
       and each rank's loss minus the mean.
    4. Figure dp_step.png: step 1 on every rank, drawn from the run. Where the rank's shard (and its batch's windows)
       lie in the stream; its own gradient g_r on 12 parameter entries, from an unwrapped copy of the model with the
       same weights (torch's DDP averages inside backward(), so the wrapped model never holds g_r); the averaged
       gradient the real step used; and how the optimizer step changed those entries.
    Self-checks (exit 1 on failure): after training every rank holds bit-identical parameters, and the
    validation loss fell to at most --max-final-ratio of its starting value.

How to run (any world size from 1 to 8)
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/dp_training.py -w 2
    torchrun --nproc-per-node 2 tutorial/part2-parallelism/chapter05-data-parallel/scripts/dp_training.py
    ... -w 4 --ddp overlapped --steps 400      # the hand-written overlapped DDP on four ranks

Runtime on 2 cores: about 12 s at -w 2 on idle cores, two to five times that on a busy machine (23 s in a book build on
loaded cores), 4 s with --smoke.

Try next
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/dp_training.py -w 4 --ddp overlapped
        -> four ranks, the hand-written overlapped DDP: a global batch of 32 sequences, still identical replicas
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/dp_training.py --batch-size 2
        -> a quarter of the batch: noisier per-rank curves; compare the final validation loss with the default run
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/dp_training.py -w 1
        -> one rank, no communication: the same loop as mlsys.train, for comparison with the curves above
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

import _ddp_draw
import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.data import load_splits, shard
from mlsys.ddp import rank_batches, wrap
from mlsys.launch import RankContext, launch
from mlsys.model import GPT, GPTConfig, num_params
from mlsys.train import configure_optimizer, estimate_loss, lr_at

LEARNING_STEPS = 20  # fewest steps the learning self-check (--max-final-ratio below 1) is asked of


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    ddp: typing.Literal["torch", "naive", "bucketed", "overlapped"] = "torch"
    """How gradients are averaged: torch's DistributedDataParallel or a hand-written version from mlsys.ddp."""
    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 8
    """Sequences of 64 tokens per rank per step (the global batch is W times this)."""
    lr: float = 6e-3
    """Peak learning rate (linear warmup over the first twentieth of the steps, then cosine decay to a tenth)."""
    bucket_mb: float = 0.05
    """Bucket size in MiB for the bucketed and torch versions."""
    eval_every: int = 50
    """Steps between validation losses."""
    num_records: int = 5000
    """Records of the synthetic corpus (the stream the ranks shard)."""
    max_final_ratio: float = 0.8
    """Self-check: the final validation loss must be at most this fraction of the initial one."""

    def validate(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "num_records"):
            if getattr(self, name) < 1:
                raise cli.UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.bucket_mb <= 0 or not 0 < self.max_final_ratio <= 1:
            raise cli.UsageError("--lr and --bucket-mb must be positive and --max-final-ratio in (0, 1]")
        if self.steps < LEARNING_STEPS and self.max_final_ratio < 1:  # one rank, batch 1: 0.82x at 10, 0.71x at 20
            raise cli.UsageError(f"--steps {self.steps}: the self-check asks the loss to fall to "
                                 f"{self.max_final_ratio}x, which takes {LEARNING_STEPS} steps; "
                                 "with fewer pass --max-final-ratio 1 (it must only not rise)")
        window = GPTConfig.preset("tiny").block_size + 1
        train_tokens, val = load_splits(self.num_records, self.seed)
        if len(train_tokens) // self.world_size < window or len(val) < window:
            raise cli.UsageError(f"--num-records {self.num_records} gives each of {self.world_size} ranks "
                                 f"{len(train_tokens) // self.world_size} training tokens and {len(val)} validation "
                                 f"tokens, fewer than one window of {window}: use more records")


def describe_shards(ctx: RankContext, tokens: torch.Tensor) -> list[dict]:
    """Where each rank's shard lies in the stream; checks the shards are disjoint and cover it."""
    rows, start = [], 0
    for r in range(ctx.world_size):
        n = len(shard(tokens, r, ctx.world_size))
        rows.append({"rank": r, "first token": start, "last token": start + n - 1, "tokens": n})
        start += n
    report.expect_equal("shards cover the stream exactly once", start, len(tokens))
    return rows


def entries_of(model: GPT, entries: torch.Tensor, attr: str = "data") -> torch.Tensor:
    """The parameters' (attr="data") or gradients' (attr="grad") values at flat positions `entries`."""
    return torch.cat([getattr(p, attr).detach().flatten() for p in model.parameters()])[entries]


def first_step_probe(ctx: RankContext, model: GPT, tokens: torch.Tensor, seed: int, x: torch.Tensor,
                     y: torch.Tensor) -> dict:
    """g_r, this rank's own gradient on its first batch (x, y), which a DDP-wrapped model never holds (torch's DDP
    averages inside backward()): an unwrapped copy with the same weights computes it. Picks 12 entries for the figure
    (where the ranks' gradients differ most), and where the batch's windows start in this rank's shard."""
    twin = GPT(model.config)
    twin.load_state_dict(model.state_dict())
    twin(x, y)[1].backward()
    local = entries_of(twin, slice(None), "grad")
    every = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(every, local)  # every rank's g_r: the same entries chosen on every rank
    every = torch.stack(every)  # (W, n): where the ranks disagree most (at W = 1: the largest gradients)
    entries = (every.amax(0) - every.amin(0) + 1e-3 * every.mean(0).abs()).topk(12).indices.sort().values
    part, (b, t) = shard(tokens, ctx.rank, ctx.world_size), x.shape
    gen = torch.Generator().manual_seed(seed * 7919 + ctx.rank)  # rank_batches' generator, drawn again
    starts = torch.randint(0, len(part) - t, (b,), generator=gen)  # the same text can recur: search would mislead
    if not all(torch.equal(part[s:s + t], row) for s, row in zip(starts, x)):  # not its draws: mark no windows
        starts = torch.tensor([], dtype=torch.long)
    return {"entries": entries, "local": local[entries], "before": entries_of(model, entries),
            "starts": starts.tolist()}


# --8<-- [start:loop]
def train(ctx: RankContext, args: Settings, tokens: torch.Tensor, val: torch.Tensor) -> dict:
    torch.manual_seed(args.seed)  # the same init everywhere (the wrapper broadcasts rank 0's anyway)
    model = GPT(GPTConfig.preset("tiny"))
    ddp = wrap(args.ddp, model, args.bucket_mb)
    opt = configure_optimizer(model, args.lr, weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    batches = rank_batches(tokens, ctx.rank, ctx.world_size, args.batch_size, model.config.block_size,
                           args.seed, args.steps)  # this rank's own data: (B, T) pairs
    history = {"step": [], "rank_loss": [], "mean_loss": [], "val": [(0, estimate_loss(model, val, 8))]}
    first = first_step_probe(ctx, model, tokens, args.seed, *batches[0])  # g_r of step 1, for the figure dp_step.png
    for step, (x, y) in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup, args.lr / 10)
        opt.zero_grad(set_to_none=True)
        _, loss = ddp(x, y)  # mean over this rank's B*T tokens
        loss.backward()  # torch's DDP averages the gradients in here ...
        ddp.finish_gradient_synchronization()  # ... the hand-written ones finish here
        if step == 0:  # step 1, for the figure only: the averaged gradient on its entries ...
            first["averaged"] = entries_of(model, first["entries"], "grad")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # same grads on every rank: same clipping
        opt.step()
        if step == 0:  # ... and the parameters after the step
            first["after"] = entries_of(model, first["entries"])
        losses = torch.zeros(ctx.world_size)
        losses[ctx.rank] = loss.detach()
        dist.all_reduce(losses)  # every rank's loss, for the table (not needed for training)
        history["step"].append(step + 1)
        history["rank_loss"].append(losses.tolist())
        history["mean_loss"].append(losses.mean().item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            history["val"].append((step + 1, estimate_loss(model, val, 8)))
    return {"model": model, "first": first, **history}
# --8<-- [end:loop]


def gather_first_step(ctx: RankContext, first: dict) -> dict:
    """Every rank's step-1 record, one row per rank (the entries are the same on every rank), for the figure."""
    every: list = [None] * ctx.world_size
    dist.all_gather_object(every, {k: v.tolist() if torch.is_tensor(v) else v for k, v in first.items()})
    return {"entries": every[0]["entries"], **{k: [e[k] for e in every] for k in ("local", "averaged", "before",
                                                                                    "after", "starts")}}


def check_replicas_identical(model: GPT) -> float:
    """Largest difference between this rank's parameters and rank 0's, over all ranks (must be 0)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    worst = (flat - ref).abs().max().reshape(1)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def worker(ctx: RankContext, args: Settings) -> dict:
    tokens, val = load_splits(args.num_records, args.seed)
    shards = describe_shards(ctx, tokens)
    ctx.print(f"corpus: {len(tokens):,} training tokens in {ctx.world_size} shards")
    ctx.print(report.table(shards))
    out = train(ctx, args, tokens, val)
    model = out["model"]
    ctx.print(f"\ntiny GPT ({num_params(model):,} params), {args.steps} steps, DDP: {args.ddp}, global batch "
              f"{ctx.world_size} x {args.batch_size} x {model.config.block_size} tokens")
    val_at = dict(out["val"])
    rows = []
    for step in sorted(val_at):
        row: dict = {"step": step}
        for r in range(ctx.world_size):  # training losses exist from step 1 on
            row[f"rank {r} loss"] = out["rank_loss"][step - 1][r] if step else "-"
        row["mean"] = out["mean_loss"][step - 1] if step else "-"
        row["val loss"] = val_at[step]
        rows.append(row)
    ctx.print(report.table(rows, ".3f"))

    worst = check_replicas_identical(model)
    report.expect_equal("max |params - rank 0's params| over all ranks", worst, 0.0)
    first, last = out["val"][0][1], out["val"][-1][1]
    ctx.print(f"validation loss {first:.3f} -> {last:.3f} ({last / first:.2f}x); replicas identical on all "
              f"{ctx.world_size} ranks")
    if last > args.max_final_ratio * first:
        raise cli.SelfCheckFailed(f"validation loss only went from {first:.3f} to {last:.3f}")
    step1 = gather_first_step(ctx, out["first"])
    if ctx.is_main:
        draw(args, out, ctx.world_size)
        names = _ddp_draw.entry_names(model, step1["entries"])
        print(f"figure: {_ddp_draw.draw_dp_step(args, step1, shards, names, model.config.block_size)}")
    return {"step1": step1, "shards": shards, "val_loss": out["val"], "mean_loss": out["mean_loss"],
            "rank_loss_last": out["rank_loss"][-1], "initial_val_loss": first, "final_val_loss": last,
            "loss_ratio": last / first, "replica_max_diff": worst, "ddp": args.ddp, "num_params": num_params(model)}


def draw(args: Settings, out: dict, world_size: int) -> None:
    plt = plot.pyplot()
    fig, (ax, gap) = plt.subplots(1, 2, figsize=(12, 4))
    steps = out["step"]
    for r in range(world_size):
        own = [row[r] for row in out["rank_loss"]]
        ax.plot(steps, own, lw=1.0, alpha=0.8, label=f"rank {r} (own shard)", zorder=2)
        gap.plot(steps, [v - m for v, m in zip(own, out["mean_loss"])], lw=1.0, alpha=0.8, label=f"rank {r}")
    # the mean dashed and thin, drawn over the ranks' lines (behind them it vanished where they agree); the gaps in
    # the dashes leave the ranks' lines visible
    ax.plot(steps, out["mean_loss"], color="black", lw=0.8, ls="--", label="mean over ranks", zorder=2.5)
    val_steps, vals = zip(*out["val"])
    ax.plot(val_steps, vals, "o-", color="crimson", label="validation (the shared model)", zorder=3)
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=f"Data-parallel training on {world_size} ranks")
    ax.legend(fontsize="small")
    gap.axhline(0, color="black", lw=0.8, ls="--")
    gap.set(xlabel="step", ylabel="rank's loss - mean over ranks (nats/token)",
            title="How far each rank's own-shard loss is from the mean")
    gap.legend(fontsize="small")
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'dp_training')}")


def main() -> int:
    args = cli.parse(Settings, __doc__,
                     smoke={"steps": 40, "eval_every": 20, "num_records": 500, "max_final_ratio": 0.9},
                     world_sizes=range(1, 9), world_sizes_text="1 to 8")
    results = launch(worker, args)
    if results is not None and args.json:
        report.write_json(args.json, results, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
