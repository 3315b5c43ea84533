"""ZeRO stages 1, 2 and 3 from scratch over torch.distributed, checked against plain AdamW, with memory measured.

What it shows
    Every rank trains the book's tiny GPT (mlsys.model) on its own shard of the data, four ways:
      stage 0  plain data parallel: all-reduce the gradients, every rank runs AdamW on everything;
      stage 1  optimizer state sharded: reduce-scatter the gradients, each rank updates its 1/W slice of the
               parameters with its 1/W of the Adam state, then all-gather the parameters;
      stage 2  + gradients sharded: after the reduce-scatter a rank keeps only its slice of the gradient;
      stage 3  + parameters sharded: a rank keeps 1/W of the weights and all-gathers one layer at a time for the
               forward and again for the backward, freeing it after use; gradients are reduce-scattered per layer.
    All parameters of a unit are flattened into ONE buffer padded to a multiple of W, so "rank r's slice" is the
    contiguous range [r*S, (r+1)*S) with S = padded/W (stages 0-2: one unit, the whole model; stage 3: one unit per
    transformer block plus a root unit holding the embeddings and the final LayerNorm).
    Self-checks: after --steps AdamW steps, every stage in fp32 gives the same parameters as torch.optim.AdamW in ONE
    process on the global batch (max |diff| <= lr/100, a hundredth of one step). Every stage in mixed precision
    gives the same fp32 master weights as the same bf16 recipe run in ONE process (bf16 gradients of each rank's
    batch, summed in fp32, AdamW on an fp32 master copy): within (W-1) x 2^-8 x steps of lr, the most that summing
    W bf16 gradients in another precision can move an Adam step (_zero_common.mixed_step_fraction).
    Memory: the bytes each rank really holds (the storages of its parameter, gradient and optimizer tensors) against
    zero_bytes_per_rank's 16 bytes/parameter accounting, in fp32 (4 + 4 + 8) and in mixed precision (bf16 params
    and grads, fp32 master + Adam m, v: 2 + 2 + 12), within 10%. The table also shows the transient peak (a
    gathered layer, a full gradient before its reduce-scatter) and the bytes each rank sends per step.
    The memory table has one row per stage and precision (the busiest rank's bytes by kind, and the largest
    distance of any kind from its formula); figure zero_memory.png draws the same bytes as stacked bars. A second
    table has one row per run (bytes sent per step, the distance from its oracle), a third the details
    of the check (the distance from fp32 AdamW, the shares of weights beyond the bf16 bound).
    Reading the third table: beyond_vs_adamw is the share of weights beyond the same bf16 bound measured from fp32
    AdamW instead of the bf16 oracle; the bf16 recipe alone moves more than the 1% allowed that far (it changes with
    W and the steps), so only the bf16 oracle tells a correct mixed stage from a wrong one. The max-abs columns
    (diff_vs_oracle, diff_vs_adamw) are set by the few weights outside the bound, where the ranks' gradients nearly
    cancel and Adam turns the sum's large relative error into a step of its own, so a mixed row's diff_vs_oracle can
    exceed its diff_vs_adamw while the stage passes. Stage 3's diff_vs_first_stage is not zero: it reduce-scatters
    each unit's buffer on its own, so gloo adds the ranks' gradients in another order.
    Pictures of the sharding, from what the ranks really held: zero_grid.png (per stage, which elements of the flat
    parameters, gradients and Adam state each rank keeps between steps) and zero_step.gif with its static strip
    zero_step_strip.png (stage 2's first step moment by moment: backward, reduce-scatter, update, all-gather).

How to run (world sizes 1 to 8)
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/zero.py -w 4
    torchrun --nproc-per-node 4 tutorial/part2-parallelism/chapter05-data-parallel/scripts/zero.py
    add --stages 3 --precisions fp32 to run one variant

Runtime on 2 cores: about 10 s at -w 4 (process start-up and the single-process reference included) on idle cores,
two to five times that on a busy machine (23 s on heavily loaded cores), 4-5 s --smoke.

Try next
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/zero.py -w 8 --precisions mixed
        -> between steps stage 3 holds 1/8 of everything (its peak during a step is higher); the optimizer bar
           of stages 1-3 shrinks to 1/8 of stage 0's
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/zero.py -w 2 --layers 12 --stages 0 3
        -> more blocks: stage 3's peak (root unit + one gathered block) becomes a smaller share of the model
    python -c "import mlsys.memory as m; print([m.zero_bytes_per_rank(7e9, 8, s)['total'] / 2**30 for s in range(4)])"
        -> the same formula for a 7B model on 8 ranks, in GiB per rank at stages 0-3 (the run's last line rounds
           them to one decimal: 104.3, 35.9, 24.4, 13.0)
    torchrun --nproc-per-node 4 tutorial/part2-parallelism/chapter05-data-parallel/scripts/zero.py --stages 3
        -> stage 3 alone under torchrun; the same self-checks
           (torchrun's opening warning that it set OMP_NUM_THREADS to 1 is harmless)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _zero_common import (
    build_model,
    draw_grid,
    draw_memory,
    draw_step,
    expect_adamw_equal,
    expect_mixed_equal,
    make_optimizer,
    memory_summary,
    mixed_step_fraction,
    rank_batch,
    reference_adamw,
    reference_mixed,
)

from mlsys import cli, report
from mlsys.collectives import comm_volume
from mlsys.data import load_splits
from mlsys.launch import RankContext, launch
from mlsys.memory import zero_bytes_per_rank
from mlsys.model import GPT, num_params

# torch 2.13 names the flat-buffer collectives *_single; older releases call them *_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
DTYPES = {"fp32": torch.float32, "mixed": torch.bfloat16}  # the dtype of the parameters and gradients
TOLERANCE = 0.10  # measured bytes within 10% of the formula


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 4
    """Number of ranks to start (1 to 8). Under torchrun it is taken from WORLD_SIZE."""
    stages: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    """ZeRO stages to run (0 is plain data parallel, the baseline)."""
    precisions: list[str] = field(default_factory=lambda: ["fp32", "mixed"])
    """fp32 (checked against AdamW exactly) and/or mixed (bf16 params/grads, fp32 master; measured)."""
    steps: int = 4
    """AdamW steps per run."""
    layers: int = 4
    """Transformer blocks of the tiny GPT (stage 3 gathers one at a time)."""
    batch_size: int = 4
    """Sequences per rank per step (the global batch is W times this)."""
    seq_len: int = 32
    """Tokens per sequence."""
    lr: float = 1e-3
    """AdamW learning rate (betas 0.9, 0.95, weight decay 0.1)."""

    def validate(self) -> None:
        for name in ("steps", "layers", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise cli.UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if bad := [s for s in self.stages if s not in (0, 1, 2, 3)]:
            raise cli.UsageError(f"--stages takes 0, 1, 2, 3; got {bad}")
        if bad := [p for p in self.precisions if p not in DTYPES]:
            raise cli.UsageError(f"--precisions takes fp32 and mixed; got {bad}")
        if self.seq_len > 64:
            raise cli.UsageError(f"--seq-len must be at most the model's block size 64, got {self.seq_len}")
        if self.lr <= 0:
            raise cli.UsageError(f"--lr must be positive, got {self.lr}")


# ----------------------------------------------------------------------------------------------- model and data
# ----------------------------------------------------------------------------------------------- the flat unit
# --8<-- [start:flat]
def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """(padded, lo, hi): pad numel up to a multiple of W; rank r owns the flat range [lo, hi) of size padded/W."""
    padded = math.ceil(numel / world_size) * world_size
    size = padded // world_size
    return padded, rank * size, (rank + 1) * size


class FlatUnit:
    """The parameters of one unit flattened into one padded buffer, of which this rank owns [lo, hi).

    full        (padded,) param dtype; the model's parameters are views into it. Stage 3 frees it between uses.
    shard       (S,) this rank's slice: a view of `full` in stages 0-2, its own persistent tensor in stage 3.
    master      (S,) fp32 nn.Parameter that AdamW updates: `shard` itself in fp32, a separate copy in mixed.
    grad_full   (padded,) param dtype; the .grad of every parameter is a view into it while it exists.
    grad_shard  (S,) this rank's reduced gradient (stage 0/1: a view of grad_full; stage 2/3: its own tensor).
    """

    def __init__(self, params: list[nn.Parameter], stage: int, world_size: int, rank: int, dtype: torch.dtype):
        self.params, self.stage, self.dtype = params, stage, dtype
        self.world = world_size if stage >= 1 else 1  # stage 0 shards nothing: one "shard" is everything
        self.numel = sum(p.numel() for p in params)
        self.padded, self.lo, self.hi = shard_bounds(self.numel, self.world, rank if stage >= 1 else 0)
        self.device = params[0].device
        self.full = torch.zeros(self.padded, dtype=dtype, device=self.device)
        self.full[:self.numel].copy_(torch.cat([p.detach().flatten() for p in params]))
        offset = 0
        for p in params:  # re-point each parameter at its place in the flat buffer (DDP does the same for grads)
            p.data = self.full[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.shard = self.full[self.lo:self.hi].clone() if stage == 3 else self.full[self.lo:self.hi]
        fp32 = self.shard.dtype == torch.float32
        self.master = nn.Parameter(self.shard if fp32 else self.shard.float())  # fp32: shares shard's storage
        self.grad_full: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        if stage == 3:
            self.free()
        if stage <= 1:
            self.alloc_grads()  # stages 0 and 1 keep a full gradient buffer for the whole run
        if stage >= 2:
            self.grad_shard = torch.zeros(self.hi - self.lo, dtype=dtype, device=self.device)
# --8<-- [end:flat]

    def gather(self, comm: CommLog) -> None:
        """Stage 3: re-allocate the full buffer and all-gather every rank's shard into it (the views come back)."""
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        comm.call("all_gather", ALL_GATHER, self.full, self.shard)

    def free(self) -> None:
        """Stage 3: drop the full buffer's memory; the parameters keep their (now empty) views."""
        self.full.untyped_storage().resize_(0)

    def alloc_grads(self) -> None:
        self.grad_full = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        offset = 0
        for p in self.params:  # autograd accumulates into an existing .grad in place: straight into grad_full
            p.grad = self.grad_full[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    # --8<-- [start:reduce]
    def reduce_grads(self, comm: CommLog) -> None:
        """Sum the gradient over ranks into grad_shard. Stage 0 all-reduces; 1-3 reduce-scatter (each rank gets
        only its slice, half the bytes of an all-reduce); stages 2 and 3 then drop the full gradient."""
        if self.stage == 0:
            comm.call("all_reduce", dist.all_reduce, self.grad_full)
            self.grad_shard = self.grad_full
            return
        if self.stage == 1:  # stage 1 keeps the full-size buffer; only its own slice is meaningful afterwards
            mine = torch.empty(self.hi - self.lo, dtype=self.dtype, device=self.device)
            comm.call("reduce_scatter", REDUCE_SCATTER, mine, self.grad_full)  # in: (padded,), out: (S,)
            self.grad_shard = self.grad_full[self.lo:self.hi]
            self.grad_shard.copy_(mine)
        else:
            comm.call("reduce_scatter", REDUCE_SCATTER, self.grad_shard, self.grad_full)
            for p in self.params:
                p.grad = None
            self.grad_full = None  # the full gradient is gone: only 1/W of it lives on

    def step_done(self, comm: CommLog) -> None:
        """After AdamW updated `master`: copy to the param dtype; stages 1-2 all-gather the updated slices."""
        if self.master.data_ptr() != self.shard.data_ptr():
            self.shard.copy_(self.master.detach())  # mixed: fp32 master -> bf16 shard
        if self.stage in (1, 2):
            comm.call("all_gather", ALL_GATHER, self.full, self.shard.clone())
    # --8<-- [end:reduce]


class CommLog:
    """Runs collectives and adds up the bytes this rank sends (ring algorithm, mlsys.collectives.comm_volume)."""

    def __init__(self, world_size: int):
        self.world_size, self.sent = world_size, {}

    def call(self, name: str, fn, out: torch.Tensor, inp: torch.Tensor | None = None) -> None:
        fn(out) if inp is None else fn(out, inp)
        full = out if name in ("all_gather", "all_reduce") else inp  # comm_volume's N is the full buffer
        volume = comm_volume(name, full.numel() * full.element_size(), self.world_size)["sent"]
        self.sent[name] = self.sent.get(name, 0.0) + volume


# ----------------------------------------------------------------------------------------------- memory
def held_bytes(units: list[FlatUnit], opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds right now, by kind: the distinct storages behind each kind's tensors (a view costs
    nothing extra; a freed buffer counts 0). AdamW's m and v and the fp32 master copy count as optimizer state."""
    kinds = {
        "params": [t for u in units for t in (u.full, u.shard)],
        "grads": [t for u in units for t in (u.grad_full, u.grad_shard) if t is not None],
        "optimizer": [u.master for u in units] + [t for s in opt.state.values() for t in s.values()
                                                  if torch.is_tensor(t)],
    }
    seen, held = set(), {}
    for kind, tensors in kinds.items():  # in this order: fp32 master == shard counts once, as a parameter
        held[kind] = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen or storage.nbytes() == 0:
                seen.add(storage.data_ptr())
                held[kind] += storage.nbytes()
    held["total"] = sum(held.values())
    return held


# --8<-- [start:layout]
def held_elements(units: list[FlatUnit]) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """What this rank holds, by kind, as (offset, values): offsets index the units' padded buffers laid end to
    end. A full buffer starts at its unit's offset; a shard at offset + lo. Read off the real tensors (a freed
    buffer holds nothing), so the ZeRO grid shows what the run kept, not what it was meant to keep."""
    held: dict[str, list[tuple[int, torch.Tensor]]] = {"params": [], "grads": [], "optimizer": []}
    base = 0
    for u in units:
        if u.full.untyped_storage().nbytes() > 0:
            held["params"].append((base, u.full.detach()))
        else:
            held["params"].append((base + u.lo, u.shard.detach()))
        if u.grad_full is not None:
            held["grads"].append((base, u.grad_full))
        elif u.grad_shard is not None:
            held["grads"].append((base + u.lo, u.grad_shard))
        held["optimizer"].append((base + u.lo, u.master.detach()))  # AdamW's m and v have the master's shape
        base += u.padded
    return held


def layout_snapshot(units: list[FlatUnit], before: dict | None = None) -> dict:
    """{kind: {"held": [(a, b)], "changed": [(a, b)]}}: the element ranges this rank holds, and those of them
    whose value is new since `before` (a previous snapshot's "values"); "values" keeps copies for the next diff."""
    snap = {"units": [], "values": {}}
    base = 0
    for u in units:
        snap["units"].append((base, base + u.padded))
        base += u.padded
    for kind, parts in held_elements(units).items():
        old = before["values"].get(kind, {}) if before else {}
        held, changed, values = [], [], {}
        for offset, t in parts:
            t = t.float().flatten().clone()
            values[offset] = t
            held.append((offset, offset + t.numel()))
            prev = old.get(offset)
            diff = torch.ones_like(t, dtype=torch.bool) if prev is None or prev.shape != t.shape else prev != t
            changed += runs_of(diff, offset)
        snap[kind] = {"held": held, "changed": changed}
        snap["values"][kind] = values
    return snap


def runs_of(mask: torch.Tensor, offset: int) -> list[tuple[int, int]]:
    """The [a, b) ranges where a 1-D boolean mask is True, shifted by offset."""
    padded = torch.cat([torch.tensor([False]), mask, torch.tensor([False])]).int()
    edges = (padded[1:] - padded[:-1]).nonzero().flatten().tolist()
    return [(offset + a, offset + b) for a, b in zip(edges[::2], edges[1::2])]
# --8<-- [end:layout]


class Peak:
    """The most of each kind held at any sampled moment of a step; with `phases` on, a layout snapshot at every
    named moment (the frames of the ZeRO step animation)."""

    def __init__(self, units, opt):
        self.units, self.opt, self.max = units, opt, {}
        self.phases: list[tuple[str, dict]] | None = None  # set to [] to record one step

    def sample(self, phase: str = "") -> None:
        for kind, n in held_bytes(self.units, self.opt).items():
            self.max[kind] = max(self.max.get(kind, 0), n)
        if phase and self.phases is not None:
            before = self.phases[-1][1] if self.phases else None
            self.phases.append((phase, layout_snapshot(self.units, before)))


# ----------------------------------------------------------------------------------------------- one training step
def make_units(model: GPT, stage: int, world_size: int, rank: int, dtype: torch.dtype) -> list[FlatUnit]:
    """Stages 0-2: the whole model is one unit. Stage 3: a root unit (wte = the tied head, wpe, ln_f), then one
    unit per block, like FSDP's wrapping; the root stays gathered from the start of forward to the end of backward."""
    if stage < 3:
        return [FlatUnit(list(model.parameters()), stage, world_size, rank, dtype)]
    root = [model.wte.weight, model.wpe.weight, *model.ln_f.parameters()]
    return [FlatUnit(root, 3, world_size, rank, dtype)] + [
        FlatUnit(list(block.parameters()), 3, world_size, rank, dtype) for block in model.h]


def step_replicated(model: GPT, units: list[FlatUnit], x, y, comm: CommLog, peak: Peak) -> float:
    """Stages 0-2: a normal forward and backward on the full model, then reduce the flat gradient."""
    (unit,) = units
    if unit.grad_full is None:
        unit.alloc_grads()  # stage 2: a full gradient exists only from here to the reduce-scatter
    _, loss = model(x, y)
    loss.backward()
    peak.sample("backward")
    unit.reduce_grads(comm)
    peak.sample("reduce-scatter")
    return loss.item()


# --8<-- [start:stage3]
def step_stage3(model: GPT, units: list[FlatUnit], x, y, comm: CommLog, peak: Peak) -> float:
    """Stage 3: gather each block just before it runs (forward, then again for backward) and free it right after.
    The autograd graph is cut at block boundaries so the backward can be driven block by block."""
    root, blocks = units[0], units[1:]
    root.gather(comm)
    T = x.size(1)
    emb = model.drop(model.wte(x) + model.wpe(torch.arange(T, device=x.device)))  # (B, T, C)
    edges, h = [], emb
    for block, unit in zip(model.h, blocks):
        unit.gather(comm)
        inp = h.detach().requires_grad_()  # (B, T, C) a leaf: backward stops here and hands us its grad
        h = block(inp)
        peak.sample()
        unit.free()  # autograd kept references to the weights, not their values: refilled before backward
        edges.append((inp, h))
    top = h.detach().requires_grad_()
    logits = model.lm_head(model.ln_f(top))  # (B, T, V); lm_head.weight is wte: the root unit
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    root.alloc_grads()
    loss.backward()  # head and ln_f gradients into the root's flat gradient
    grad = top.grad
    for (inp, out), unit in zip(reversed(edges), reversed(blocks)):
        unit.gather(comm)  # the second all-gather of this block
        unit.alloc_grads()
        out.backward(grad)
        peak.sample()
        grad = inp.grad
        unit.free()
        unit.reduce_grads(comm)  # reduce-scatter this block's gradient and drop the full one
    emb.backward(grad)  # embedding gradients accumulate into the root's (wte already holds the head's part)
    peak.sample()
    root.reduce_grads(comm)
    root.free()
    return loss.item()
# --8<-- [end:stage3]


def train(ctx: RankContext, args: Settings, tokens, stage: int, precision: str) -> dict:
    """Run --steps ZeRO steps; return losses, the full fp32 parameters, memory and bytes sent."""
    W = ctx.world_size
    model = build_model(args).to(ctx.device, DTYPES[precision])
    units = make_units(model, stage, W, ctx.rank, DTYPES[precision])
    opt = make_optimizer([u.master for u in units], args)
    comm, peak, losses = CommLog(W), Peak(units, opt), []
    before_step, phases = layout_snapshot(units), []
    for step in range(args.steps):
        if step == 0 and stage == 2:  # record the moments of stage 2's first step (the step animation)
            peak.phases = [("start", before_step)]
        x, y = (t.to(ctx.device) for t in rank_batch(tokens, ctx.rank, W, step, args))
        run_step = step_stage3 if stage == 3 else step_replicated
        loss = run_step(model, units, x, y, comm, peak)
        for u in units:  # mean over ranks = the global-batch gradient; AdamW sees fp32 and only its slice
            u.master.grad = u.grad_shard.float() / W if precision == "mixed" else u.grad_shard.div_(W)
        opt.step()
        peak.sample("update")
        for u in units:
            u.master.grad = None
            u.step_done(comm)
            if stage <= 1:
                u.grad_full.zero_()
        held = held_bytes(units, opt)  # what stays between steps
        peak.sample("all-gather")
        if peak.phases is not None:
            phases = [(name, {k: v for k, v in snap.items() if k != "values"}) for name, snap in peak.phases]
            peak.phases = None
        mean_loss = torch.tensor(loss, device=ctx.device)
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / W)
    layout = {k: v for k, v in layout_snapshot(units).items() if k != "values"}  # between steps
    return {"losses": losses, "params": full_master(model, units), "held": held, "peak": peak.max,
            "layout": layout, "phases": phases,
            "sent_per_step": {k: v / args.steps for k, v in comm.sent.items()}}


