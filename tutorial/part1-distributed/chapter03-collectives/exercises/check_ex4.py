"""Checker for ch03.4 — your row and column groups on 1 to 6 real ranks against numpy sums over the grid."""

from __future__ import annotations

import numpy as np
import torch

from mlsys.exercises import run_ranks, source_of, task


def _written(fn) -> None:
    """A stub's function still raises NotImplementedError: report the task as TODO before starting any rank."""
    if "NotImplementedError" in source_of(fn):
        raise NotImplementedError(f"TODO: write {fn.__name__}")


@task("grid_sums on 2x2, 2x3, 3x2, 1x3 and 1x1 grids: row and column sums equal numpy's; group ranks renumbered")
def check_grid(ex) -> None:
    _written(ex.grid_sums)  # the ranks call it through a given wrapper
    rng = np.random.default_rng(34)
    for rows, cols in [(2, 2), (2, 3), (3, 2), (1, 3), (1, 1)]:
        W = rows * cols
        xs = rng.integers(-50, 50, size=(W, 3)).astype(np.float32)  # integers: sums exact in any order
        grid = xs.reshape(rows, cols, 3)
        got = run_ranks(ex, "run_grid", [(torch.from_numpy(xs[r]), rows) for r in range(W)], timeout=30)
        for r, out in enumerate(got):
            i, j = divmod(r, cols)
            where = f"{rows}x{cols} grid, rank {r} (row {i}, column {j})"
            assert np.array_equal(out["row_sum"], grid[i].sum(0)), (
                f"{where}: row_sum {out['row_sum']}, want the sum over ranks {[i * cols + c for c in range(cols)]}: "
                f"{grid[i].sum(0).tolist()}")
            assert np.array_equal(out["col_sum"], grid[:, j].sum(0)), (
                f"{where}: col_sum {out['col_sum']}, want the sum over ranks {[k * cols + j for k in range(rows)]}: "
                f"{grid[:, j].sum(0).tolist()}")
            assert (out["row_rank"], out["col_rank"]) == (j, i), (
                f"{where}: row_rank, col_rank = {out['row_rank']}, {out['col_rank']}; want {j}, {i}: a rank is "
                f"numbered afresh inside each group (dist.get_rank(group)), not by its global rank")
