"""PyTorch's own sharding, checked like ours: ZeroRedundancyOptimizer (optimizer state sharded, as our stage 1) and
fully_shard (FSDP2, everything sharded, as our stage 3), the same parameters as AdamW in one process after the same
steps, and the bytes each rank holds against the formulas zero.py checks its own stages with.

What it shows
    On every rank, two runs of --steps AdamW steps of the tiny GPT, each rank on its own data shard:
      ZeroRedundancyOptimizer          torch.distributed.optim: DDP all-reduces the gradients, each rank's AdamW
                                       owns whole parameter tensors (a greedy split by size), then broadcasts them
                                       (so under DDP it moves DDP's all-reduce plus a broadcast: half as much again);
      fully_shard                      torch.distributed.fsdp (FSDP2): each block and the root module hold a dim-0
                                       shard of every parameter as a DTensor (torch.chunk: 9 rows over 4 ranks is
                                       3, 3, 3, 0), all-gathered around each use.
    Self-checks: both give the parameters of AdamW in one process on the global batch (the same oracle zero.py's
    stages meet: all but a rounding-level share of the weights within 1% of lr, see _zero_common.py). If either
    one does not run on this backend (gloo on CPU), the script says so and prints the error instead.
    Memory: the distinct storages behind each rank's parameters, gradients and AdamW state (DTensors: their local
    shard), against zero_bytes_per_rank for stage 1 and stage 3. PyTorch's optimizer shards by whole tensors, so
    its ranks are uneven; FSDP2 shards every tensor on dim 0, so its ranks are even up to padding.

How to run (world sizes 1 to 8)
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/zero_torch.py -w 2
    torchrun --nproc-per-node 2 tutorial/part2-parallelism/chapter05-data-parallel/scripts/zero_torch.py

Runtime on 2 cores: about 6 s at -w 2 on idle cores, about three times that under heavy load (18 s in a
book build on loaded cores), 5 s with --smoke.

Try next
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/zero_torch.py -w 4
        -> FSDP2's torch.chunk leaves the last rank short on the 47-row token embedding: its optimizer bytes come
           out lowest
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/zero_torch.py -w 3 --layers 2
        -> three ranks: compare the per-rank shares of both: which one comes out uneven depends on the tensor
           sizes (whole tensors for ZeroRedundancyOptimizer, torch.chunk rows for fully_shard)
    torchrun --nproc-per-node 2 tutorial/part2-parallelism/chapter05-data-parallel/scripts/zero_torch.py
        -> the same two runs and checks under torchrun
           (torchrun's opening warning that it set OMP_NUM_THREADS to 1 is harmless)
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
from _zero_common import build_model, expect_adamw_equal, make_optimizer, rank_batch, reference_adamw

from mlsys import cli, report
from mlsys.data import load_splits
from mlsys.launch import RankContext, launch
from mlsys.memory import zero_bytes_per_rank
from mlsys.model import num_params


@dataclass
class Settings(cli.DistArgs):
    world_size: int = 2
    """Number of ranks to start (1 to 8). Under torchrun it is taken from WORLD_SIZE."""
    steps: int = 4
    """AdamW steps per run."""
    layers: int = 4
    """Transformer blocks of the tiny GPT (fully_shard wraps each one)."""
    batch_size: int = 4
    """Sequences per rank per step."""
    seq_len: int = 32
    """Tokens per sequence (at most 64)."""
    lr: float = 1e-3
    """AdamW learning rate (betas 0.9, 0.95, weight decay 0.1), as in zero.py."""

    def validate(self) -> None:
        for name in ("steps", "layers", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise cli.UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.seq_len > 64:
            raise cli.UsageError(f"--seq-len must be at most the model's block size 64, got {self.seq_len}")
        if self.lr <= 0:
            raise cli.UsageError(f"--lr must be positive, got {self.lr}")


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def distinct_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        storage = local(t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def held(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    out = {"params": distinct_bytes(params), "grads": distinct_bytes(p.grad for p in params if p.grad is not None),
           "optimizer": distinct_bytes(state)}
    return {**out, "total": sum(out.values())}


def run_zero_redundancy(ctx: RankContext, args: Settings, tokens) -> dict:
    """DDP for the gradient all-reduce, ZeroRedundancyOptimizer for the sharded AdamW."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(args).to(ctx.device)
    ddp = DDP(model, gradient_as_bucket_view=True)  # grads are views of DDP's buckets: no second copy
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr,
                                  betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for step in range(args.steps):
        x, y = (t.to(ctx.device) for t in rank_batch(tokens, ctx.rank, ctx.world_size, step, args))
        _, loss = ddp(x, y)
        loss.backward()  # DDP all-reduces (averages) the gradients during the backward
        opt.step()  # this rank updates the tensors it owns, then every owner broadcasts them
        memory = held(model, opt.optim)  # opt.optim: the local AdamW over this rank's tensors only
        opt.zero_grad(set_to_none=False)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    return {"params": flat, "held": memory, "owned_tensors": len(opt.optim.state)}


