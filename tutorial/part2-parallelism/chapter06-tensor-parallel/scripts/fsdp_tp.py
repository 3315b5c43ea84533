"""Two dimensions at once, as current training stacks run them: FSDP2 x tensor parallelism, and HSDP.

What it shows
    W ranks as a 2-D DeviceMesh, trained for --steps SGD steps on a small GPT, two ways:
      fsdp x tp   mesh ("dp", "tp"): inside each tp group, parallelize_module splits every block's attention
                  heads and MLP columns (ColwiseParallel / RowwiseParallel, chapter 6's Megatron layout); across
                  the dp groups, fully_shard (FSDP2) shards every block and the root on top. The ranks of one tp
                  group read the same batch; each dp group reads its own.
      hsdp        mesh ("replicate", "shard"): fully_shard on the 2-D mesh shards each parameter inside a shard
                  group and replicates it across groups (hybrid sharding); every rank reads its own batch.
    Each run must end with the parameters of one process that trains the same model with SGD on the global batch
    (every group's batch concatenated), to float32 rounding. SGD, not AdamW, so that the comparison cannot flake on
    the rounding of tiny gradients.

    Figure: mesh.png, the 2-D mesh of ranks and, for the MLP's two weights of block 0, which block of the full
    matrix each rank holds after TP and then FSDP2 split it: offsets and shapes computed from each DTensor's
    placements (torch's compute_local_shape_and_global_offset), checked against the local shard's shape, and kept
    in the JSON with the shard's values ("fsdp_tp" -> "shards"), so a test can put the full matrix back together.

    The fused q, k, v projection needs one preparation for ColwiseParallel, which gives rank r a contiguous block
    of output rows: its rows are reordered so that rank r's block holds the q, k and v rows of its own heads.

How to run (W from 1 to 8; --tp must divide W and the 4 heads)
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/fsdp_tp.py -w 4
    torchrun --nproc-per-node 4 tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/fsdp_tp.py

Runtime on 2 cores: about 8 s at -w 4, 6 s with --smoke.

Contract flags: --smoke trains 2 steps instead of 3; --seed sets the initial weights and the batches.

Try next
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/fsdp_tp.py -w 8 --tp 4
        -> 2 tensor-parallel groups of 4 ranks (the mesh's rows), with FSDP2 sharding across the 2 rows;
           HSDP as 2 replicas of 4 shards
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.data import get_batch, load_splits
from mlsys.launch import RankContext, launch
from mlsys.model import GPT, GPTConfig


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 4
    """Number of ranks to start (1 to 8). Under torchrun it is taken from WORLD_SIZE."""
    tp: int = 0
    """Tensor-parallel size (divides W and the 4 heads); 0: 2 when W is even, else 1. HSDP uses it as its
    shard-group size."""
    steps: int = 3
    """SGD steps."""
    batch_size: int = 2
    """Sequences per dp group (fsdp x tp) or per rank (hsdp) per step."""
    seq_len: int = 32
    """Tokens per sequence (at most 64)."""
    lr: float = 0.1
    """SGD learning rate."""

    def validate(self) -> None:
        tp = self.tp or (2 if self.world_size % 2 == 0 else 1)
        if self.world_size % tp or 4 % tp:
            raise cli.UsageError(f"--tp {tp} must divide the world size {self.world_size} and the 4 heads")
        if min(self.steps, self.batch_size, self.seq_len) < 1 or self.seq_len > 64 or self.lr <= 0:
            raise cli.UsageError("--steps, --batch-size >= 1, --seq-len in 1..64, --lr > 0")


def build(args: Settings) -> GPT:
    torch.manual_seed(args.seed)  # the same initial weights everywhere
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64))


def batch(tokens: torch.Tensor, group: int, step: int, args: Settings):
    """The batch of data-parallel group `group` at `step`; any process can rebuild it."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + step * 100 + group)
    return get_batch(tokens, args.batch_size, args.seq_len, gen)


# --8<-- [start:qkv]
def head_order(C: int, tp: int) -> torch.Tensor:
    """Row order of the fused (3C, C) qkv weight that gives tp rank r, as one contiguous block, the q, k and v
    rows of its heads: [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]."""
    per = C // tp
    return torch.cat([torch.arange(part * C + r * per, part * C + (r + 1) * per)
                      for r in range(tp) for part in range(3)])
# --8<-- [end:qkv]


