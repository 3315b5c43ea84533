"""Column- and row-parallel linear layers, and the Megatron MLP built from them, checked against the dense layers.

What it shows
    1. ColumnParallelLinear: rank r holds block r of W's rows (= A's columns, out/t of them); its output is split
       along the features. Gathered, it equals nn.Linear; the input gradient needs f's all-reduce in backward.
    2. RowParallelLinear: rank r holds block r of W's columns (= A's rows) and reads only its slice of the input
       features; g's all-reduce in forward sums the partial products.
    3. The Megatron MLP (column, GELU, row) against mlsys.model.MLP: output, input gradient and every weight
       gradient equal, with exactly ONE all-reduce forward and ONE backward, each of batch*seq*hidden*4 bytes.
    Every rank rebuilds the dense layers from the seed and compares; t = world size (any divisor of the sizes).
    Figure column_and_row_parallel_linear.png: Y = XA (A = W transposed, shape (in, out); X and Y with their real
    (B, T, features) shapes, the B sequences stacked) split both ways, drawn from the shards the ranks
    really held: each rank's block of A is located in the dense A (and checked to be that slice) before drawing.
    It marks f (before the column layer) and g (after the row layer) with the collectives each layer's forward
    and backward logged.

How to run
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_layers.py -w 2
    torchrun --nproc-per-node 4 tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_layers.py

Prints one line per check with its max abs error, and the collectives counted in the MLP.
Runtime on 2 cores: about 3 s (mostly process start-up); --smoke the same.

Try next
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_layers.py -w 4
        -> four ranks: four stripes in the figure, and still one all-reduce forward and one backward in the MLP
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_layers.py -w 3
        -> 64 is not divisible by 3: a one-line usage error (exit 2); add --hidden 48 and it runs
    torchrun --nproc-per-node 2 tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_layers.py --hidden 128
        -> the same checks under torchrun; the all-reduce bytes double with the width
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.launch import RankContext, launch
from mlsys.model import MLP, GPTConfig
from mlsys.tensor_parallel import TPMLP, ColumnParallelLinear, RowParallelLinear, comm_log


def logged(log: list) -> dict:
    """The collectives a comm_log recorded, per direction, as [op, bytes] pairs."""
    return {phase: [[e.op, e.nbytes] for e in log if e.phase == phase] for phase in ("forward", "backward")}


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    batch: int = 4
    """Sequences in the batch."""
    seq: int = 16
    """Tokens per sequence."""
    hidden: int = 64
    """Model width C; the MLP's inner width is 4C. Must be divisible by the world size."""

    def validate(self) -> None:
        for name in ("batch", "seq", "hidden"):
            if getattr(self, name) < 1:
                raise cli.UsageError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.hidden % self.world_size:
            raise cli.UsageError(f"--hidden {self.hidden} is not divisible by the tensor-parallel size "
                                 f"{self.world_size}")


def check(name: str, got: torch.Tensor, want: torch.Tensor, rows: list[dict]) -> None:
    got, want = got.detach(), want.detach()
    report.expect_close(name, got, want, rtol=1e-5, atol=1e-5)
    rows.append({"check": name, "shape": "x".join(map(str, got.shape)),
                 "max_abs_err": float((got - want).abs().max())})


# ----------------------------------------------------------------------------------------------- the two linears
def locate(shard: torch.Tensor, dense: torch.Tensor, dim: int) -> list[int]:
    """[lo, hi) of `shard` inside `dense` along `dim`, found by search and checked to be that exact slice."""
    n, t = shard.shape[dim], dense.shape[dim] // shard.shape[dim]
    for lo in range(0, dense.shape[dim], n):
        if torch.equal(dense.narrow(dim, lo, n), shard):
            return [lo, lo + n]
    raise cli.SelfCheckFailed(f"shard of shape {tuple(shard.shape)} is none of the {t} slices of {tuple(dense.shape)}")


