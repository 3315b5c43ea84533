"""Communicating less often: local SGD and DiLoCo against synchronous data parallelism.

What it shows
    Every rank trains the same tiny GPT on its own shard of the data for --steps steps of AdamW, three ways:
      sync     data parallelism as in the rest of this chapter: all-reduce the gradients at every step
      local    local SGD (periodic averaging): each rank takes --sync-every (H) steps on its own, then the ranks
               average their parameters with one all-reduce
      diloco   DiLoCo: the same H local AdamW steps (the inner optimizer), then the averaged change of the
               parameters is treated as a gradient for an outer SGD step with Nesterov momentum
               (lr 0.7, momentum 0.9, as in Douillard et al., https://arxiv.org/abs/2311.08105)
    It counts the bytes each run all-reduces, evaluates the averaged model on held-out data after every round of
    H steps, and draws the validation loss against the bytes. It also keeps every rank's weights after every
    optimizer step, and right after each synchronisation, and measures how far each rank is from the ranks' mean,
    ||theta_r - mean_r theta|| (one gather after each run, a measurement not counted in the bytes): figure
    replica_drift.png draws that distance per run and rank, with a line at every all-reduce the run makes.
    Checked first: with plain SGD and H = 1, averaging the parameters after every step gives the same weights as
    averaging the gradients (to rounding). Checked in every DiLoCo round: the hand-written outer step gives the
    same weights as torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True) stepping a copy of the outer weights
    with the same outer gradient (to rounding).

How to run (any world size from 1 to 8)
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/local_sgd.py
    torchrun --nproc-per-node 2 tutorial/part2-parallelism/chapter05-data-parallel/scripts/local_sgd.py

Runtime on 2 cores: about 5 s at the defaults on idle cores, two to five times that on a busy machine (11 s on heavily
loaded cores), 5 s with --smoke.

Try next
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/local_sgd.py --sync-every 30
        -> 30 times fewer bytes than sync; how much validation loss does it cost now?
"""

from __future__ import annotations

from dataclasses import dataclass

import _ddp_draw
import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.data import get_batch, load_splits, shard
from mlsys.launch import RankContext, launch
from mlsys.model import GPT, GPTConfig


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 2
    """Number of ranks to start (1 to 8). Under torchrun it is taken from WORLD_SIZE."""
    steps: int = 60
    """Training steps per run (inner steps for local and diloco)."""
    sync_every: int = 10
    """H: local steps between two synchronisations of local and diloco (must divide --steps)."""
    batch_size: int = 8
    """Sequences per rank per step."""
    seq_len: int = 32
    """Tokens per sequence (at most 64)."""
    lr: float = 3e-3
    """AdamW learning rate (the inner optimizer of local and diloco)."""

    def validate(self) -> None:
        if min(self.steps, self.sync_every, self.batch_size, self.seq_len) < 1 or self.steps % self.sync_every:
            raise cli.UsageError(f"--sync-every must be >= 1 and divide --steps {self.steps}, got {self.sync_every}")
        if self.seq_len > 64 or self.lr <= 0:
            raise cli.UsageError("--seq-len must be at most 64 and --lr positive")


RUNS = ("sync", "local", "diloco")


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@torch.no_grad()
def load_flat(model: torch.nn.Module, vector: torch.Tensor) -> None:
    """Copy `vector` into the parameters (a copy: the model must not alias the caller's buffer)."""
    start = 0
    for p in model.parameters():
        p.copy_(vector[start:start + p.numel()].view_as(p))
        start += p.numel()


OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


# --8<-- [start:outer]
def outer_step(global_params: torch.Tensor, buffer: torch.Tensor, delta: torch.Tensor) -> None:
    """DiLoCo's outer step, in place: SGD with Nesterov momentum on the outer gradient `delta`."""
    buffer.mul_(OUTER_MOMENTUM).add_(delta)  # momentum; torch starts it at the first gradient, as this does from 0
    global_params -= OUTER_LR * (delta + OUTER_MOMENTUM * buffer)  # Nesterov: step along g + mu * buffer
# --8<-- [end:outer]