# --8<-- [start:fsdp_tp]
def fsdp_tp(model: GPT, mesh) -> GPT:
    """Tensor parallelism inside mesh["tp"], then FSDP2 across mesh["dp"] on top of it."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    order = head_order(model.config.n_embd, mesh["tp"].size())
    for block in model.h:
        with torch.no_grad():
            block.attn.c_attn.weight.copy_(block.attn.c_attn.weight[order])
            block.attn.c_attn.bias.copy_(block.attn.c_attn.bias[order])
        parallelize_module(block, mesh["tp"], {
            "attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),  # heads split across tp
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})  # MLP columns, then rows
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])  # the root: embeddings, final LayerNorm, tied head
    return model


def hsdp(model: GPT, mesh) -> GPT:
    """fully_shard on a 2-D mesh: shard inside mesh["shard"], replicate across mesh["replicate"]."""
    from torch.distributed.fsdp import fully_shard

    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
# --8<-- [end:fsdp_tp]


SHOWN = ("h.0.mlp.c_fc.weight", "h.0.mlp.c_proj.weight")  # the two weights the picture draws


def shards_held(model: GPT, mesh) -> dict[str, list[dict]]:
    """For each weight in SHOWN, every rank's block of the full matrix: its mesh coordinate, the offset and shape
    that DTensor's placements give it, and the values it holds, row-major float32 bytes in base64 to keep the JSON
    small (gathered from every rank)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    params, mine = dict(model.named_parameters()), {}
    for name in SHOWN:
        p = params[name]
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        local = p.to_local().detach().cpu()
        report.expect_equal(f"{name}: local shard shape vs the one its placements give", list(local.shape),
                            list(shape))
        mine[name] = {"rank": dist.get_rank(), "coordinate": mesh.get_coordinate(), "offset": list(offset),
                      "shape": list(shape), "placements": str(tuple(p.placements)),
                      "local_float32_base64": base64.b64encode(local.contiguous().numpy().tobytes()).decode()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {name: [held[name] for held in every] for name in SHOWN}


def draw_mesh(args: Settings, mesh_dims: dict, shards: dict[str, list[dict]]):
    """Left: the mesh, dp rows x tp columns, each rank in its colour. Right: each weight in SHOWN at its true
    proportions, every rank's block (at the offset and shape recorded) in that rank's colour, the TP cut drawn
    as a thick line."""
    from matplotlib.patches import Rectangle

    plt = plot.pyplot()
    (dp_name, dp), (tp_name, tp) = mesh_dims.items()
    colours = list(plot.colours(f"rank {r}" for r in range(dp * tp)).values())
    fig, axes = plt.subplots(1, 3, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1.1, 0.8, 1.9]})
    ax = axes[0]
    for h in next(iter(shards.values())):
        r, (i, j) = h["rank"], h["coordinate"]
        ax.add_patch(Rectangle((j, dp - 1 - i), 0.94, 0.94, color=colours[r], alpha=0.8))
        ax.text(j + 0.47, dp - 0.53 - i, f"rank {r}\n{dp_name} {i}, {tp_name} {j}", ha="center", va="center",
                fontsize=9)
    ax.set(xlim=(-0.05, tp), ylim=(-0.05, dp + 0.05), aspect="equal",
           title=f"the mesh: {dp} {dp_name} rows x {tp} {tp_name} columns\n(one row = one TP group)")
    ax.axis("off")
    for ax, (name, held) in zip(axes[1:], shards.items(), strict=True):
        rows = max(h["offset"][0] + h["shape"][0] for h in held)
        cols = max(h["offset"][1] + h["shape"][1] for h in held)
        for h in held:
            (r0, c0), (nr, nc) = h["offset"], h["shape"]
            ax.add_patch(Rectangle((c0, r0), nc, nr, facecolor=colours[h["rank"]], alpha=0.8, edgecolor="white",
                                   lw=1.5))
            ax.text(c0 + nc / 2, r0 + nr / 2, f"rank {h['rank']}\nrows {r0}:{r0 + nr}\ncols {c0}:{c0 + nc}",
                    ha="center", va="center", fontsize=8)
        tp_dim = 0 if "c_fc" in name else 1  # ColwiseParallel splits the output rows, RowwiseParallel the columns
        for k in range(1, tp):
            cut = k * (rows if tp_dim == 0 else cols) / tp
            ax.plot([0, cols] if tp_dim == 0 else [cut, cut], [cut, cut] if tp_dim == 0 else [0, rows], "k-", lw=3)
        ax.set(xlim=(0, cols), ylim=(rows, 0), aspect="equal", xlabel="column", ylabel="row")
        ax.set_title(f"{name} ({rows} x {cols})\n{held[0]['placements']}", fontsize=9)
        ax.grid(False)
    fig.suptitle(f"FSDP2 x TP on {dp * tp} ranks: TP cuts each weight first (thick line), then FSDP2 cuts every "
                 f"TP piece by {dp_name}", fontsize=11)
    fig.tight_layout()
    return plot.save(fig, args, "mesh")