def column_and_row(args: Settings, rows: list[dict], device: torch.device) -> dict:
    group, t, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    torch.manual_seed(args.seed)
    dense = torch.nn.Linear(args.hidden, 2 * args.hidden).to(device)  # the same on every rank: from the seed
    x = torch.randn(args.batch, args.seq, args.hidden).to(device)

    # column-parallel: output features split; gather_output=True all-gathers them for the comparison
    col = ColumnParallelLinear.from_dense(dense, group, gather_output=True)  # weight (2C/t, C)
    x_col = x.clone().requires_grad_(True)
    with comm_log() as col_log:  # f's all-reduce runs in backward (and gather_output's all-gather in forward)
        col(x_col).square().sum().backward()
    x_ref = x.clone().requires_grad_(True)
    y_ref = dense(x_ref)
    y_ref.square().sum().backward()
    check("column: output (gathered)", col(x).detach(), y_ref, rows)
    check("column: input grad", x_col.grad, x_ref.grad, rows)
    check("column: weight grad (rows of weight)", col.weight.grad, dense.weight.grad.chunk(t, 0)[r], rows)

    # row-parallel: input features split, rank r reads x[..., its C/t slice of 2C]
    ref = torch.nn.Linear(2 * args.hidden, args.hidden).to(device)
    row = RowParallelLinear.from_dense(ref, group)  # weight (C, 2C/t), bias (C,) replicated
    h = torch.randn(args.batch, args.seq, 2 * args.hidden).to(device)
    h_mine = h.chunk(t, -1)[r].clone().requires_grad_(True)  # (B, T, 2C/t)
    with comm_log() as row_log:  # g's all-reduce runs in forward
        out = row(h_mine)
        out.square().sum().backward()
    h_ref = h.clone().requires_grad_(True)
    out_ref = ref(h_ref)
    out_ref.square().sum().backward()
    check("row: output (after all-reduce)", out, out_ref, rows)
    check("row: input grad slice", h_mine.grad, h_ref.grad.chunk(t, -1)[r], rows)
    check("row: weight grad (columns of weight)", row.weight.grad, ref.weight.grad.chunk(t, 1)[r], rows)
    check("row: bias grad (replicated)", row.bias.grad, ref.bias.grad, rows)
    # where each rank's block sits in A = W^T (in, out): column-parallel owns columns, row-parallel owns rows
    mine = {"column": locate(col.weight.detach().T, dense.weight.detach().T, 1),
            "row": locate(row.weight.detach().T, ref.weight.detach().T, 0)}
    every = [None] * t
    dist.all_gather_object(every, mine)
    # the shapes drawn are those of the real tensors: X and Y keep their (B, T, features) shape
    return {"column": {"X": list(x.shape), "A": list(dense.weight.T.shape), "Y": list(y_ref.shape),
                       "blocks": [e["column"] for e in every], "logged": logged(col_log)},
            "row": {"X": list(h.shape), "A": list(ref.weight.T.shape), "Y": list(out_ref.shape),
                    "blocks": [e["row"] for e in every], "logged": logged(row_log)}}


# ----------------------------------------------------------------------------------------------- the MLP
# --8<-- [start:mlp_check]
def megatron_mlp(args: Settings, rows: list[dict], device: torch.device) -> dict:
    t, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(args.seed + 1)
    dense = MLP(GPTConfig(n_embd=args.hidden, n_head=1, vocab_size=8)).to(device)  # c_fc (4C, C), c_proj (C, 4C)
    x = torch.randn(args.batch, args.seq, args.hidden).to(device)
    tp = TPMLP(dense, dist.group.WORLD)

    x_tp = x.clone().requires_grad_(True)
    with comm_log() as log:
        y = tp(x_tp)  # (B, T, C) on every rank
        y.square().sum().backward()
    x_ref = x.clone().requires_grad_(True)
    y_ref = dense(x_ref)
    y_ref.square().sum().backward()

    check("MLP: output", y, y_ref, rows)
    check("MLP: input grad", x_tp.grad, x_ref.grad, rows)
    check("MLP: c_fc weight grad", tp.c_fc.weight.grad, dense.c_fc.weight.grad.chunk(t, 0)[r], rows)
    check("MLP: c_fc bias grad", tp.c_fc.bias.grad, dense.c_fc.bias.grad.chunk(t, 0)[r], rows)
    check("MLP: c_proj weight grad", tp.c_proj.weight.grad, dense.c_proj.weight.grad.chunk(t, 1)[r], rows)
    check("MLP: c_proj bias grad", tp.c_proj.bias.grad, dense.c_proj.bias.grad, rows)

    n_bytes = args.batch * args.seq * args.hidden * 4  # one (B, T, C) float32 activation
    counted = {phase: [e for e in log if e.phase == phase] for phase in ("forward", "backward")}
    want = 0 if t == 1 else 1
    for phase, events in counted.items():
        report.expect_equal(f"MLP all-reduces in {phase}", len(events), want)
        if events:
            report.expect_equal(f"MLP {phase} all-reduce op", events[0].op, "all_reduce")
            report.expect_equal(f"MLP {phase} all-reduce bytes", events[0].nbytes, n_bytes)
    return {"forward_all_reduces": len(counted["forward"]), "backward_all_reduces": len(counted["backward"]),
            "all_reduce_bytes": counted["forward"][0].nbytes if counted["forward"] else 0, "logged": logged(log),
            "observed": {"output": y.tolist(), "input_grad": x_tp.grad.tolist()}}  # for a test's own dense run
