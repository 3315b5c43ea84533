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
MIXED_ROUNDING_SHARE = 1e-2  # the same for bf16 against its one-process oracle (see mixed_step_fraction)


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


def reference_mixed(tokens: torch.Tensor, world_size: int, args: RunSettings,
                    ranks: list[int] | None = None) -> torch.Tensor:
    """The mixed-precision oracle: the same bf16 recipe in ONE process. A bf16 model computes each rank's bf16
    gradient on that rank's batch; their fp32 sum / W is the gradient of an fp32 master copy that AdamW updates, and
    the master is rounded to bf16 for the next forward. Returns the fp32 master weights. `ranks` (default: all)
    picks whose gradients enter the sum: [0] is what a ZeRO with no gradient reduction computes on rank 0."""
    model = build_model(args).to(torch.bfloat16)
    params = list(model.parameters())
    master = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = make_optimizer(master, args)
    for step in range(args.steps):
        total = [torch.zeros_like(m) for m in master]
        for r in range(world_size) if ranks is None else ranks:
            model.zero_grad(set_to_none=True)
            model(*rank_batch(tokens, r, world_size, step, args))[1].backward()
            for t, p in zip(total, params):
                t += p.grad.float()
        for m, t in zip(master, total):
            m.grad = t / world_size
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)  # fp32 master -> bf16 weights
    return torch.cat([m.detach().flatten() for m in master])


def mixed_step_fraction(world_size: int, steps: int) -> float:
    """How far (in units of lr) bf16 ZeRO may drift from the one-process bf16 oracle, for most weights.

    The two differ only in how the W bf16 gradients are summed: the collective adds them in bf16, rounding each
    partial sum (unit roundoff u = 2^-8), the oracle in fp32. That perturbs a gradient by a relative (W - 1) u at
    most. Adam's step m / sqrt(v) is scale-free, so a relative error e in the gradients moves a step by about e lr;
    over `steps` steps the errors add up. The exceptions are weights where a rounding decides more than that: a
    gradient whose rank terms cancel (the sum's relative error is then far above (W-1) u, and Adam turns it into a
    step of its own), or a master weight that rounds to the other neighbouring bf16 value and changes the next
    forward. They are at most MIXED_ROUNDING_SHARE of the weights (about 0.5% in the 4-rank run); a missing or wrong
    reduction moves most of them (a ZeRO without its gradient reduction: about 90% beyond this bound)."""
    unit_roundoff = torch.finfo(torch.bfloat16).eps / 2  # 2^-8
    return max(world_size - 1, 1) * unit_roundoff * steps


def expect_mixed_equal(name: str, got: torch.Tensor, want: torch.Tensor, world_size: int,
                       args: RunSettings) -> float:
    """bf16 ZeRO vs the one-process bf16 oracle (reference_mixed); returns the share of weights outside the bound."""
    fraction = mixed_step_fraction(world_size, args.steps)
    diff = (got - want).abs()
    share = (diff > fraction * args.lr).double().mean().item()
    if share > MIXED_ROUNDING_SHARE or diff.max().item() > 2 * args.steps * args.lr:
        raise cli.SelfCheckFailed(f"{name}: {share:.2%} of weights differ from the one-process bf16 oracle by more "
                                  f"than {fraction:.3g} lr (allowed {MIXED_ROUNDING_SHARE:.0%}), max abs error "
                                  f"{diff.max().item():.3g}")
    return share


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
    print(f"figure: {plot.save(fig, args, 'zero_memory')}")


# ----------------------------------------------------------------------------------------------- the ZeRO grid
KINDS = ("params", "grads", "optimizer")
KIND_TITLES = {"params": "parameters", "grads": "gradients", "optimizer": "Adam state (m, v)"}
OPTIMIZER_TITLE = {"fp32": "Adam state (m, v)",  # fp32: the master weights ARE the parameters
                   "mixed": "Adam state (m, v, fp32 master)"}


def _unit_sizes(layout: dict) -> set[tuple[int, int]]:
    return {tuple(u) for u in layout["units"]}


FULL_COPY = "0.8"  # the grid's colour for a full copy of a unit: light grey, never a rank's colour


def rank_colours(world_size: int) -> list:
    """One colour per rank from the book's palette, leaving out its grey (equal red, green and blue), which the
    grid keeps for full copies; the palette has 9 other colours, enough for the script's 8 ranks."""
    from mlsys import plot

    palette = plot.colours(f"c{i}" for i in range(10)).values()
    return [c for c in palette if max(c) - min(c) > 0.05][:world_size]


