"""Chapter 5's ZeRO scripts share these: the same tiny GPT, optimizer, batches and one-process oracle.

zero.py (ZeRO from scratch) and zero_torch.py (PyTorch's ZeroRedundancyOptimizer and FSDP2) are both checked
against AdamW in ONE process on the global batch, so they build their model, optimizer and batches here, the
same way. A file starting with _ is a helper, not a script (no page, no smoke test of its own).
"""

from __future__ import annotations

import typing

import torch

from mlsys import cli
from mlsys.data import get_batch, shard
from mlsys.model import GPT, GPTConfig

ORACLE_STEP_FRACTION = 0.01  # fp32 vs AdamW: within 1% of one step (lr); sums in another order differ by ~1e-7
# ...except where a gradient is itself at rounding level: Adam divides it by its own size (m / sqrt(v)), so a sum
# taken in another order can turn it into a step of up to lr in either direction. Those weights are few; a ZeRO bug
# (a wrong slice, a missing reduction) moves a whole shard, far more than this share.
MAX_ROUNDING_SHARE = 1e-3


class RunSettings(typing.Protocol):
    """The fields of a script's Settings that these helpers read."""

    seed: int
    layers: int
    batch_size: int
    seq_len: int
    lr: float
    steps: int


def build_model(args: RunSettings) -> GPT:
    torch.manual_seed(args.seed)  # every rank builds the same initial weights
    return GPT(GPTConfig.preset("tiny", n_layer=args.layers))


def make_optimizer(params, args: RunSettings) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)


def rank_batch(tokens: torch.Tensor, rank: int, world_size: int, step: int, args: RunSettings):
    """Rank r's (x, y), each (B, T), cut from its own shard of the stream; any process can rebuild it."""
    gen = torch.Generator().manual_seed(args.seed * 100_003 + step * 1009 + rank)
    return get_batch(shard(tokens, rank, world_size), args.batch_size, args.seq_len, gen)


def reference_adamw(tokens: torch.Tensor, world_size: int, args: RunSettings) -> tuple[torch.Tensor, list[float]]:
    """The oracle: one process, plain AdamW, the global batch (every rank's batch, concatenated)."""
    model = build_model(args)
    opt = make_optimizer(model.parameters(), args)
    losses = []
    for step in range(args.steps):
        xs, ys = zip(*(rank_batch(tokens, r, world_size, step, args) for r in range(world_size)))
        _, loss = model(torch.cat(xs), torch.cat(ys))  # mean over W*B*T tokens = mean of the W rank losses
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.cat([p.detach().flatten() for p in model.parameters()]), losses


def expect_adamw_equal(name: str, got: torch.Tensor, want: torch.Tensor, args: RunSettings) -> None:
    """fp32 ZeRO vs one-process AdamW: all but a rounding-level share of the weights within 1% of lr, and every
    weight within the most AdamW can move it in --steps steps (about lr per step, 2 lr apart in the worst case)."""
    diff = (got - want).abs()
    share = (diff > ORACLE_STEP_FRACTION * args.lr).double().mean().item()
    if share > MAX_ROUNDING_SHARE or diff.max().item() > 2 * args.steps * args.lr:
        raise cli.SelfCheckFailed(f"{name}: {share:.2%} of weights differ by more than {ORACLE_STEP_FRACTION} lr "
                                  f"(allowed {MAX_ROUNDING_SHARE:.1%}), max abs error {diff.max().item():.3g}")


def memory_summary(rows: list[dict]) -> list[dict]:
    """One row per (precision, stage) from zero.py's per-kind memory rows: bytes by kind and the worst ratio."""
    out: dict[tuple, dict] = {}
    for r in rows:
        row = out.setdefault((r["precision"], r["stage"]), {"precision": r["precision"], "stage": r["stage"]})
        row[f"{r['kind']}_B"] = r["measured_B"]
        row["off_formula"] = max(row.get("off_formula", 0.0), abs(float(r["ratio"]) - 1))
        if r["kind"] == "total":
            row["peak_B"] = r["peak_B"]
    keys = ("precision", "stage", "params_B", "grads_B", "optimizer_B", "total_B", "peak_B")
    return [{**{k: row[k] for k in keys}, "off_formula": f"{row['off_formula']:.1%}"} for row in out.values()]


def draw_memory(args, rows: list[dict], world_size: int, num_params: int) -> None:
    """zero_memory.png: per precision, stacked bars of the bytes one rank holds (params, grads, optimizer) per
    stage, measured; a black tick marks the formula's total and a hollow box the peak during a step."""
    from mlsys import plot

    summary = memory_summary(rows)
    precisions = list(dict.fromkeys(r["precision"] for r in summary))
    plt = plot.pyplot()
    fig, axes = plt.subplots(1, len(precisions), figsize=(5.5 * len(precisions), 4), squeeze=False)
    formula = {(r["precision"], r["stage"]): r["formula_B"] for r in rows if r["kind"] == "total"}
    for ax, precision in zip(axes[0], precisions):
        mine = [r for r in summary if r["precision"] == precision]
        x = list(range(len(mine)))
        bottom = [0.0] * len(mine)
        for kind, color in (("params", "C0"), ("grads", "C1"), ("optimizer", "C2")):
            kib = [r[f"{kind}_B"] / 1024 for r in mine]
            ax.bar(x, kib, bottom=bottom, color=color, label=kind)
            bottom = [b + k for b, k in zip(bottom, kib)]
        ax.bar(x, [r["peak_B"] / 1024 for r in mine], fill=False, edgecolor="gray", linestyle="--", label="peak")
        ax.scatter(x, [formula[(precision, r["stage"])] / 1024 for r in mine], marker="_", s=600, color="black",
                   zorder=3, label="formula total")
        ax.set_xticks(x, [f"stage {r['stage']}" for r in mine])
        ax.set(ylabel="KiB held by one rank", title=f"{precision}: {num_params:,} parameters, W={world_size}")
        ax.set_ylim(0, 1.4 * max(r["peak_B"] for r in mine) / 1024)  # room for the legend above the bars
        ax.legend(fontsize="small", ncol=3, loc="upper right")
    plot.save(fig, args, "zero_memory")
