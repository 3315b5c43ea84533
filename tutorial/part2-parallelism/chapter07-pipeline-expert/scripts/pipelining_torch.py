"""Cross-check: torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B against mlsys.pipeline.

What it shows
    The same stages (mlsys.pipeline.split_gpt of the seeded tiny GPT) are wrapped in PyTorch's own
    `PipelineStage` and driven by `ScheduleGPipe` and `Schedule1F1B` (gloo on CPU, or NCCL on GPUs). Every rank
    compares the loss and its stage's gradients with three others: our GPipe, our 1F1B (run_pipeline_step), and
    the whole model in one process. PyTorch's schedules know nothing about GPT-2's tied embedding/head matrix,
    so the two copies' gradients are summed afterwards with the same `sync_tied_grads` our runner uses.

    If a part of torch.distributed.pipelining does not run here, the script says what failed and why (the
    exception, one line) instead of crashing, and still runs our schedules against the one-process oracle.

How to run (world size 2..4, at most --layers)
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/pipelining_torch.py -w 4
    torchrun --nproc-per-node 4 tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/pipelining_torch.py

Runtime on 2 cores: about 6 s with -w 4 on an idle machine (about 25 s at load 6 to 9), 4 s with --smoke.

Try next
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/pipelining_torch.py --micro-batches 2
        -> PyTorch's Schedule1F1B refuses fewer micro-batches than stages: the script prints its error, checks GPipe
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/pipelining_torch.py -w 2 --micro-batches 8
        -> two stages, eight micro-batches: both of PyTorch's schedules match ours and one process
    torchrun --nproc-per-node 4 tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/pipelining_torch.py
        -> the same cross-check under torchrun
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mlsys import cli, report
from mlsys.data import Tokenizer, get_batch, make_corpus
from mlsys.launch import RankContext, launch
from mlsys.model import GPT, GPTConfig
from mlsys.pipeline import run_pipeline_step, split_gpt, sync_tied_grads


@dataclass
class Settings(cli.DistArgs):
    world_size: int = 4
    """Number of ranks = pipeline stages. Under torchrun it is taken from WORLD_SIZE."""
    micro_batches: int = 4
    """m, micro-batches per step."""
    micro_batch_size: int = 2
    """Sequences per micro-batch."""
    layers: int = 4
    """Transformer blocks in the tiny GPT."""
    seq_len: int = 32
    """Tokens per sequence (at most 64)."""

    def validate(self) -> None:
        if self.world_size > self.layers:
            raise cli.UsageError(f"-w {self.world_size} stages need at least as many --layers, got {self.layers}")
        if min(self.micro_batches, self.micro_batch_size) < 1 or not 1 <= self.seq_len <= 64:
            raise cli.UsageError("--micro-batches and --micro-batch-size must be >= 1, --seq-len 1..64")


def build(args: Settings) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig.preset("tiny", n_layer=args.layers))
    tokens = Tokenizer().encode_corpus(make_corpus(200, args.seed))
    gen = torch.Generator().manual_seed(args.seed)
    x, y = get_batch(tokens, args.micro_batches * args.micro_batch_size, args.seq_len, gen)  # (B, T) each
    return model, x, y


def grads_of(stage: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {stage.global_name(n): p.grad.detach().clone() for n, p in stage.named_parameters()}


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())  # logits (b, T, V), target (b, T)


# --8<-- [start:torch_schedule]
def torch_step(ctx: RankContext, args: Settings, schedule_cls: type) -> tuple[dict, float | None]:
    """One step with PyTorch's schedule: rank 0 feeds the whole batch, the last rank the targets."""
    from torch.distributed.pipelining import PipelineStage

    model, x, y = build(args)
    stage = split_gpt(model, ctx.world_size)[ctx.rank]
    pipe_stage = PipelineStage(stage, ctx.rank, ctx.world_size, ctx.device)
    # scale_grads (the default) divides by m: gradients of the mean loss, like ours
    schedule = schedule_cls(pipe_stage, n_microbatches=args.micro_batches, loss_fn=loss_fn)
    losses: list = []
    if ctx.rank == 0:
        schedule.step(x.to(ctx.device))  # split into m micro-batches along dim 0
    elif ctx.rank == ctx.world_size - 1:
        schedule.step(target=y.to(ctx.device), losses=losses)
    else:
        schedule.step()
    sync_tied_grads(stage, list(range(ctx.world_size)))  # torch's stages do not know about the tie
    loss = float(torch.stack(losses).mean().detach()) if losses else None
    return grads_of(stage), loss