def draw_rank_rows(ax, layouts: list[dict], key: str = "held", highlight: str | None = None,
                   precision: str = "fp32") -> list[dict]:
    """One row per rank, three blocks side by side (parameters, gradients, Adam state), each block the flat
    parameter vector (every unit's padded buffer, end to end). A held range is drawn grey when it is a full copy
    of its unit and in the rank's colour when it is the rank's own shard; with `highlight`, ranges that changed
    at this moment get a black hatch. Returns the boxes it drew (rank, kind, start, end, own): the tests read them."""
    from matplotlib.patches import Rectangle

    W = len(layouts)
    total = max(b for _, b in layouts[0]["units"])
    gap = 0.08 * total
    colour = rank_colours(W)
    drawn = []
    for r, layout in enumerate(layouts):
        y = W - 1 - r
        units = _unit_sizes(layout)
        for k, kind in enumerate(KINDS):
            x0 = k * (total + gap)
            ax.add_patch(Rectangle((x0, y - 0.4), total, 0.8, fill=False, edgecolor="0.6", linewidth=0.5))
            for a, b in layout[kind][key]:
                own = (a, b) not in units  # a whole unit is a full copy; anything else is this rank's slice
                ax.add_patch(Rectangle((x0 + a, y - 0.4), b - a, 0.8, color=colour[r] if own else FULL_COPY,
                                       linewidth=0))
                drawn.append({"rank": r, "kind": kind, "start": a, "end": b, "own": own,
                              "colour": tuple(colour[r]) if own else FULL_COPY})
            if highlight:
                for a, b in layout[kind]["changed"]:
                    ax.add_patch(Rectangle((x0 + a, y - 0.4), b - a, 0.8, fill=False, hatch="////",
                                           edgecolor="black", linewidth=0))
    ax.set_xlim(-gap / 2, 3 * total + 2.5 * gap)
    ax.set_ylim(-0.6, W - 0.4)
    ax.set_yticks(range(W), [f"rank {r}" for r in reversed(range(W))])
    titles = KIND_TITLES | {"optimizer": OPTIMIZER_TITLE.get(precision, KIND_TITLES["optimizer"])}
    ax.set_xticks([k * (total + gap) + total / 2 for k in range(3)], [titles[k] for k in KINDS], fontsize=8)
    ax.grid(False)
    return drawn


def draw_grid(args, runs: dict, precision: str = "fp32") -> tuple[object, list[dict]]:
    """zero_grid.png: for each stage, which elements of the flat parameters, gradients and Adam state every rank
    holds between steps, from the layouts the ranks recorded. Returns the path and the boxes drawn."""
    from mlsys import plot

    stages = sorted(int(name[5]) for name in runs if name.endswith(precision))
    plt = plot.pyplot()
    fig, axes = plt.subplots(len(stages), 1, figsize=(9, 1.0 + 0.55 * len(stages) * len(runs[
        f"stage{stages[0]}_{precision}"]["layout"])), squeeze=False)
    boxes = []
    for ax, stage in zip(axes[:, 0], stages):
        drawn = draw_rank_rows(ax, runs[f"stage{stage}_{precision}"]["layout"], precision=precision)
        boxes += [b | {"stage": stage} for b in drawn]
        ax.set_title(f"stage {stage}", fontsize=9, loc="left")
        layouts = runs[f"stage{stage}_{precision}"]["layout"]
        units = layouts[0]["units"]
        if len(units) > 1:  # stage 3: name each unit's slice (make_units' order: the root, then the blocks)
            total, top = max(b for _, b in units), len(layouts) - 0.4
            for k in range(len(KINDS)):
                for (a, b), name in zip(units, ["root"] + [f"blk{i}" for i in range(len(units) - 1)]):
                    ax.text(k * 1.08 * total + (a + b) / 2, top, name, ha="center", va="bottom", fontsize=6)
            ax.set_ylim(-0.6, top + 0.55)
    fig.suptitle(f"What each rank holds between steps, {precision} run (grey: a full copy; colour: the rank's own "
                 "shard)", fontsize=10)
    fig.tight_layout()
    return plot.save(fig, args, "zero_grid"), boxes


STEP_CAPTIONS = {
    "start": "before the step: full parameters, a zeroed gradient-shard buffer, a 1/W slice of Adam's state",
    "backward": "backward: every rank fills a full gradient of its own batch",
    "reduce-scatter": "reduce-scatter: rank r keeps the sum of slice r of everyone's gradients",
    "update": "update: rank r divides its slice by W and runs AdamW on slice r only",
    "all-gather": "all-gather: every rank receives the other slices of the parameters",
}


def draw_step(args, phases: list[list], precision: str = "fp32") -> tuple:
    """zero_step.gif (+ zero_step_strip.png): stage 2's first step, one frame per recorded moment; hatched: what
    changed since the previous frame. `phases` is per rank a list of (moment, layout)."""
    from mlsys import plot

    plt = plot.pyplot()
    W = len(phases)
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.45 * W))
    names = [name for name, _ in phases[0]]

    def draw(i: int) -> None:
        ax.clear()
        draw_rank_rows(ax, [phases[r][i][1] for r in range(W)], highlight="changed" if i else None,
                       precision=precision)
        ax.set_title(f"{i + 1}/{len(names)}  {STEP_CAPTIONS.get(names[i], names[i])}", fontsize=9, loc="left")

    return plot.animate(fig, draw, len(names), args, "zero_step", fps=0.7, strip_columns=2)