# --8<-- [start:fully_shard]
def run_fully_shard(ctx: RankContext, args: Settings, tokens) -> dict:
    """FSDP2: fully_shard each block, then the root (embeddings, tied head, final LayerNorm)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_model(args).to(ctx.device)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for block in model.h:
        fully_shard(block, mesh=mesh)  # one all-gather unit per block, like our stage 3
    fully_shard(model, mesh=mesh)
    opt = make_optimizer(model.parameters(), args)  # AdamW over DTensor shards
    for step in range(args.steps):
        x, y = (t.to(ctx.device) for t in rank_batch(tokens, ctx.rank, ctx.world_size, step, args))
        _, loss = model(x, y)
        loss.backward()  # reduce-scatters (averages) each unit's gradient as its backward finishes
        opt.step()
        memory = held(model, opt)
        opt.zero_grad()
    flat = torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()]).cpu()  # check only
    return {"params": flat, "held": memory}
# --8<-- [end:fully_shard]


def attempt(name: str, fn, *fn_args) -> dict:
    """Run one PyTorch implementation; if this torch/backend refuses it, keep the error instead of crashing."""
    try:
        return fn(*fn_args)
    except Exception as err:
        lines = traceback.format_exception_only(type(err), err)
        return {"error": f"{name} did not run: {lines[-1].strip()}"}


def worker(ctx: RankContext, args: Settings) -> dict:
    W = ctx.world_size
    tokens, _ = load_splits(num_records=600, seed=args.seed)
    psi = num_params(build_model(args))
    ctx.print(f"tiny GPT: {args.layers} blocks, {psi:,} parameters; W={W} on {ctx.backend}, {args.steps} AdamW steps")
    want, _ = reference_adamw(tokens, W, args) if ctx.is_main else (None, None)
    theirs = {"ZeroRedundancyOptimizer": attempt("ZeroRedundancyOptimizer", run_zero_redundancy, ctx, args, tokens),
              "fully_shard": attempt("fully_shard", run_fully_shard, ctx, args, tokens)}
    pairs = {"ZeroRedundancyOptimizer": 1, "fully_shard": 3}  # which of our stages each one shards like
    memory = [None] * W
    dist.all_gather_object(memory, {k: v.get("held") for k, v in theirs.items()})
    if not ctx.is_main:
        return {}
    results, rows = {"world_size": W, "num_params": psi, "backend": ctx.backend}, []
    for name, stage in pairs.items():
        out = theirs[name]
        if "error" in out:
            ctx.print(f"{name}: does NOT run with {ctx.backend} on {ctx.device.type} here -- {out['error']}")
            results[name] = {"ran": False, "error": out["error"]}
            continue
        vs_adamw = (out["params"] - want).abs().max().item()
        expect_adamw_equal(f"{name} vs AdamW in one process", out["params"], want, args)
        ctx.print(f"{name}: ran on {ctx.backend}; max |param - AdamW in one process| = {vs_adamw:.2e}")
        results[name] = {"ran": True, "max_abs_diff_vs_adamw": vs_adamw, "sharded_like_stage": stage,
                         "per_rank": [m[name] for m in memory]}
    for name, stage in pairs.items():
        formula = zero_bytes_per_rank(psi, W, stage, "fp32")
        for rank, m in enumerate(memory):
            if m[name] is not None:
                rows.append({"implementation": name, "rank": rank, **{k: m[name][k] for k in formula},
                             "formula_total": round(formula["total"]),
                             "optimizer/formula": f"{m[name]['optimizer'] / formula['optimizer']:.3f}"})
    ctx.print("\nbytes each rank holds after the last step (fp32; formula: zero_bytes_per_rank for the same stage)")
    ctx.print(report.table(rows))
    results["memory"] = rows
    return results


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"steps": 2, "layers": 2}, world_sizes=range(1, 9),
                     world_sizes_text="1..8")
    result = launch(worker, args)
    if result is None:
        return 0
    ran = [k for k in ("ZeroRedundancyOptimizer", "fully_shard") if result[k]["ran"]]
    print(f"OK: {', '.join(ran) or 'neither PyTorch implementation ran'}; "
          "every one that ran matches AdamW in one process")
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
