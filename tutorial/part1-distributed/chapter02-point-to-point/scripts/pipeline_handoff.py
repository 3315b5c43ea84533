"""A model split across ranks: activations go forward with send/recv, their gradients come back the same way.

What it shows
    PIPELINE  a small MLP (Linear+ReLU blocks, seeded) is cut into W stages, one per rank. Rank 0 feeds the batch;
              each stage receives its input activation from the previous rank and sends its output to the next;
              the last rank computes the loss and starts backward; each stage then receives d(loss)/d(output)
              from the next rank, backpropagates through its own layers, and sends d(loss)/d(input) to the
              previous one. The last rank's output and every parameter's gradient (gathered to rank 0) are
              compared with the same model run in one process (tolerance 1e-6). The figure is a timeline of
              the step: when each stage set up, computed, sent, or waited in a recv.

How to run (any world size >= 2; --num-blocks must be >= the world size)
    python tutorial/part1-distributed/chapter02-point-to-point/scripts/pipeline_handoff.py -w 4
    torchrun --nproc-per-node 4 tutorial/part1-distributed/chapter02-point-to-point/scripts/pipeline_handoff.py

Runtime on 2 cores: about 4 s with -w 4, 4 s with --smoke.

Try next
    python tutorial/part1-distributed/chapter02-point-to-point/scripts/pipeline_handoff.py -w 2 --num-blocks 6
        -> two stages of three blocks each; the gradients still match one process exactly
    python tutorial/part1-distributed/chapter02-point-to-point/scripts/pipeline_handoff.py -w 4 --num-blocks 3
        -> a usage error (exit 2): every stage needs at least one block
    python tutorial/part1-distributed/chapter02-point-to-point/scripts/pipeline_handoff.py --verbose
        -> each send and recv of activations and gradients traced, on every rank
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mlsys import cli, plot, report
from mlsys.launch import RankContext, launch


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 4
    """Number of ranks (= pipeline stages). Under torchrun it is taken from WORLD_SIZE."""
    num_blocks: int = 4
    """Linear(+ReLU) blocks in the MLP; split as evenly as possible across the stages."""
    hidden: int = 32
    """Width of every hidden layer."""
    batch_size: int = 8
    """Rows in the input batch."""

    def validate(self) -> None:
        if self.num_blocks < self.world_size:
            raise cli.UsageError(f"--num-blocks {self.num_blocks} must be >= the world size {self.world_size} "
                                 "(every stage needs at least one block)")
        if min(self.hidden, self.batch_size) < 1:
            raise cli.UsageError("--hidden and --batch-size must be at least 1")


IN_FEATURES, OUT_FEATURES = 16, 4


# --8<-- [start:model]
def build_model(num_blocks: int, hidden: int, seed: int) -> nn.Sequential:
    """Blocks of Linear+ReLU (the last block without ReLU): 16 -> hidden -> ... -> hidden -> 4.
    Same seed, same weights."""
    torch.manual_seed(seed)
    dims = [IN_FEATURES] + [hidden] * (num_blocks - 1) + [OUT_FEATURES]
    blocks = [nn.Sequential(nn.Linear(dims[i], dims[i + 1]), nn.ReLU()) for i in range(num_blocks - 1)]
    return nn.Sequential(*blocks, nn.Sequential(nn.Linear(dims[-2], dims[-1])))


def make_batch(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(batch_size, IN_FEATURES, generator=g), torch.randn(batch_size, OUT_FEATURES, generator=g)


def stage_blocks(num_blocks: int, stage: int, num_stages: int) -> range:
    """Contiguous, near-even split: the first num_blocks % num_stages stages get one block more."""
    base, extra = divmod(num_blocks, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))
# --8<-- [end:model]


def reference(args: Settings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole model in one process: the output and every parameter's gradient (names as in the full model)."""
    model = build_model(args.num_blocks, args.hidden, args.seed)
    x, target = make_batch(args.batch_size, args.seed)
    out = model(x)
    nn.functional.mse_loss(out, target).backward()
    return out.detach(), {name: p.grad for name, p in model.named_parameters()}