def torch_outer_optimizer(global_params: torch.Tensor) -> tuple[torch.Tensor, torch.optim.SGD]:
    """The oracle for outer_step: a copy of the outer weights and torch's own Nesterov SGD over it."""
    copy = torch.nn.Parameter(global_params.clone())
    return copy, torch.optim.SGD([copy], lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)


def replica_drift(seen: dict, sync_steps: list[int]) -> dict | None:
    """||theta_r - mean over ranks of theta|| for every rank r and every weight vector in `seen` (lists of flat
    weights: after each step, after each averaging). A measurement for the figure, on rank 0 (None elsewhere): one
    gather after the run, left out of the runs' byte counts (they count only the all-reduces training needs)."""
    mine = torch.stack(seen["after_step"] + seen["after_sync"])  # (S, n)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather(mine, every, dst=0)
    if every is None:
        return None
    stack = torch.stack(every)  # (W, S, n)
    dist_at = [(w - w.mean(0)).norm(dim=1).tolist() for w in stack.double().unbind(1)]  # float64: 0 stays 0
    return {"after_step": dist_at[:len(seen["after_step"])], "sync_steps": sync_steps,
            "after_sync": dist_at[len(seen["after_step"]):]}


def mean_all_reduce(t: torch.Tensor, sent: list[int]) -> torch.Tensor:
    """All-reduce and divide by W; adds the buffer's bytes to sent[0]."""
    dist.all_reduce(t)
    sent[0] += t.numel() * t.element_size()
    return t.div_(dist.get_world_size())


# --8<-- [start:rounds]
def train(ctx: RankContext, args: Settings, tokens, val, run: str) -> dict:
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig.preset("tiny", n_layer=2))  # the same initial weights on every rank and in every run
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    global_params = flat(model)  # diloco's outer weights, and what every rank starts a round from
    outer_buffer = torch.zeros_like(global_params)  # Nesterov momentum of the outer step
    oracle, oracle_opt = torch_outer_optimizer(global_params)  # checks every outer step
    sent, curve = [0], []
    seen, sync_steps = {"after_step": [], "after_sync": []}, []  # weights for the drift figure (not sent)
    gen = torch.Generator().manual_seed(args.seed * 7 + ctx.rank)
    for step in range(1, args.steps + 1):
        x, y = get_batch(tokens, args.batch_size, args.seq_len, gen)
        _, loss = model(x, y)
        inner.zero_grad()
        loss.backward()
        if run == "sync":  # average the gradients every step: the same update on every rank
            grads = mean_all_reduce(torch.cat([p.grad.flatten() for p in model.parameters()]), sent)
            torch.nn.utils.vector_to_parameters(grads, [p.grad for p in model.parameters()])
        inner.step()
        seen["after_step"].append(flat(model))  # kept for the drift figure, measured after the run
        if step % args.sync_every:
            continue
        if run == "local":  # average the parameters every H steps
            load_flat(model, mean_all_reduce(flat(model), sent))
        elif run == "diloco":  # the averaged change is the outer gradient
            delta = global_params - mean_all_reduce(flat(model), sent)
            outer_step(global_params, outer_buffer, delta)  # SGD, Nesterov momentum 0.9, lr 0.7
            oracle.grad = delta.clone()
            oracle_opt.step()
            report.expect_close(f"diloco outer step {step // args.sync_every} == torch SGD(nesterov=True)",
                                global_params, oracle.detach(), rtol=1e-6, atol=1e-7)
            load_flat(model, global_params)
        if run != "sync":  # again after the averaging (sync averages gradients, never the parameters)
            seen["after_sync"].append(flat(model))
            sync_steps.append(step)
        curve.append({"step": step, "bytes": sent[0], "val_loss": evaluate(model, val, args)})
    return {"curve": curve, "bytes": sent[0], "params": flat(model), "drift": replica_drift(seen, sync_steps)}
# --8<-- [end:rounds]


@torch.no_grad()
def evaluate(model: GPT, val: torch.Tensor, args: Settings) -> float:
    x, y = get_batch(val, 32, args.seq_len, torch.Generator().manual_seed(12345))  # the same batch every time
    return model(x, y)[1].item()


