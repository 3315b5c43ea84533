"""Process subgroups: the ranks as an R x C grid, a group per row and per column, collectives inside each group.

What it shows
    1. dist.new_group(ranks) for every row and every column of the grid. Every rank must call new_group for
       every group, in the same order, even for groups it is not in: creating a group is itself collective.
    2. Group rank vs global rank: rank g sits at (i, j) = divmod(g, C); in its row group it is rank j, in its
       column group rank i. dist.get_rank(group) and dist.get_global_rank(group, k) translate.
    3. Collectives inside a group: all_reduce over the row (the row's sum, on the C ranks of that row only),
       all_gather over the column, and broadcast from the column's group rank 0 (group_src=0, not a global rank).
       Every result is checked against numpy on the whole (R, C) grid of values, rebuilt from the seed.
    4. DeviceMesh, the modern way to name the same groups: init_device_mesh(device, (R, C),
       mesh_dim_names=("dp", "tp")). The mesh's "tp" group is a row, its "dp" group a column; the script checks
       that they hold the same ranks as the hand-made groups and give the same sums.
    The figure (groups.png, printed as `figure: <path>`) draws the grid twice, every rank a cell coloured by its
    row group (left) or its column group (right), with the group's members as the group object reports them
    (dist.get_process_group_ranks), the rank's x, and what the row all_reduce and the column broadcast left there.
    The JSON keeps every rank's cell under `cells`.

How to run (any world size from 1 to 8; --rows 0 picks the most square grid)
    python tutorial/part1-distributed/chapter03-collectives/scripts/subgroups.py -w 4
    python tutorial/part1-distributed/chapter03-collectives/scripts/subgroups.py -w 8 --rows 4
    torchrun --nproc-per-node 4 tutorial/part1-distributed/chapter03-collectives/scripts/subgroups.py

Runtime on 2 idle cores: about 6 s (process start-up, group creation and drawing dominate); two or three times
that on a busy machine.

Try next
    python tutorial/part1-distributed/chapter03-collectives/scripts/subgroups.py -w 6 --rows 3 --all-ranks
        -> every rank's line also shows what its column gathered (the other lines are printed once either way)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mlsys import cli, plot, report
from mlsys.launch import RankContext, launch


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 4
    """Number of ranks to start (1 to 8). Under torchrun it is taken from WORLD_SIZE."""
    rows: int = 0
    """Rows R of the grid (R must divide W); 0: the largest divisor of W not above sqrt(W)."""
    numel: int = 3
    """Elements of each rank's vector."""

    def validate(self) -> None:
        if self.rows < 0 or (self.rows and self.world_size % self.rows):
            raise cli.UsageError(f"--rows must divide the world size {self.world_size}, got {self.rows}")
        if self.numel < 1:
            raise cli.UsageError(f"--numel must be >= 1, got {self.numel}")


def grid_shape(world_size: int, rows: int) -> tuple[int, int]:
    R = rows or max(d for d in range(1, math.isqrt(world_size) + 1) if world_size % d == 0)
    return R, world_size // R


def values(seed: int, world_size: int, numel: int) -> np.ndarray:
    """(W, numel) small integers: row g is rank g's vector. Every rank rebuilds all of them for the checks."""
    return np.random.default_rng(seed).integers(0, 10, size=(world_size, numel)).astype(np.float64)


# --8<-- [start:groups]
def make_groups(R: int, C: int) -> tuple[list, list]:
    """One group per row and one per column. Every rank runs all of this, for every group, in the same order."""
    row_groups = [dist.new_group([i * C + j for j in range(C)]) for i in range(R)]
    col_groups = [dist.new_group([i * C + j for i in range(R)]) for j in range(C)]
    return row_groups, col_groups


def in_groups(x: torch.Tensor, row, col, C: int) -> dict[str, torch.Tensor]:
    """Collectives that involve only this rank's row, or only its column."""
    row_sum = x.clone()
    dist.all_reduce(row_sum, group=row)  # the C ranks of this row only
    col_parts = [torch.empty_like(x) for _ in range(dist.get_world_size(col))]
    dist.all_gather(col_parts, x, group=col)  # the R ranks of this column only
    top = x.clone()
    dist.broadcast(top, group_src=0, group=col)  # group rank 0 of the column: global rank j, not global rank 0
    return {"row_sum": row_sum, "col_gather": torch.stack(col_parts), "col_top": top}
# --8<-- [end:groups]