def full_params(model: GPT, tp: int) -> dict[str, torch.Tensor]:
    """Every parameter as one full tensor (DTensor.full_tensor() gathers it), qkv rows back in dense order."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # "2 all_gathers": fine
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        if "c_attn" in name and tp > 1:
            restored = torch.empty_like(t)
            restored[head_order(model.config.n_embd, tp)] = t
            t = restored
        out[name] = t.detach().cpu()
    return out


def train(model: GPT, tokens, group: int, args: Settings, device) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        x, y = (t.to(device) for t in batch(tokens, group, step, args))
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()  # FSDP2 reduce-scatters (averages) the gradients across its data-parallel ranks
        opt.step()


def reference(tokens, groups: int, args: Settings) -> dict[str, torch.Tensor]:
    """One process, SGD on the global batch: every data-parallel group's batch, concatenated."""
    model = build(args)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        xs, ys = zip(*(batch(tokens, g, step, args) for g in range(groups)), strict=True)
        _, loss = model(torch.cat(xs), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def worker(ctx: RankContext, args: Settings) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    W, r = ctx.world_size, ctx.rank
    tp = args.tp or (2 if W % 2 == 0 else 1)
    tokens, _ = load_splits(2000)
    results = {}
    for name, dims, names in (("fsdp_tp", (W // tp, tp), ("dp", "tp")), ("hsdp", (W // tp, tp),
                                                                         ("replicate", "shard"))):
        mesh = init_device_mesh(ctx.device.type, dims, mesh_dim_names=names)
        model = build(args).to(ctx.device)
        if name == "fsdp_tp":
            model, group, groups = fsdp_tp(model, mesh), mesh.get_local_rank("dp"), W // tp
            shards = shards_held(model, mesh)  # before training: the initial weights, where each block sits
        else:
            model, group, groups = hsdp(model, mesh), r, W
        train(model, tokens, group, args, ctx.device)
        got, want = full_params(model, tp if name == "fsdp_tp" else 1), reference(tokens, groups, args)
        worst = max((got[n] - want[n]).abs().max().item() for n in want)
        report.expect_close(f"{name}: parameters vs one process (max |diff| {worst:.1e})", worst, 0.0, rtol=0,
                            atol=2e-5)
        w = dict(model.named_parameters())["h.0.mlp.c_fc.weight"]
        results[name] = {"mesh": dict(zip(names, dims, strict=True)), "max_abs_diff": worst,
                         "placements": str(tuple(w.placements)), "local_shape": list(w.to_local().shape),
                         "full_shape": list(w.shape)}
    results["fsdp_tp"]["shards"] = shards
    ctx.print(f"{W} ranks, {args.steps} SGD steps each way; every parameter compared with one process")
    ctx.print("FSDP2 x TP: the block of each MLP weight of block 0 that each rank holds (rows, columns of the full "
              "matrix):")
    ctx.print(report.table([{"rank": h["rank"], "dp, tp": ", ".join(map(str, h["coordinate"])),
                             **{n.removeprefix("h.0.mlp.").removesuffix(".weight"):
                                f"{o[0]}:{o[0] + sh[0]}, {o[1]}:{o[1] + sh[1]}"
                                for n in SHOWN for o, sh in [(shards[n][k]["offset"], shards[n][k]["shape"])]}}
                            for k, h in enumerate(shards[SHOWN[0]])]))
    ctx.print(report.table([{"run": k.replace("_", " x "), "mesh": " x ".join(f"{n}={s}" for n, s in v["mesh"].items()),
                             "h.0.mlp.c_fc.weight placements": v["placements"],
                             "local / full shape": f"{v['local_shape']} / {v['full_shape']}",
                             "max |diff|": v["max_abs_diff"]} for k, v in results.items()], floatfmt=".1e"))
    return results


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"steps": 2}, world_sizes=range(1, 9), world_sizes_text="1..8")
    result = launch(worker, args)
    if result is None:
        return 0
    print(f"figure: {draw_mesh(args, result['fsdp_tp']['mesh'], result['fsdp_tp']['shards'])}")
    print("OK: FSDP2 x TP and HSDP both end with the parameters of one process on the global batch")
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