def averaging_identity(ctx: RankContext, tokens) -> float:
    """Plain SGD, H = 1: averaging parameters after each step vs averaging gradients before it. Max |difference|."""
    results = []
    for average in ("grads", "params"):
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("tiny", n_layer=1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(ctx.rank)
        for _ in range(3):
            x, y = get_batch(tokens, 2, 16, gen)
            opt.zero_grad()
            model(x, y)[1].backward()
            if average == "grads":
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= ctx.world_size
            opt.step()
            if average == "params":
                load_flat(model, mean_all_reduce(flat(model), [0]))
        results.append(flat(model))
    return (results[0] - results[1]).abs().max().item()


def worker(ctx: RankContext, args: Settings) -> dict:
    train_tokens, val = load_splits(4000)
    tokens = shard(train_tokens, ctx.rank, ctx.world_size)
    gap = averaging_identity(ctx, tokens)
    report.expect_close("SGD, H=1: parameter averaging == gradient averaging", gap, 0.0, rtol=0, atol=1e-5)
    runs = {run: train(ctx, args, tokens, val, run) for run in RUNS}
    for run, r in runs.items():  # after a synchronisation every rank holds the same weights
        first = r["params"].clone()
        dist.broadcast(first, src=0)
        report.expect_close(f"{run}: the replicas agree after the last synchronisation", r["params"], first,
                            rtol=0, atol=1e-6)
    sync_bytes = runs["sync"]["bytes"]
    rows = [{"run": run, "all-reduces": len(r["curve"]) if run != "sync" else args.steps,
             "MiB all-reduced per rank": r["bytes"] / 2**20, "vs sync": r["bytes"] / max(sync_bytes, 1),
             "final val loss": r["curve"][-1]["val_loss"]} for run, r in runs.items()]
    ctx.print(f"{args.steps} steps of AdamW on {ctx.world_size} rank(s), H = {args.sync_every} local steps between "
              f"synchronisations (SGD with H = 1 matched gradient averaging to {gap:.1e})")
    ctx.print(report.table(rows, floatfmt=".4g"))
    ctx.print("validation loss after each round: " + "; ".join(
        f"{run} " + " ".join(f"{c['val_loss']:.3f}" for c in r["curve"]) for run, r in runs.items()))
    if ctx.world_size == 1:
        ctx.print("W = 1: one replica, so nothing can drift: every distance in replica_drift.png is 0")
    if ctx.is_main:
        print(f"figure: {_ddp_draw.draw_drift(args, {run: r['drift'] for run, r in runs.items()})}")
        draw(args, runs)
    return {"rows": rows, "identity_gap": gap, "curves": {run: r["curve"] for run, r in runs.items()},
            "drift": {run: r["drift"] for run, r in runs.items()},
            "bytes_ratio_local": rows[1]["vs sync"],
            "val_loss": {run: r["curve"][-1]["val_loss"] for run, r in runs.items()}}


def draw(args: Settings, runs: dict) -> None:
    plt = plot.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for run, r in runs.items():
        steps = [c["step"] for c in r["curve"]]
        axes[0].plot(steps, [c["val_loss"] for c in r["curve"]], marker="o", label=run)
        axes[1].plot([c["bytes"] / 2**20 for c in r["curve"]], [c["val_loss"] for c in r["curve"]], marker="o",
                     label=run)
    axes[0].set(xlabel="step", ylabel="validation loss", title=f"every {args.sync_every} steps")
    axes[1].set(xlabel="MiB all-reduced per rank", ylabel="validation loss", title="against bytes sent")
    axes[1].legend()
    print(f"figure: {plot.save(fig, args, 'loss_vs_bytes')}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"steps": 8, "sync_every": 4}, world_sizes=range(1, 9),
                     world_sizes_text="1..8")
    result = launch(worker, args)
    if result is None:
        return 0
    print("OK: parameter averaging matched gradient averaging (SGD, H=1); DiLoCo's outer steps matched torch's "
          "Nesterov SGD; replicas agree after every run")
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
