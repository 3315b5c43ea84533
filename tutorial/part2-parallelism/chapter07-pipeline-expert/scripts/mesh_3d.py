"""3-D parallelism: the tiny GPT trained on a dp x tp x pp mesh, equal to the same model trained in one process.

What it shows
    1. mlsys.mesh.ParallelMesh lays the ranks out as (pp, dp, tp), tensor-parallel rank fastest, and creates each
       rank's three process groups; the groups are checked against torch's own
       init_device_mesh("cpu", (pp, dp, tp)).
    2. One training step on 8 ranks as 2 x 2 x 2 (DP x TP x PP), composed from the book's own pieces:
       the GPT is cut into pipeline stages at the same layer boundaries as mlsys.pipeline.split_gpt, each stage is
       tensor-parallel over its TP group (the blocks, vocabulary-parallel embedding and head of
       mlsys.tensor_parallel.shard_gpt), micro-batches flow through mlsys.pipeline.run_pipeline_step (1F1B) in the
       PP group, and the gradients are averaged over the DP group before an SGD step.
    3. The loss, every gradient and every parameter after the step equal a single-process GPT trained on the
       whole batch (the reference's gradients and weights are sharded the same way and compared shard by shard).

    Figure mesh.png: the ranks placed by the groups the run built, one panel per pipeline stage, a dp x tp grid
    in each: solid outlines around the TP groups, dashed ones around the DP groups, one fill colour per pipeline.
    Everything drawn (cells, outlines, tick labels) is in the JSON under "picture".

How to run (world size = dp * tp * pp)
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/mesh_3d.py               # 8 ranks, 2x2x2
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/mesh_3d.py -w 4 --dp 1 --tp 2 --pp 2
    torchrun --nproc-per-node 8 tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/mesh_3d.py

Runtime on 2 cores: about 8 s for the default 8 ranks and 2 steps (8 processes share 2 cores) on an idle
machine (about 25 s at load 6 to 9), 6 s with --smoke.

Try next
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/mesh_3d.py -w 4 --dp 1 --tp 2 --pp 2
        -> no data parallelism: one pipeline of two stages, each split over two ranks; the same checks
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/mesh_3d.py -w 4 --dp 2 --tp 1 --pp 2
        -> two pipeline replicas without tensor parallelism: the TP groups are single ranks
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/mesh_3d.py -w 6
        -> 6 ranks are not 2 x 2 x 2: a one-line usage error, exit 2
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from mlsys import cli, plot, report
from mlsys.launch import RankContext, launch
from mlsys.mesh import ParallelMesh, compare_with_device_mesh
from mlsys.model import GPT, GPTConfig
from mlsys.pipeline import run_pipeline_step, split_gpt
from mlsys.tensor_parallel import TPGPT, shard_gpt


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 8
    """Number of ranks: dp * tp * pp. Under torchrun it is taken from WORLD_SIZE."""
    dp: int = 2
    """Data-parallel replicas."""
    tp: int = 2
    """Tensor-parallel ranks per stage (must divide the heads)."""
    pp: int = 2
    """Pipeline stages (at most the number of layers)."""
    preset: str = "tiny"
    """Model preset of mlsys.model (tiny: 2 layers, 2 heads, width 32)."""
    micro_batches: int = 2
    """Micro-batches per pipeline per step."""
    micro_batch_size: int = 2
    """Sequences per micro-batch."""
    seq_len: int = 16
    """Tokens per sequence."""
    steps: int = 2
    """SGD steps, each compared with the single-process model."""
    lr: float = 0.1
    """SGD learning rate."""

    def validate(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batches", "micro_batch_size", "seq_len", "steps"):
            if getattr(self, name) < 1:
                raise cli.UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.dp * self.tp * self.pp != self.world_size:
            raise cli.UsageError(f"dp * tp * pp = {self.dp * self.tp * self.pp} must equal the world size "
                                 f"{self.world_size}")
        try:
            config = GPTConfig.preset(self.preset)
        except ValueError as err:
            raise cli.UsageError(str(err)) from None
        if config.n_head % self.tp or self.pp > config.n_layer or self.seq_len > config.block_size:
            raise cli.UsageError(f"preset {self.preset}: tp must divide {config.n_head} heads, pp <= "
                                 f"{config.n_layer} layers, seq-len <= {config.block_size}")
        if not self.lr > 0:
            raise cli.UsageError(f"--lr must be positive, got {self.lr}")


class TPStage(nn.Module):
    """Layers [first, last) of a tensor-parallel GPT, as a pipeline stage (the interface of pipeline.GPTStage).

    The first stage embeds (vocabulary-parallel + all-reduce), the last applies ln_f and the vocabulary-parallel
    head (all-gathered logits); in between only TP blocks. Every rank of a TP group runs the same stage.
    """

    def __init__(self, tp_model: TPGPT, first: int, last: int, index: int, num_stages: int):
        super().__init__()
        self.config, self.group, self.sequence_parallel = tp_model.config, tp_model.group, False
        self.index, self.num_stages, self.layer_range = index, num_stages, (first, last)
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        if self.is_first:
            self.wte, self.wpe, self.drop = tp_model.wte, tp_model.wpe, tp_model.drop
        self.h = nn.ModuleList(tp_model.h[first:last])
        if self.is_last:
            self.ln_f, self.lm_head = tp_model.ln_f, tp_model.lm_head

    def tied_weight(self) -> nn.Parameter | None:
        """This rank's shard of the embedding/head matrix on the two end stages (summed by the pipeline)."""
        if self.num_stages == 1:
            return None
        return self.wte.weight if self.is_first else self.lm_head.weight if self.is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = TPGPT.embed(self, x)  # (B, T) ids -> (B, T, C), same on every TP rank
        for block in self.h:
            x = block(x)  # (B, T, C): two all-reduces in the TP group per block
        if self.is_last:
            x = TPGPT.head(self, x)  # (B, T, V) full-vocabulary logits
        return x