# --8<-- [end:mlp_check]


def worker(ctx: RankContext, args: Settings) -> dict:
    rows: list[dict] = []
    split = column_and_row(args, rows, ctx.device)
    counts = megatron_mlp(args, rows, ctx.device)
    ctx.print(f"tensor-parallel size t={ctx.world_size}; activations (B, T, C) = "
              f"({args.batch}, {args.seq}, {args.hidden}), float32")
    ctx.print(report.table(rows, floatfmt=".2e"))
    ctx.print(f"MLP collectives: forward {counts['forward_all_reduces']} all-reduce, backward "
              f"{counts['backward_all_reduces']} all-reduce, {counts['all_reduce_bytes']:,} bytes each "
              f"(= batch*seq*hidden*4)")
    if ctx.is_main:
        draw(args, split, ctx.world_size)
    return {"tp": ctx.world_size, "checks": rows, **counts, "split": split,
            "max_abs_err": max(row["max_abs_err"] for row in rows)}


def draw(args: Settings, split: dict, t: int) -> None:
    """Y = X A both ways, from the real shapes: X (B, T, in) drawn as B stacked sequences of T token rows,
    A (in, out), Y (B, T, out); each rank's part in its own colour, its slice of A written beside the box."""
    plt = plot.pyplot()
    from matplotlib.patches import Rectangle

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    tops = [max(split[k]["X"][0] * split[k]["X"][1], split[k]["A"][0]) for k in ("column", "row")]
    fig, axes = plt.subplots(2, 1, figsize=(11, 7), gridspec_kw={"height_ratios": tops})
    for ax, kind in zip(axes, ("column", "row")):
        (b, s, n_in), (_, n_out), blocks = split[kind]["X"], split[kind]["A"], split[kind]["blocks"]
        h = b * s  # X and Y: one row per token, sequences stacked
        gap = (0.9 if kind == "column" else 1.5) * max(n_in, n_out)  # room for the row blocks' labels
        y_at = n_in + n_out + (2 if kind == "column" else 2.15) * gap  # the row panel leaves room for g's note
        boxes = {"X": (0, n_in, h), "A": (n_in + gap, n_out, n_in), "Y": (y_at, n_out, h)}
        top = max(h, n_in)
        for x0, width, height in boxes.values():
            ax.add_patch(Rectangle((x0, top - height), width, height, fill=False, lw=1.5, edgecolor="black",
                                   zorder=3))
        for name in ("X", "Y"):  # thin lines between the B sequences
            x0, width, height = boxes[name]
            for i in range(1, b):
                ax.plot([x0, x0 + width], [top - i * s] * 2, color="black", lw=0.5, zorder=3)
        whole = "X" if kind == "column" else "Y"  # the operand every rank holds in full
        x0, width, height = boxes[whole]
        ax.add_patch(Rectangle((x0, top - height), width, height, color="gray", alpha=0.3))
        ax.text(n_in + gap / 2, top / 2, "x", ha="center", va="center", fontsize=16)
        eq_x = n_in + n_out + (1.5 if kind == "column" else 1.8) * gap  # right of the row blocks' labels
        ax.text(eq_x, top / 2, "=", ha="center", va="center", fontsize=16)
        # f sits on X's way into the column layer, g on Y's way out of the row layer; what each ran, as logged
        mark_x, mark = (n_in + gap / 2, "f") if kind == "column" else (eq_x, "g")
        ax.text(mark_x, top / 2 + 0.35 * top, mark, ha="center", va="center", fontsize=14, weight="bold",
                bbox={"boxstyle": "circle", "facecolor": "white", "edgecolor": "black"})
        ax.text(mark_x, top / 2 - 0.12 * top, mark_note(mark, split[kind]["logged"]), ha="center", va="top",
                fontsize=8)
        ax_a = boxes["A"][0]
        for r, (lo, hi) in enumerate(blocks):
            c = colors[r % len(colors)]
            if kind == "column":  # A's columns [lo, hi) -> Y's columns [lo, hi); X is whole on every rank
                ax.add_patch(Rectangle((ax_a + lo, top - n_in), hi - lo, n_in, color=c, alpha=0.6))
                ax.add_patch(Rectangle((boxes["Y"][0] + lo, top - h), hi - lo, h, color=c, alpha=0.6))
                ax.text(ax_a + (lo + hi) / 2, top - n_in / 2, f"rank {r}\n{lo}:{hi}", ha="center",
                        va="center", fontsize=8)
            else:  # A's rows [lo, hi) pair with X's columns [lo, hi); each rank makes a full-size partial Y
                ax.add_patch(Rectangle((boxes["X"][0] + lo, top - h), hi - lo, h, color=c, alpha=0.6))
                ax.add_patch(Rectangle((ax_a, top - hi), n_out, hi - lo, color=c, alpha=0.6))
                ax.text(ax_a + n_out + 2, top - (lo + hi) / 2, f"rank {r}: A[{lo}:{hi}, :]", ha="left",
                        va="center", fontsize=8)
        x_note = "whole on every rank" if kind == "column" else "split by its last dim"
        y_note = "split by its last dim:\nY_r = X A_r" if kind == "column" else "sum of the X_r A_r\n(g's all-reduce)"
        notes = {"X": (f"X {tuple(split[kind]['X'])}", x_note),
                 "A": (f"A = W^T {tuple(split[kind]['A'])}", f"{len(blocks)} blocks of {blocks[0][1] - blocks[0][0]} "
                       + ("columns (A[:, lo:hi])" if kind == "column" else "rows")),
                 "Y": (f"Y {tuple(split[kind]['Y'])}", y_note)}
        for name, (title, note) in notes.items():
            x0, width, height = boxes[name]
            ax.text(x0 + width / 2, top + 3, title, ha="center", va="bottom", fontsize=10, weight="bold")
            ax.text(x0 + width / 2, top - height - 3, note, ha="center", va="top", fontsize=9)
        ax.text(-3, top - s / 2, f"{s} tokens\n(sequence 0)", ha="right", va="center", fontsize=8)
        right = boxes["Y"][0] + n_out
        ax.set(xlim=(-0.35 * max(n_in, n_out), right + 5), ylim=(-0.3 * top, top + 0.2 * top), aspect="equal",
               title=f"{kind}-parallel, t={t}: " + ("A split by columns (output features)" if kind == "column"
                                                    else "A split by rows (input features)"))
        ax.axis("off")
    print(f"figure: {plot.save(fig, args, 'column_and_row_parallel_linear')}")  # its name is its caption


def mark_note(mark: str, log: dict) -> str:
    """What f (column layer) or g (row layer) ran, from the layer's logged collectives: f is its backward
    all-reduce, g its forward one. (The column layer's forward all-gather only gathers Y for the check.)"""
    phase, other = ("backward", "forward") if mark == "f" else ("forward", "backward")
    ran = [f"{nbytes:,} B" for op, nbytes in log[phase] if op == "all_reduce"]
    return (f"{mark}: {phase} all-reduce\n" + ("; ".join(ran) if ran else "(none at t=1)") + f"\n{other}: identity")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "batch": 2, "seq": 4, "hidden": 16},
                     world_sizes=range(1, 9), world_sizes_text="1..8 (dividing --hidden)")
    result = launch(worker, args)
    if result is None:
        return 0
    print(f"OK: column, row and MLP layers equal the dense ones (outputs and gradients) at t={args.world_size}")
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