# --8<-- [start:pipeline]
def pipeline_step(ctx: RankContext, args: Settings, events: list | None = None,
                  ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """One forward + backward of this rank's stage. Returns (output on the last rank else None, local grads).
    `events`, if given, receives (what, start, end) in time.perf_counter seconds for the timeline figure, from
    the moment this call began."""
    events = [] if events is None else events
    clock = [time.perf_counter()]

    def mark(what: str) -> None:  # close the interval that began at the previous mark
        now = time.perf_counter()
        events.append((what, clock[0], now))
        clock[0] = now

    full = build_model(args.num_blocks, args.hidden, args.seed)  # every rank builds it, keeps only its blocks
    mine = stage_blocks(args.num_blocks, ctx.rank, ctx.world_size)
    stage = nn.Sequential(*[full[i] for i in mine]).to(ctx.device)  # cuda:<local rank> under nccl, else cpu
    is_first, is_last = ctx.rank == 0, ctx.rank == ctx.world_size - 1
    x, target = (t.to(ctx.device) for t in make_batch(args.batch_size, args.seed))

    mark("set-up")  # from the moment this rank entered the step: building its stage and the batch

    # forward: receive the previous stage's activation (batch, hidden), run our blocks, send the result on
    if is_first:
        inp = x
    else:
        inp = torch.empty(args.batch_size, args.hidden, device=ctx.device)
        dist.recv(inp, src=ctx.rank - 1)
        mark("waiting in recv")
        inp.requires_grad_(True)  # a leaf of this rank's graph: backward will fill inp.grad for the previous rank
    clock[0] = time.perf_counter()
    out = stage(inp)
    mark("forward")
    if not is_last:
        dist.send(out.detach(), dst=ctx.rank + 1)  # (batch, hidden)
        mark("send")

    # backward: the last stage starts from the loss; the others from the gradient the next stage sends back
    if is_last:
        nn.functional.mse_loss(out, target).backward()
        mark("backward")
    else:
        grad_out = torch.empty_like(out)  # d(loss)/d(out), (batch, hidden)
        dist.recv(grad_out, src=ctx.rank + 1)
        mark("waiting in recv")
        out.backward(grad_out)  # chain rule: continues the backward pass the next rank began
        mark("backward")
    if not is_first:
        dist.send(inp.grad, dst=ctx.rank - 1)  # d(loss)/d(inp): the previous stage's grad_out
        mark("send")

    grads = {f"{i}.{name}": p.grad for i in mine for name, p in full[i].named_parameters()}  # full-model names
    return (out.detach().cpu() if is_last else None), {k: g.cpu() for k, g in grads.items()}
# --8<-- [end:pipeline]


def worker(ctx: RankContext, args: Settings) -> dict:
    events: list = []
    pipeline_step(ctx, args)  # warm-up: a process's first backward also starts autograd's worker threads
    dist.barrier()  # start (nearly) together: the ranks leave the barrier within a few ms of each other
    out, grads = pipeline_step(ctx, args, events)
    timeline: list = [None] * ctx.world_size
    dist.all_gather_object(timeline, events)  # perf_counter is one clock for all processes of a machine
    ref_out, ref_grads = reference(args)  # every rank can compute it: same seed, same weights, same batch
    result: dict = {"stages": [list(stage_blocks(args.num_blocks, r, ctx.world_size)) for r in range(ctx.world_size)]}
    if out is not None:
        report.expect_close(f"rank {ctx.rank} forward output", out, ref_out, rtol=0, atol=1e-6)
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, {"out": None if out is None else out.tolist(),
                                      "grads": {k: v.tolist() for k, v in grads.items()}})
    all_grads = {k: torch.tensor(v) for part in gathered for k, v in part["grads"].items()}
    if ctx.rank == 0:
        report.expect_equal("parameters with a gradient", sorted(all_grads), sorted(ref_grads))
        for name, grad in all_grads.items():
            report.expect_close(f"grad of {name}", grad, ref_grads[name], rtol=0, atol=1e-6)
        result["max_abs_diff_output"] = float((torch.tensor(gathered[-1]["out"]) - ref_out).abs().max())
        result["max_abs_diff_grad"] = max(float((g - ref_grads[k]).abs().max()) for k, g in all_grads.items())
        result["num_params_checked"] = len(all_grads)
        result["timeline"] = timeline
    ctx.print_ordered(f"stage {ctx.rank}: blocks {list(stage_blocks(args.num_blocks, ctx.rank, ctx.world_size))}, "
                      f"{len(grads)} parameter gradients" + (f", output {tuple(out.shape)}" if out is not None else ""))
    return result


def draw(timeline: list[list], args: Settings) -> str:
    """One row per stage: when it computed forward or backward, sent, or waited in a recv."""
    plt = plot.pyplot()
    start = min(t0 for events in timeline for _, t0, _ in events)
    colours = {"set-up": "#e8e0f0", "forward": "C0", "backward": "C2", "send": "C1", "waiting in recv": "#cccccc"}
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.5 * len(timeline)))
    for rank, events in enumerate(timeline):
        for what, t0, t1 in events:
            ax.barh(rank, 1e3 * (t1 - t0), left=1e3 * (t0 - start), color=colours[what], edgecolor="none")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()], labels=list(colours),
              loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5, fontsize=8)
    ax.set_yticks(range(len(timeline)), [f"stage {r} (rank {r})" for r in range(len(timeline))])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first rank left the barrier before the step (each row starts when its rank left it)")
    ax.set_title("One forward and backward through the pipeline: what each stage was doing")
    return str(plot.save(fig, args, "timeline"))


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "hidden": 8},
                     world_sizes=lambda w: w >= 2, world_sizes_text=">= 2")
    result = launch(worker, args)
    if result is None:
        return 0
    print(f"pipeline vs one process: max |output diff| = {result['max_abs_diff_output']:.2e}, "
          f"max |grad diff| = {result['max_abs_diff_grad']:.2e} over {result['num_params_checked']} "
          "parameter tensors (a weight and a bias per Linear)")
    print(f"figure: {draw(result.pop('timeline'), args)}")
    print("OK: the pipelined forward and backward match the single-process model")
    if args.json:
        report.write_json(args.json, {"ok": True, **result}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
