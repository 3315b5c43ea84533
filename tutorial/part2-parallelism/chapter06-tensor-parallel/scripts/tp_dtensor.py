"""Cross-check: our column/row layers against PyTorch's own tensor-parallel API (DTensor), on gloo.

What it shows
    The same dense layers are split two ways on the same ranks: by mlsys.tensor_parallel, and by
    torch.distributed.tensor.parallel.parallelize_module over a 1-D device mesh (init_device_mesh("cpu", (t,))).
    1. the Megatron MLP: c_fc ColwiseParallel(), c_proj RowwiseParallel() against TPMLP;
    2. the MLP with sequence parallelism: ColwiseParallel(input_layouts=Shard(1)) and
       RowwiseParallel(output_layouts=Shard(1)) against TPMLP(sequence_parallel=True) on the rank's sequence shard;
    3. a head: ColwiseParallel(output_layouts=Replicate()) against ColumnParallelLinear(gather_output=True).
    Outputs, input gradients and every weight/bias gradient (DTensor shards via to_local, replicated ones via
    full_tensor) must agree to float32 rounding.

How to run
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_dtensor.py -w 2
    torchrun --nproc-per-node 4 tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_dtensor.py

Prints one line per compared tensor with its max abs difference. Runtime on 2 cores: about 4 s; --smoke 3 s.

Try next
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_dtensor.py -w 4
        -> a 4-way split: each DTensor's local shard (to_local) is a quarter of the dense weight; still rounding only
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_dtensor.py -w 3
        -> 32 tokens, 64 features and 48 vocabulary rows do not all divide by 3: a one-line usage error, exit 2
    torchrun --nproc-per-node 2 tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_dtensor.py --hidden 128
        -> the same comparison under torchrun, with a wider MLP
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlsys import cli, report
from mlsys.launch import RankContext, launch
from mlsys.model import MLP, GPTConfig
from mlsys.tensor_parallel import TPMLP, ColumnParallelLinear


@dataclass
class Settings(cli.DistArgs):
    batch: int = 2
    """Sequences in the batch."""
    seq: int = 32
    """Tokens per sequence; must be divisible by the world size (sequence parallelism)."""
    hidden: int = 64
    """Model width C; must be divisible by the world size."""
    vocab: int = 48
    """Output features of the head; must be divisible by the world size."""

    def validate(self) -> None:
        for name in ("batch", "seq", "hidden", "vocab"):
            value = getattr(self, name)
            if value < 1:
                raise cli.UsageError(f"--{name} must be at least 1, got {value}")
            if name != "batch" and value % self.world_size:
                raise cli.UsageError(f"--{name} {value} is not divisible by the tensor-parallel size "
                                     f"{self.world_size}")


def local(dt: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (plain tensors pass through)."""
    return dt.to_local() if hasattr(dt, "to_local") else dt


def full(dt: torch.Tensor) -> torch.Tensor:
    """A replicated (or partial) DTensor as one plain tensor."""
    return dt.full_tensor() if hasattr(dt, "full_tensor") else dt


def compare(rows: list[dict], case: str, name: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
    ours, theirs = ours.detach(), torch.as_tensor(theirs).detach()
    report.expect_close(f"{case}: {name}", ours, theirs, rtol=1e-5, atol=1e-6)
    rows.append({"case": case, "tensor": name, "shape": "x".join(map(str, ours.shape)),
                 "max_abs_diff": float((ours - theirs).abs().max())})


# --8<-- [start:dtensor_mlp]
def mlp_case(dense: MLP, mesh, x: torch.Tensor, sequence_parallel: bool, rows: list[dict]) -> None:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    t, r = mesh.size(), mesh.get_local_rank()
    theirs = copy.deepcopy(dense)
    if sequence_parallel:  # input arrives split along the sequence (dim 1); output leaves split the same way
        plan = {"c_fc": ColwiseParallel(input_layouts=Shard(1)), "c_proj": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan = {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()}
    parallelize_module(theirs, mesh, plan)
    ours = TPMLP(dense, dist.group.WORLD, sequence_parallel=sequence_parallel)

    x_in = x.chunk(t, dim=1)[r] if sequence_parallel else x  # (B, T/t, C) or (B, T, C)
    x_ours, x_theirs = x_in.clone().requires_grad_(True), x_in.clone().requires_grad_(True)
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    y_ours.square().sum().backward()
    y_theirs.square().sum().backward()
    case = "MLP + SP" if sequence_parallel else "MLP"
    compare(rows, case, "output", y_ours, y_theirs)
    compare(rows, case, "input grad", x_ours.grad, x_theirs.grad)
    compare(rows, case, "c_fc.weight grad (shard)", ours.c_fc.weight.grad, local(theirs.c_fc.weight.grad))
    compare(rows, case, "c_fc.bias grad (shard)", ours.c_fc.bias.grad, local(theirs.c_fc.bias.grad))
    compare(rows, case, "c_proj.weight grad (shard)", ours.c_proj.weight.grad, local(theirs.c_proj.weight.grad))
    compare(rows, case, "c_proj.bias grad", ours.c_proj.bias.grad, full(theirs.c_proj.bias.grad))
# --8<-- [end:dtensor_mlp]


def head_case(mesh, x: torch.Tensor, vocab: int, rows: list[dict]) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    dense = torch.nn.Linear(x.shape[-1], vocab, bias=False).to(x.device)
    theirs = copy.deepcopy(dense)
    parallelize_module(theirs, mesh, ColwiseParallel(output_layouts=Replicate()))
    ours = ColumnParallelLinear.from_dense(dense, dist.group.WORLD, gather_output=True)
    x_ours, x_theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)  # full (B, T, V) logits on every rank
    y_ours.logsumexp(-1).sum().backward()
    y_theirs.logsumexp(-1).sum().backward()
    compare(rows, "head", "logits (gathered)", y_ours, y_theirs)
    compare(rows, "head", "input grad", x_ours.grad, x_theirs.grad)
    compare(rows, "head", "weight grad (shard)", ours.weight.grad, local(theirs.weight.grad))


def worker(ctx: RankContext, args: Settings) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))  # "cpu" with gloo, "cuda" with nccl
    torch.manual_seed(args.seed)
    dense = MLP(GPTConfig(n_embd=args.hidden, n_head=1, vocab_size=8)).to(ctx.device)
    x = torch.randn(args.batch, args.seq, args.hidden).to(ctx.device)
    rows: list[dict] = []
    mlp_case(dense, mesh, x, False, rows)
    mlp_case(dense, mesh, x, True, rows)
    head_case(mesh, x, args.vocab, rows)
    ctx.print(f"t={ctx.world_size} on {ctx.backend}: mlsys.tensor_parallel against torch DTensor "
              f"(parallelize_module); x is ({args.batch}, {args.seq}, {args.hidden})")
    ctx.print(report.table(rows, floatfmt=".1e"))
    return {"tp": ctx.world_size, "checks": rows, "max_abs_diff": max(r["max_abs_diff"] for r in rows)}


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "seq": 8, "hidden": 16, "vocab": 8},
                     world_sizes=range(1, 9), world_sizes_text="1..8 (dividing --seq, --hidden and --vocab)")
    result = launch(worker, args)
    if result is None:
        return 0
    print(f"OK: {len(result['checks'])} tensors agree with torch's DTensor tensor parallelism "
          f"(max abs difference {result['max_abs_diff']:.1e})")
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