# --8<-- [end:torch_schedule]


def our_step(ctx: RankContext, args: Settings, schedule: str) -> tuple[dict, float | None]:
    model, x, y = build(args)
    stage = split_gpt(model, ctx.world_size)[ctx.rank]
    out = run_pipeline_step(stage, list(range(ctx.world_size)), list(x.chunk(args.micro_batches)),
                            list(y.chunk(args.micro_batches)), schedule=schedule)
    return grads_of(stage), out["loss"]


def one_process(args: Settings) -> tuple[dict, float]:
    model, x, y = build(args)
    _, loss = model(x, y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["lm_head.weight"] = grads["wte.weight"]  # tied
    return grads, float(loss.detach())


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def worker(ctx: RankContext, args: Settings) -> dict:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    ref_grads, ref_loss = one_process(args)
    ours = {name: our_step(ctx, args, name) for name in ("gpipe", "1f1b")}
    theirs, problems = {}, {}
    for name, cls in (("torch GPipe", ScheduleGPipe), ("torch 1F1B", Schedule1F1B)):
        try:
            theirs[name] = torch_step(ctx, args, cls)
        except Exception as err:
            problems[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            dist.barrier()  # the peers may be waiting inside the failed schedule; resynchronise (best effort)
    mine = {}
    for name, (grads, _) in {**ours, **theirs}.items():
        mine[name] = {"vs one process": max_diff(grads, ref_grads),
                      "vs our 1f1b": max_diff(grads, ours["1f1b"][0])}
        report.expect_close(f"{name} gradients on rank {ctx.rank}", torch.cat([g.flatten() for g in grads.values()]),
                            torch.cat([ref_grads[k].flatten() for k in grads]), rtol=1e-4, atol=1e-6)
    gathered: list = [None] * ctx.world_size
    last_losses = {name: loss for name, (_, loss) in {**ours, **theirs}.items()}
    dist.all_gather_object(gathered, {"diffs": mine, "losses": last_losses, "problems": problems})
    if not ctx.is_main:
        return {}
    results = {"reference_loss": ref_loss, "losses": gathered[-1]["losses"], "problems": gathered[0]["problems"],
               "max_grad_diff": {name: max(g["diffs"][name]["vs one process"] for g in gathered) for name in mine},
               "max_grad_diff_vs_ours": {name: max(g["diffs"][name]["vs our 1f1b"] for g in gathered)
                                         for name in mine}}
    for name, loss in results["losses"].items():
        report.expect_close(f"{name} loss", loss, ref_loss, rtol=1e-5, atol=1e-6)
    print_report(args, results)
    return results


def print_report(args: Settings, results: dict) -> None:
    print(f"p={args.world_size} stages, m={args.micro_batches} micro-batches, tiny GPT with {args.layers} blocks, "
          f"torch {torch.__version__}")
    print(f"one process on the whole batch: loss {results['reference_loss']:.6f}\n")
    rows = [{"schedule": name, "loss (last stage)": f"{loss:.6f}",
             "max|grad - one process|": results["max_grad_diff"][name],
             "max|grad - our 1f1b|": results["max_grad_diff_vs_ours"][name]}
            for name, loss in results["losses"].items()]
    print(report.table(rows))
    for name, why in results["problems"].items():
        print(f"\n{name} did not run here: {why}")
    skipped = f" ({', '.join(results['problems'])} did not run)" if results["problems"] else ""
    print(f"\n{', '.join(results['losses'])}: the same loss and gradients as one process: OK{skipped}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "micro_batches": 4},
                     world_sizes=range(2, 9), world_sizes_text="2..8")
    results = launch(worker, args)
    if args.json:
        report.write_json(args.json, results, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