def make_stage(model: GPT, mesh: ParallelMesh) -> TPStage:
    """This rank's stage: the layer range split_gpt gives stage pp_index, sharded over the TP group."""
    ranges = [s.layer_range for s in split_gpt(model, mesh.sizes["pp"])]
    index = mesh.coords()["pp"]
    return TPStage(shard_gpt(model, mesh.tp_group), *ranges[index], index, mesh.sizes["pp"])


def batch(args: Settings, vocab: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (dp * m * b, T) of token ids and next-token targets, the same on every rank."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + step)
    rows = args.dp * args.micro_batches * args.micro_batch_size
    tokens = torch.randint(0, vocab, (rows, args.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def as_grads(model: GPT) -> GPT:
    """A copy of `model` whose parameter VALUES are its gradients, so sharding it shards the gradients."""
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p, q in zip(clone.parameters(), model.parameters()):
            p.copy_(q.grad)
    return clone


def compare(what: str, ours: nn.Module, expected: nn.Module, grads: bool) -> float:
    """Max abs difference between two stages parameter by parameter (values, or our grads vs its values)."""
    worst = 0.0
    for (name, p), (_, q) in zip(ours.named_parameters(), expected.named_parameters()):
        mine = (p.grad if grads else p).detach()
        report.expect_close(f"{what} {name} (rank {dist.get_rank()})", mine, q, rtol=1e-4, atol=1e-6)
        worst = max(worst, (mine - q).abs().max().item())
    return worst


# --8<-- [start:step]
def train_step(stage: TPStage, mesh: ParallelMesh, opt: torch.optim.Optimizer, idx: torch.Tensor,
               targets: torch.Tensor, args: Settings) -> float:
    """One 3-D step: this DP replica's share of the batch through the pipeline, DP gradient average, SGD.
    Returns the global mean loss (every rank gets it)."""
    c = mesh.coords()
    mine, mine_t = idx.chunk(args.dp)[c["dp"]], targets.chunk(args.dp)[c["dp"]]  # (m*b, T) for this replica
    opt.zero_grad()
    out = run_pipeline_step(stage, mesh.pp_ranks, list(mine.chunk(args.micro_batches)),
                            list(mine_t.chunk(args.micro_batches)), "1f1b", group=mesh.pp_group)
    for p in stage.parameters():  # data parallelism: average over the replicas of this shard
        dist.all_reduce(p.grad, group=mesh.dp_group)
        p.grad /= args.dp
    # the loss lives on the last stage of every pipeline (dp * tp ranks hold a copy): average them over WORLD
    loss = torch.tensor(out["loss"] if stage.is_last else 0.0, device=idx.device)
    dist.all_reduce(loss)
    return float(loss) / (args.dp * args.tp)
# --8<-- [end:step]


def worker(ctx: RankContext, args: Settings) -> dict:
    mesh = ParallelMesh.build(args.dp, args.tp, args.pp)
    groups = compare_with_device_mesh(mesh, ctx.device.type)
    ctx.print_ordered(f"coords {mesh.coords()}  tp group {groups['tp']}  dp group {groups['dp']}  "
                      f"pp group {groups['pp']}")
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig.preset(args.preset)).to(ctx.device)  # the same weights on every rank
    reference = copy.deepcopy(model)  # trained in this process on the whole batch
    stage = make_stage(model, mesh)
    opt = torch.optim.SGD(stage.parameters(), lr=args.lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr)
    rows = []
    for step in range(args.steps):
        idx, targets = (t.to(ctx.device) for t in batch(args, model.config.vocab_size, step))
        loss = train_step(stage, mesh, opt, idx, targets, args)
        ref_opt.zero_grad()
        _, ref_loss = reference(idx, targets)
        ref_loss.backward()
        report.expect_close(f"loss at step {step}", loss, ref_loss.item(), rtol=1e-5, atol=1e-6)
        grad_diff = compare("gradient", stage, make_stage(as_grads(reference), mesh), grads=True)
        opt.step()
        ref_opt.step()
        param_diff = compare("parameter", stage, make_stage(reference, mesh), grads=False)
        diffs = torch.tensor([grad_diff, param_diff], device=ctx.device)
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        rows.append({"step": step, "loss_3d": loss, "loss_single": ref_loss.item(),
                     "max_grad_diff": float(diffs[0]), "max_param_diff": float(diffs[1])})
    return {"mesh": {d: mesh.sizes[d] for d in ("dp", "tp", "pp")}, "groups": {d: mesh.all_groups(d)
            for d in ("dp", "tp", "pp")}, "steps": rows}


def draw(args: Settings, groups: dict[str, list[list[int]]]) -> dict:
    """mesh.png: one panel per pipeline stage, a dp x tp grid of ranks in each. A rank's place is read from the
    groups the run built (and checked against init_device_mesh): column = its index in its TP group, row = its
    index in its DP group, panel = its index in its PP group. Solid outlines are TP groups, dashed ones DP groups,
    and one fill colour marks one pipeline (PP group). Returns what it drew: every cell, outline and tick label."""
    plt = plot.pyplot()
    from matplotlib.colors import to_hex
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch, Patch

    where: dict[int, dict[str, int]] = {}
    for dim in ("tp", "dp", "pp"):
        for group in groups[dim]:
            for i, rank in enumerate(group):
                where.setdefault(rank, {})[dim] = i
    pipeline = {rank: n for n, group in enumerate(groups["pp"]) for rank in group}
    fill = plot.colours(f"pipeline {n}" for n in range(len(groups["pp"])))  # one colour per PP group
    fig, ax = plt.subplots(figsize=(1.0 + 1.6 * args.pp * (args.tp + 0.6), 1.2 + 1.3 * args.dp))
    drawn: dict = {"cells": [], "outlines": [], "xticks": [], "yticks": [], "panels": []}
    for rank, c in sorted(where.items()):
        x, y = c["pp"] * (args.tp + 1) + c["tp"], -c["dp"]  # the cell's lower left corner is (x, y - 1)
        color = fill[f"pipeline {pipeline[rank]}"]
        ax.add_patch(plt.Rectangle((x + 0.1, y - 0.9), 0.8, 0.8, color=color, alpha=0.45, linewidth=0))
        ax.text(x + 0.5, y - 0.5, f"rank {rank}", ha="center", va="center", fontsize=9)
        drawn["cells"].append({"rank": rank, "x": x + 0.5, "y": y - 0.5, "fill": to_hex(color)})
    for dim, pad, style, color in (("tp", 0.04, "-", "black"), ("dp", 0.12, "--", "0.35")):
        for group in groups[dim]:
            xs = [c["x"] for c in drawn["cells"] if c["rank"] in group]
            ys = [c["y"] for c in drawn["cells"] if c["rank"] in group]
            x0, x1, y0, y1 = min(xs) - 0.4 - pad, max(xs) + 0.4 + pad, min(ys) - 0.4 - pad, max(ys) + 0.4 + pad
            ax.add_patch(plt.Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, linestyle=style, edgecolor=color,
                                       linewidth=1.6))
            drawn["outlines"].append({"dim": dim, "x0": x0, "x1": x1, "y0": y0, "y1": y1})
    for s in range(args.pp):
        left = s * (args.tp + 1)
        ax.text(left + args.tp / 2, 0.35, f"pipeline stage {s}", ha="center", va="bottom", fontsize=10)
        drawn["panels"].append({"stage": s, "x0": left, "x1": left + args.tp})
        drawn["xticks"] += [{"at": left + k + 0.5, "label": f"tp {k}"} for k in range(args.tp)]
        if s + 1 < args.pp:
            ax.add_patch(FancyArrowPatch((left + args.tp + 0.2, -args.dp / 2), (left + args.tp + 0.8, -args.dp / 2),
                                         arrowstyle="-|>", mutation_scale=18, color="black", lw=1.5))
    drawn["yticks"] = [{"at": -j - 0.5, "label": f"dp {j}"} for j in range(args.dp)]
    ax.set_xticks([t["at"] for t in drawn["xticks"]], [t["label"] for t in drawn["xticks"]])
    ax.set_yticks([t["at"] for t in drawn["yticks"]], [t["label"] for t in drawn["yticks"]])
    ax.set(xlim=(-0.3, args.pp * (args.tp + 1) - 0.7), ylim=(-args.dp - 0.3, 0.8), aspect="equal")
    ax.grid(False)
    for side in ax.spines.values():
        side.set_visible(False)
    handles = [Line2D([], [], color="black", lw=1.6, label="TP group (solid)"),
               Line2D([], [], color="0.35", lw=1.6, linestyle="--", label="DP group (dashed)")]
    handles += [Patch(color=fill[f"pipeline {n}"], alpha=0.45, label=f"pipeline {n}: ranks {g}")
                for n, g in enumerate(groups["pp"])]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(f"dp={args.dp} x tp={args.tp} x pp={args.pp} = {args.dp * args.tp * args.pp} ranks, "
                 "as the run grouped them", fontsize=10)
    print(f"figure: {plot.save(fig, args, 'mesh')}")
    return drawn


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"steps": 1, "seq_len": 8, "micro_batch_size": 1},
                     world_sizes=lambda w: 1 <= w <= 16, world_sizes_text="1..16 (= dp * tp * pp)")
    result = launch(worker, args)
    if result is None:
        return 0
    print(f"\nmesh dp={args.dp} x tp={args.tp} x pp={args.pp} on {args.world_size} ranks (layout (pp, dp, tp), "
          "tp fastest); groups equal init_device_mesh's:")
    for dim in ("tp", "dp", "pp"):
        print(f"  {dim} groups: {result['groups'][dim]}")
    print(f"\n{args.preset} GPT, {args.micro_batches} micro-batches of {args.micro_batch_size} x {args.seq_len} tokens "
          f"per pipeline (1F1B), SGD lr={args.lr}: the 3-D run against one process on the whole batch")
    print(report.table(result["steps"], floatfmt=".6g"))
    print("OK: loss, every gradient shard and every parameter shard after each step equal the single-process model")
    result["picture"] = draw(args, result["groups"])
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
