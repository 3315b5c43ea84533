"""Mixed precision: compute in 16 bits, keep fp32 master weights, and send half the bytes with FSDP2.

What it shows
    1. The three formats: range and resolution of fp32, bf16 and fp16 (torch.finfo).
    2. Why fp16 needs loss scaling: the real gradients of the tiny GPT (fp32, one batch), cast to fp16 as they
       would be computed there. Some are too small for fp16 and become 0 (underflow); multiplying the loss by
       S = 2^k multiplies every gradient by S and lifts them back into range. bf16 has fp32's range: no scaling.
    3. Training, the same batches for every run on W ranks with FSDP2 (fully_shard), --steps AdamW steps:
         fp32            everything in fp32
         autocast-bf16   fp32 weights, torch.autocast runs matmuls in bf16
         autocast-fp16   the same in fp16, with torch.amp.GradScaler (dynamic loss scaling)
         fsdp-bf16       MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 master shards,
                         bf16 all-gathers and compute, fp32 gradient reduce-scatter
         fsdp-bf16-all   the same with reduce_dtype=bf16
       The bytes each collective carries are counted as the ops reach the dispatcher (the full buffer of each
       all-gather and reduce-scatter). Checked: bf16 parameters halve the all-gather bytes exactly, a bf16
       reduce_dtype halves the reduce-scatter bytes exactly, and every run's loss stays within --tolerance of
       fp32's at every step (fp16's of an fp32 run that skips the steps its GradScaler skipped on an overflow).

How to run (any world size from 1 to 8)
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/mixed_precision.py
    torchrun --nproc-per-node 2 tutorial/part2-parallelism/chapter05-data-parallel/scripts/mixed_precision.py

On a GPU (--backend nccl) the same runs use CUDA autocast; fp16 there is where loss scaling matters in practice.
Runtime on 2 cores: about 8 s at the defaults on idle cores, two to five times that on a busy machine (15 s on heavily
loaded cores), 5 s with --smoke.

Try next
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/mixed_precision.py --steps 60
        -> five times the steps: compare the largest gap with the default run's (it need not grow: the runs
           train the same way and the gap can stay where the first steps put it); it stays within the tolerance
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from _zero_common import build_model, make_optimizer, rank_batch
from torch.utils._python_dispatch import TorchDispatchMode

from mlsys import cli, plot, report
from mlsys.data import load_splits
from mlsys.launch import RankContext, launch


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 2
    """Number of ranks to start (1 to 8). Under torchrun it is taken from WORLD_SIZE."""
    steps: int = 12
    """AdamW steps per run."""
    layers: int = 4
    """Transformer blocks of the tiny GPT (fully_shard wraps each one)."""
    batch_size: int = 4
    """Sequences per rank per step."""
    seq_len: int = 32
    """Tokens per sequence (at most 64)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    tolerance: float = 0.05
    """Largest |loss - fp32 loss| accepted at any step, for every 16-bit run."""

    def validate(self) -> None:
        for name in ("steps", "layers", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise cli.UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.seq_len > 64 or self.lr <= 0 or self.tolerance <= 0:
            raise cli.UsageError("--seq-len must be at most 64, --lr and --tolerance positive")


RUNS = ("fp32", "autocast-bf16", "autocast-fp16", "fsdp-bf16", "fsdp-bf16-all")


# ----------------------------------------------------------------------------------------------- the formats
def formats() -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        info = torch.finfo(dtype)
        rows.append({"dtype": str(dtype).removeprefix("torch."), "bits": info.bits, "max": info.max,
                     "smallest normal": info.smallest_normal, "smallest subnormal": info.smallest_normal * info.eps,
                     "eps (resolution at 1)": info.eps})
    return rows


# --8<-- [start:underflow]
def underflow(grads: torch.Tensor, dtype: torch.dtype, scale: float) -> dict:
    """Of the nonzero fp32 gradients, times `scale`: the share that becomes 0 in `dtype`, that lands below its
    smallest normal (fewer significant bits), and that overflows to inf."""
    g = grads[grads != 0].double() * scale
    cast = g.to(dtype)
    info = torch.finfo(dtype)
    return {"zero": (cast == 0).double().mean().item(),
            "subnormal": ((cast != 0) & (cast.abs() < info.smallest_normal)).double().mean().item(),
            "inf": cast.isinf().double().mean().item()}
# --8<-- [end:underflow]


# ----------------------------------------------------------------------------------------------- counting bytes
class CollectiveBytes(TorchDispatchMode):
    """Counts the full buffer of every all-gather and reduce-scatter as the op reaches torch's dispatcher."""

    FULL_BUFFER = {"c10d._allgather_base_": 0, "c10d._reduce_scatter_base_": 1}  # output, resp. input

    def __init__(self) -> None:
        super().__init__()
        self.bytes = {"all_gather": 0, "reduce_scatter": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in self.FULL_BUFFER:
            t = args[self.FULL_BUFFER[name]]
            self.bytes["all_gather" if "allgather" in name else "reduce_scatter"] += t.numel() * t.element_size()
        return func(*args, **(kwargs or {}))


# --8<-- [start:runs]
def train(ctx: RankContext, args: Settings, tokens: torch.Tensor, run: str, skip: frozenset = frozenset()) -> dict:
    """One run: fully_shard every block and the root, then --steps AdamW steps on this rank's batches (none at the
    steps in `skip`). Returns the losses, the collective bytes, the loss scale at the start and at the end, and the
    steps it skipped."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    bf16, fp32 = torch.bfloat16, torch.float32
    policy = {"fsdp-bf16": MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32),
              "fsdp-bf16-all": MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)}.get(run)
    autocast = {"autocast-bf16": bf16, "autocast-fp16": torch.float16}.get(run)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    model = build_model(args).to(ctx.device)  # the same fp32 initial weights in every run
    for block in model.h:
        fully_shard(block, mesh=mesh, **({"mp_policy": policy} if policy else {}))
    fully_shard(model, mesh=mesh, **({"mp_policy": policy} if policy else {}))
    opt = make_optimizer(model.parameters(), args)  # AdamW on the fp32 shards: the master weights
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=run == "autocast-fp16")  # init_scale: 2^16 by default
    start = scaler.get_scale() if scaler.is_enabled() else 1.0
    losses, skipped, counter = [], [], CollectiveBytes()
    for step in range(args.steps):
        x, y = (t.to(ctx.device) for t in rank_batch(tokens, ctx.rank, ctx.world_size, step, args))
        with counter, torch.autocast(ctx.device.type, dtype=autocast or bf16, enabled=autocast is not None):
            _, loss = model(x, y)
            scaler.scale(loss).backward()  # times the loss scale for fp16; a no-op scale otherwise
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        if step not in skip:
            scaler.step(opt)  # unscales, skips the step if a gradient overflowed (on any rank: DTensor agrees)
            scaler.update()  # ... and then halves the scale
        opt.zero_grad()
        if step in skip or (scaler.is_enabled() and scaler.get_scale() < scale):
            skipped.append(step)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)  # the global batch's loss, for the comparison between runs
        losses.append(mean.item() / ctx.world_size)
    return {"losses": losses, "bytes": counter.bytes, "scale": scaler.get_scale() if scaler.is_enabled() else 1.0,
            "start_scale": start, "skipped": skipped}
# --8<-- [end:runs]


def worker(ctx: RankContext, args: Settings) -> dict:
    tokens, _ = load_splits(2000)
    model = build_model(args)
    x, y = rank_batch(tokens, 0, 1, 0, args)
    _, loss = model(x, y)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    under = [{"format": "fp16", "loss scale": f"2^{k}", **underflow(grads, torch.float16, 2.0**k)}
             for k in (0, 8, 16)]
    under.append({"format": "bf16", "loss scale": "2^0", **underflow(grads, torch.bfloat16, 1.0)})

    runs = {run: train(ctx, args, tokens, run) for run in RUNS}
    base = runs["fp32"]
    # A step GradScaler skipped (an overflow at the first, too large, scales: small batches have larger gradients)
    # leaves fp16 one update behind, a gap no rounding made: fp16 is compared with fp32 skipping the same steps.
    skipped = runs["autocast-fp16"]["skipped"]
    refs = {run: base for run in runs}
    if skipped:
        refs["autocast-fp16"] = train(ctx, args, tokens, "fp32", skip=frozenset(skipped))
    rows = []
    for run, r in runs.items():
        gap = max(abs(a - b) for a, b in zip(r["losses"], refs[run]["losses"], strict=True))
        rows.append({"run": run, "all_gather MiB": r["bytes"]["all_gather"] / 2**20,
                     "reduce_scatter MiB": r["bytes"]["reduce_scatter"] / 2**20,
                     "vs fp32 bytes": sum(r["bytes"].values()) / max(sum(base["bytes"].values()), 1),
                     "final loss": r["losses"][-1], "max |loss - fp32|": gap})
        report.expect_equal(f"{run}: loss within --tolerance {args.tolerance} of fp32 at every step",
                            gap <= args.tolerance, True)
    if ctx.world_size > 1:  # with one rank FSDP2 gathers nothing
        ag = {run: r["bytes"]["all_gather"] for run, r in runs.items()}
        rs = {run: r["bytes"]["reduce_scatter"] for run, r in runs.items()}
        report.expect_equal("bf16 params: all-gather bytes are half of fp32's", 2 * ag["fsdp-bf16"], ag["fp32"])
        report.expect_equal("fp32 reduce_dtype: reduce-scatter bytes as fp32's", rs["fsdp-bf16"], rs["fp32"])
        report.expect_equal("bf16 reduce_dtype: reduce-scatter bytes half", 2 * rs["fsdp-bf16-all"], rs["fp32"])

    ctx.print("formats (torch.finfo):")
    ctx.print(report.table(formats(), floatfmt=".3g"))
    ctx.print(f"\nthe {grads.numel()} gradients of one fp32 backward, cast to 16 bits: share of the nonzero ones")
    ctx.print(report.table(under, floatfmt=".2%"))
    ctx.print(f"\n{args.steps} AdamW steps on {ctx.world_size} rank(s) with FSDP2; bytes are the full buffers of "
              "every all-gather and reduce-scatter of the run")
    ctx.print(report.table(rows, floatfmt=".4g"))
    fp16 = runs["autocast-fp16"]
    ctx.print(f"autocast-fp16's dynamic loss scale: {fp16['start_scale']:g} at the start (GradScaler's default), "
              f"{fp16['scale']:g} at the end"
              + (f"; it skipped step(s) {[k + 1 for k in skipped]} (overflow), so its gap is to fp32 skipping them too"
                 if skipped else ""))
    if ctx.is_main:
        draw(args, runs, refs)
    return {"formats": formats(), "underflow": under, "runs": rows,
            "losses": {run: r["losses"] for run, r in runs.items()}, "fp16_skipped_steps": [k + 1 for k in skipped],
            "fp32_skipping_fp16_skips": refs["autocast-fp16"]["losses"],
            "fsdp_bf16_bytes_ratio": rows[3]["vs fp32 bytes"], "fsdp_bf16_all_bytes_ratio": rows[4]["vs fp32 bytes"],
            "fp16_zero_unscaled": under[0]["zero"], "fp16_subnormal_unscaled": under[0]["subnormal"],
            "fp16_zero_scaled_2_16": under[2]["zero"], "fp16_scale_start": fp16["start_scale"],
            "fp16_scale_end": fp16["scale"],
            "bf16_zero": under[3]["zero"], "max_gap": max(r["max |loss - fp32|"] for r in rows)}


def draw(args: Settings, runs: dict, refs: dict) -> None:
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    base = runs["fp32"]["losses"]
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("x", "-."), ("d", "-")]  # runs that coincide stay visible
    for k, (run, r) in enumerate((run, r) for run, r in runs.items() if run != "fp32"):
        marker, line = styles[k % len(styles)]
        ref = refs[run]["losses"]  # fp32, skipping the steps this run skipped
        ax.plot(range(1, len(base) + 1), [a - b for a, b in zip(r["losses"], ref, strict=True)], marker=marker,
                linestyle=line, markersize=9 - 2 * k, linewidth=2.4 - 0.5 * k, fillstyle="none", label=run)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set(xlabel="step", ylabel="loss - fp32 loss", title="16-bit runs against fp32, same batches and steps")
    ax.legend(fontsize=8)
    print(f"figure: {plot.save(fig, args, 'loss_gap')}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"steps": 4, "layers": 2}, world_sizes=range(1, 9),
                     world_sizes_text="1..8")
    result = launch(worker, args)
    if result is None:
        return 0
    halves = ("; bf16 parameters halve the all-gather bytes, a bf16 reduce_dtype the reduce-scatter bytes"
              if args.world_size > 1 else "")
    print(f"OK: every 16-bit run within {args.tolerance} of fp32's loss at every step{halves}")
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