def full_master(model: GPT, units: list[FlatUnit]) -> torch.Tensor:
    """For the check only: every rank's fp32 master slices, gathered, in model.parameters() order."""
    by_param = {}
    for u in units:
        out = torch.empty(u.padded, dtype=torch.float32, device=u.device)
        ALL_GATHER(out, u.master.detach()) if u.world > 1 else out.copy_(u.master.detach())
        offset = 0
        for p in u.params:
            by_param[id(p)] = out[offset:offset + p.numel()]
            offset += p.numel()
    return torch.cat([by_param[id(p)] for p in model.parameters()]).cpu()


# ----------------------------------------------------------------------------------------------- the job
def worker(ctx: RankContext, args: Settings) -> dict:
    W = ctx.world_size
    tokens, _ = load_splits(num_records=600, seed=args.seed)
    psi = num_params(build_model(args))
    ctx.print(f"tiny GPT: {args.layers} blocks, {psi:,} parameters; W={W}, {args.steps} AdamW steps, "
              f"global batch {W} x {args.batch_size} x {args.seq_len} tokens")
    want, want_losses = reference_adamw(tokens, W, args) if ctx.is_main else (None, None)
    want_mixed = reference_mixed(tokens, W, args) if ctx.is_main and "mixed" in args.precisions else None
    rows, runs, first_by_precision = [], {}, {}
    for precision in args.precisions:
        for stage in args.stages:
            out = train(ctx, args, tokens, stage, precision)
            formula = zero_bytes_per_rank(psi, W, stage, precision)
            held = [None] * W
            dist.all_gather_object(held, {"held": out["held"], "peak": out["peak"], "layout": out["layout"],
                                          "phases": out["phases"]})
            if not ctx.is_main:
                continue
            err = (out["params"] - want).abs().max().item()
            oracle, beyond = (want, None) if precision == "fp32" else (want_mixed, None)
            if precision == "fp32":  # the oracle: same parameters as one-process AdamW
                expect_adamw_equal(f"stage {stage} fp32 params after {args.steps} steps", out["params"], want, args)
            else:  # the oracle: the same bf16 recipe in one process (fp32 AdamW is only close: bf16 forward)
                beyond = expect_mixed_equal(f"stage {stage} mixed master weights after {args.steps} steps",
                                            out["params"], want_mixed, W, args)
            first = first_by_precision.setdefault(precision, out["params"])  # the first stage run in this precision
            for kind in ("params", "grads", "optimizer", "total"):
                worst = max(h["held"][kind] for h in held)  # the most-loaded rank
                ratio = worst / formula[kind]
                if abs(ratio - 1) > TOLERANCE:
                    raise cli.SelfCheckFailed(f"stage {stage} {precision} {kind}: held {worst} B, formula "
                                              f"{formula[kind]:.0f} B (ratio {ratio:.3f})")
                rows.append({"stage": stage, "precision": precision, "kind": kind, "measured_B": worst,
                             "formula_B": round(formula[kind]), "ratio": f"{ratio:.3f}",
                             "peak_B": max(h["peak"][kind] for h in held)})
            runs[f"stage{stage}_{precision}"] = {
                "max_abs_diff_vs_adamw": err, "max_abs_diff_vs_oracle": (out["params"] - oracle).abs().max().item(),
                "share_beyond_mixed_bound": beyond,
                # the same bound against fp32 AdamW: what the oracle is for (most weights are outside it)
                "share_beyond_mixed_bound_vs_adamw": None if beyond is None else (
                    (out["params"] - want).abs() > mixed_step_fraction(W, args.steps) * args.lr).double().mean().item(),
                "max_abs_diff_vs_first_stage": (out["params"] - first).abs().max().item(),
                "final_loss": out["losses"][-1], "losses": out["losses"],
                "sent_bytes_per_step": sum(out["sent_per_step"].values()), "sent_by_op": out["sent_per_step"],
                "held": held[0]["held"], "peak": held[0]["peak"], "formula": formula,
                "layout": [h["layout"] for h in held], "phases": [h["phases"] for h in held]}
    if not ctx.is_main:
        return {}
    ctx.print("\nbytes held between steps by the busiest rank (fp32: 4+4+8 B/param, mixed: 2+2+12); off_formula: the "
              "largest |measured/formula - 1| of the four kinds; peak: the most held at once during a step")
    ctx.print(report.table(memory_summary(rows)))
    draw_memory(args, rows, W, psi)
    grid_path, grid_boxes = draw_grid(args, runs, args.precisions[0])
    print(f"figure: {grid_path}")
    step_run = next((name for name, r in runs.items() if r["phases"][0]), None)
    if step_run:
        print("figure: {} (and {})".format(*draw_step(args, runs[step_run]["phases"], step_run.split("_")[1])))
    base = {p: runs.get(f"stage0_{p}", {}).get("sent_bytes_per_step") for p in args.precisions}
    ctx.print("\nper step: bytes one rank sends (vs_stage0: against stage 0 in the same precision); loss after the "
              "last step; diff_vs_oracle: max |param - its oracle| (fp32: AdamW in one process; mixed: the bf16 "
              "recipe in one process); every row matched its oracle: a mismatch stops the run before this table")
    ctx.print(report.table([
        {"run": name, "sent_B": round(r["sent_bytes_per_step"]),
         "vs_stage0": round(r["sent_bytes_per_step"] / base[name.split("_")[1]], 3) if base[name.split("_")[1]]
         else "-", "final_loss": round(r["final_loss"], 4),
         "diff_vs_oracle": f"{r['max_abs_diff_vs_oracle']:.2e}"}
        for name, r in runs.items()]))
    ctx.print("\ndetails of the check: diff_vs_adamw: max |param - fp32 AdamW in one process|; beyond: the share of "
              "weights further from the oracle than the bf16 bound, allowed 1%; beyond_vs_adamw: the same share "
              "measured from fp32 AdamW; diff_vs_first_stage: max |param - the first stage run in the same precision|")
    ctx.print(report.table([
        {"run": name, "diff_vs_adamw": f"{r['max_abs_diff_vs_adamw']:.2e}",
         "beyond": "-" if r["share_beyond_mixed_bound"] is None else f"{r['share_beyond_mixed_bound']:.2%}",
         "beyond_vs_adamw": ("-" if r["share_beyond_mixed_bound_vs_adamw"] is None
                             else f"{r['share_beyond_mixed_bound_vs_adamw']:.1%}"),
         "diff_vs_first_stage": f"{r['max_abs_diff_vs_first_stage']:.2e}"}
        for name, r in runs.items()]))
    ctx.print(f"reference losses (one process): {[round(v, 4) for v in want_losses]}")
    gib_7b = [zero_bytes_per_rank(7e9, 8, s)["total"] / 2**30 for s in range(4)]
    ctx.print("the same accounting for a 7B model on 8 ranks, mixed precision: "
              + ", ".join(f"stage {s} {g:.1f} GiB" for s, g in enumerate(gib_7b)) + " per rank")
    return {"world_size": W, "steps": args.steps, "num_params": psi,
            "mixed_step_fraction": mixed_step_fraction(W, args.steps), "memory": rows, "runs": runs,
            "reference_losses": want_losses, "grid_boxes": grid_boxes, "gib_7b_8_ranks": gib_7b}


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "steps": 2, "layers": 2},
                     world_sizes=range(1, 9), world_sizes_text="1..8")
    result = launch(worker, args)
    if result is None:
        return 0
    checked = {p: sorted({int(k[5]) for k in result["runs"] if k.endswith(p)}) for p in ("fp32", "mixed")}
    said = [f"fp32 stages {checked['fp32']} match AdamW in one process"] if checked["fp32"] else []
    said += [f"mixed stages {checked['mixed']} match the bf16 recipe in one process"] if checked["mixed"] else []
    print(f"OK: {'; '.join(said)}; measured bytes within {TOLERANCE:.0%} of the formula")
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