def worker(ctx: RankContext, args: Settings) -> dict:
    W, g = ctx.world_size, ctx.rank
    R, C = grid_shape(W, args.rows)
    i, j = divmod(g, C)
    grid = values(args.seed, W, args.numel).reshape(R, C, args.numel)  # the numpy reference, every rank's data
    x = torch.tensor(grid[i, j], device=ctx.device)

    row_groups, col_groups = make_groups(R, C)
    row, col = row_groups[i], col_groups[j]
    report.expect_equal(f"rank {g}'s rank in its row group", dist.get_rank(row), j)
    report.expect_equal(f"rank {g}'s rank in its column group", dist.get_rank(col), i)
    report.expect_equal(f"global rank of row {i}'s group rank 0", dist.get_global_rank(row, 0), i * C)
    got = {k: v.cpu().numpy() for k, v in in_groups(x, row, col, C).items()}
    report.expect_equal(f"row sum on rank {g}", got["row_sum"].tolist(), grid[i].sum(0).tolist())
    report.expect_equal(f"column gather on rank {g}", got["col_gather"].tolist(), grid[:, j].tolist())
    report.expect_equal(f"column broadcast on rank {g}", got["col_top"].tolist(), grid[0, j].tolist())

    # --8<-- [start:mesh]
    mesh = init_device_mesh(ctx.device.type, (R, C), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")  # tp: along a row (same i); dp: down a column (same j)
    mesh_sum = x.clone()
    dist.all_reduce(mesh_sum, group=tp)
    # --8<-- [end:mesh]
    report.expect_equal(f"mesh tp group on rank {g}", dist.get_process_group_ranks(tp), [i * C + q for q in range(C)])
    report.expect_equal(f"mesh dp group on rank {g}", dist.get_process_group_ranks(dp), [q * C + j for q in range(R)])
    report.expect_equal(f"mesh coordinates of rank {g}", (mesh.get_local_rank("dp"), mesh.get_local_rank("tp")), (i, j))
    report.expect_equal(f"mesh tp sum on rank {g}", mesh_sum.cpu().tolist(), grid[i].sum(0).tolist())

    ctx.print(f"{W} ranks as a {R} x {C} grid (rank = i * {C} + j):", all_ranks=False)  # headers: once
    ctx.print("\n".join("   " + " ".join(f"{i_ * C + j_:3d}" for j_ in range(C)) for i_ in range(R)), all_ranks=False)
    gathered = f"  column gathered {got['col_gather'].tolist()}" if ctx.all_ranks else ""  # --all-ranks: more
    ctx.print_ordered(f"(i, j) = ({i}, {j})  row-group rank {dist.get_rank(row)}  column-group rank "
                      f"{dist.get_rank(col)}  x {grid[i, j].tolist()}  row sum {got['row_sum'].tolist()}  "
                      f"column's top {got['col_top'].tolist()}{gathered}")
    ctx.print(f"DeviceMesh {mesh.mesh.tolist()}: 'tp' groups are the rows, 'dp' groups the columns; "
              "same ranks and same sums as the hand-made groups", all_ranks=False)
    cell = {"rank": g, "at": [i, j], "row_group": dist.get_process_group_ranks(row),
            "col_group": dist.get_process_group_ranks(col), "x": x.cpu().tolist(),
            "row_sum": got["row_sum"].tolist(), "col_top": got["col_top"].tolist()}
    cells: list = [None] * W
    dist.all_gather_object(cells, cell)  # what every rank held and got, for the picture
    return {"grid": [R, C], "row_sums": grid.sum(1).tolist(), "cells": cells, "ok": True}


def draw(cells: list[dict], R: int, C: int, args: Settings) -> str:
    """The grid twice: left, each rank's cell coloured by its row group, with its x and the row's all_reduce sum;
    right, coloured by its column group, with its x and what the column's broadcast from group rank 0 left."""
    plt = plot.pyplot()
    import seaborn as sns

    fig, axes = plt.subplots(1, 2, figsize=(2 * (1.0 + 2.1 * C), 0.9 + 1.15 * R), squeeze=False)
    for ax, (group, result, title) in zip(axes[0], (
            ("row_group", "row_sum", "row groups: all_reduce(x, group=row)"),
            ("col_group", "col_top", "column groups: broadcast(x, group_src=0, group=col)"))):
        groups = list(dict.fromkeys(tuple(c[group]) for c in cells))  # in order of first appearance
        tints = [tuple(0.5 + 0.5 * v for v in rgb) for rgb in sns.color_palette("colorblind", len(groups))]
        for c in cells:
            i, j = c["at"]
            k = groups.index(tuple(c[group]))
            ax.add_patch(plt.Rectangle((j, R - 1 - i), 0.96, 0.94, facecolor=tints[k], edgecolor="black"))
            fmt = " ".join(f"{v:g}" for v in c["x"])
            got = " ".join(f"{v:g}" for v in c[result])
            ax.text(j + 0.48, R - 1 - i + 0.47, f"rank {c['rank']}: rank {c[group].index(c['rank'])} of group "
                    f"{list(c[group])}\nx = {fmt}\n"
                    f"after: {got}", ha="center", va="center", fontsize=8)
        ax.set_xlim(0, C)
        ax.set_ylim(0, R)
        ax.set_xticks([j + 0.48 for j in range(C)], [f"j = {j}" for j in range(C)], fontsize=8)
        ax.set_yticks([R - 1 - i + 0.47 for i in range(R)], [f"i = {i}" for i in range(R)], fontsize=8)
        ax.grid(False)
        ax.set_title(title, fontsize=9)
    fig.suptitle(f"{len(cells)} ranks as a {R} x {C} grid (rank = i * {C} + j); colour = the group of the "
                 "collective", fontsize=9)
    fig.tight_layout()
    return str(plot.save(fig, args, "groups"))


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"numel": 2}, world_sizes=range(1, 9), world_sizes_text="1..8")
    result = launch(worker, args)
    if result is None:
        return 0
    R, C = result["grid"]
    print(f"OK: row sums, column gathers and broadcasts, group ranks and the DeviceMesh's groups match numpy on "
          f"all {args.world_size} ranks ({R} x {C})")
    print(f"figure: {draw(result['cells'], R, C, args)}")
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
