"""The plain PyTorch recipe for data parallelism: DistributedSampler + DataLoader + DistributedDataParallel.

What it shows
    The few lines a real training script adds to a single-device loop to train data-parallel, with nothing of
    this book's own machinery in the loop:
        sampler = DistributedSampler(dataset, shuffle=True, seed=...)   # rank r gets every W-th shuffled index
        loader  = DataLoader(dataset, batch_size=B, sampler=sampler)
        model   = DistributedDataParallel(model)                        # broadcasts rank 0's weights
        for epoch: sampler.set_epoch(epoch); for x, y in loader: loss.backward(); opt.step()
    The dataset is the synthetic JSON corpus (mlsys.data) cut into fixed windows of 65 tokens; the model is the
    book's tiny GPT (mlsys.model). Prints, per epoch, how many windows each rank read and the first indices of
    its share, then the mean training loss.
    Self-checks (exit 1): in every epoch the ranks' index lists are disjoint apart from the padding the sampler
    adds when W does not divide the dataset, and together cover every window; the order changes between epochs
    (set_epoch reseeds the shuffle); after training every rank holds bit-identical parameters; the loss fell.

How to run (world sizes 1 to 8)
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/ddp_recipe.py -w 2
    torchrun --nproc-per-node 2 tutorial/part2-parallelism/chapter05-data-parallel/scripts/ddp_recipe.py

Runtime on 2 cores: about 8-14 s at -w 2 (process start-up included), 5 s with --smoke.

Try next
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/ddp_recipe.py -w 4
        -> a quarter of the windows each; where W does not divide them, the sampler repeats a few so that every
           rank runs the same number of steps (the self-check counts them)
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/ddp_recipe.py --no-set-epoch
        -> forget sampler.set_epoch: every epoch reads the same order, and the self-check says so (exit 1)
    torchrun --nproc-per-node 3 tutorial/part2-parallelism/chapter05-data-parallel/scripts/ddp_recipe.py
        -> the same program under torchrun: each rank reads a third of the windows per epoch
           (torchrun's opening warning that it set OMP_NUM_THREADS to 1 is harmless)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from mlsys import cli, report
from mlsys.data import load_splits
from mlsys.launch import RankContext, launch
from mlsys.model import GPT, GPTConfig

# Two epochs' shuffles of n windows coincide by chance with probability 1/n!: below 3e-7 from 10 windows on.
MIN_WINDOWS = 10


@dataclass
class Settings(cli.DistArgs):
    epochs: int = 3
    """Passes over the dataset."""
    batch_size: int = 8
    """Windows per rank per step (the global batch is W times this)."""
    num_records: int = 600
    """Records of the synthetic corpus to cut into windows."""
    lr: float = 3e-3
    """AdamW learning rate."""
    set_epoch: bool = True
    """Call sampler.set_epoch(epoch) before each epoch (--no-set-epoch shows what forgetting it does)."""

    def validate(self) -> None:
        for name in ("epochs", "batch_size", "num_records"):
            if getattr(self, name) < 1:
                raise cli.UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise cli.UsageError(f"--lr must be positive, got {self.lr}")
        n = len(load_splits(self.num_records, self.seed)[0]) // (GPTConfig.preset("tiny").block_size + 1)
        if n < MIN_WINDOWS:
            raise cli.UsageError(f"--num-records {self.num_records} cuts into {n} window(s); the checks need at least "
                                 f"{MIN_WINDOWS} (two shuffles of fewer coincide too often to tell set_epoch's work)")


def windows(tokens: torch.Tensor, block_size: int) -> TensorDataset:
    """Non-overlapping windows of block_size + 1 tokens: x = window[:-1], y = window[1:], each (N, T)."""
    n = len(tokens) // (block_size + 1)
    w = tokens[:n * (block_size + 1)].view(n, block_size + 1)
    return TensorDataset(w[:, :-1], w[:, 1:])


def check_epoch(ctx: RankContext, mine: list[int], n: int, epoch: int) -> list[list[int]]:
    """Every rank's indices of this epoch; checks they cover the dataset, overlapping only by the padding."""
    every = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    flat = [i for part in every for i in part]
    padding = -n % ctx.world_size  # DistributedSampler repeats the first indices to make the shares equal
    report.expect_equal(f"epoch {epoch}: windows read by all ranks", sorted(set(flat)), list(range(n)))
    report.expect_equal(f"epoch {epoch}: windows read twice (the sampler's padding)", len(flat) - n, padding)
    return every


# --8<-- [start:recipe]
def worker(ctx: RankContext, args: Settings) -> dict:
    tokens, _ = load_splits(args.num_records, args.seed)
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig.preset("tiny"))
    dataset = windows(tokens, model.config.block_size)
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's weights; backward() averages the gradients
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    rows, orders, losses = [], [], []
    for epoch in range(args.epochs):
        if args.set_epoch:
            sampler.set_epoch(epoch)  # reseeds the shuffle: without it every epoch has the same order
        total, steps = 0.0, 0
        for x, y in loader:  # x, y: (B, T) from this rank's share only
            _, loss = ddp(x.to(ctx.device), y.to(ctx.device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total, steps = total + loss.item(), steps + 1
        every = check_epoch(ctx, list(sampler), len(dataset), epoch)
        orders.append(every)  # the whole epoch's order, every rank's share: rank 0's alone can repeat by chance
        mean = torch.tensor(total / steps)
        dist.all_reduce(mean)
        losses.append(mean.item() / ctx.world_size)
        for r, part in enumerate(every):
            rows.append({"epoch": epoch, "rank": r, "windows": len(part), "steps": -(-len(part) // args.batch_size),
                         "first indices": " ".join(map(str, part[:5]))})
    # --8<-- [end:recipe]
    ctx.print(f"{len(dataset)} windows of {model.config.block_size + 1} tokens, W={ctx.world_size}, "
              f"{args.batch_size} windows per rank per step")
    ctx.print(report.table(rows))
    ctx.print("mean training loss per epoch: " + ", ".join(f"{v:.3f}" for v in losses))
    if args.epochs > 1 and orders[0] == orders[1]:
        raise cli.SelfCheckFailed("epochs 0 and 1 read the windows in the same order: call sampler.set_epoch(epoch)")
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    report.expect_equal("max |params - rank 0's params|", (flat - ref).abs().max().item(), 0.0)
    if args.epochs > 1 and not losses[-1] < losses[0]:
        raise cli.SelfCheckFailed(f"the training loss did not fall: {losses}")
    pad = -len(dataset) % ctx.world_size  # DistributedSampler repeats windows up to a multiple of W
    ctx.print(f"OK: in every epoch the {ctx.world_size} ranks together read all {len(dataset)} windows"
              + (f", {pad} of them twice (the sampler pads to a multiple of {ctx.world_size})" if pad else
                 f", none twice ({ctx.world_size} divides them, so the sampler adds no padding)")
              + ("; each epoch in a new order; the loss fell" if args.epochs > 1 else "")
              + "; every rank holds the same parameters")
    return {"num_windows": len(dataset), "epoch_losses": losses, "rows": rows}


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"epochs": 2, "num_records": 200},
                     world_sizes=range(1, 9), world_sizes_text="1 to 8")
    results = launch(worker, args)
    if results is not None and args.json:
        report.write_json(args.json, results, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
