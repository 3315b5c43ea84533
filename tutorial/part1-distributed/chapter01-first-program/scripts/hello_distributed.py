"""Hello, distributed world: every rank all-gathers and all-reduces, then checks what it received.

What it shows
    Each of W ranks builds its own small tensor, then two collectives run:
      all_gather  -> every rank ends up holding every rank's tensor, in rank order;
      all_reduce  -> every rank ends up holding the element-wise sum over all ranks.
    Each rank computes the values it must hold on its own (no communication) and compares: a mismatch makes the
    script exit 1. Rank 0 prints what every rank held before and after, in rank order, and draws it.

How to run (any world size >= 1)
    python tutorial/part1-distributed/chapter01-first-program/scripts/hello_distributed.py -w 4
    torchrun --nproc-per-node 4 tutorial/part1-distributed/chapter01-first-program/scripts/hello_distributed.py
    python tutorial/part1-distributed/chapter01-first-program/scripts/hello_distributed.py -w 4 --crash-rank 1
        # rank 1 raises: watch the launcher stop the whole job and exit non-zero
    python tutorial/part1-distributed/chapter01-first-program/scripts/hello_distributed.py -w 4 --verbose
        # trace every collective call on every rank (on stderr)

Runtime on 2 idle cores: about 5 s (mostly starting the processes and importing torch), 4 s with --smoke; two or
three times that on a busy machine.

Try next
    python tutorial/part1-distributed/chapter01-first-program/scripts/hello_distributed.py -w 8 --numel 2
        -> eight ranks; the all_reduce row is [56.0, 64.0] on every rank (see expected_sum)
    python tutorial/part1-distributed/chapter01-first-program/scripts/hello_distributed.py -w 3 --crash-rank 2
        -> rank 2's traceback, the other ranks stopped within seconds, exit code 1
    torchrun --nproc-per-node 2 tutorial/part1-distributed/chapter01-first-program/scripts/hello_distributed.py
        -> the same checks for 2 ranks, with torchrun starting the two processes instead of the script
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.launch import RankContext, launch


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 4
    """Number of ranks to start. Under torchrun it is taken from WORLD_SIZE."""
    numel: int = 3
    """Elements in each rank's tensor."""
    crash_rank: int = -1
    """Make this rank raise an error after the first collective (to see a failing job end cleanly)."""

    def validate(self) -> None:
        if self.numel < 1:
            raise cli.UsageError(f"--numel must be at least 1, got {self.numel}")
        if self.crash_rank >= self.world_size:
            raise cli.UsageError(f"--crash-rank {self.crash_rank} is not a rank of a world of {self.world_size}")


# --8<-- [start:expected]
def local_tensor(rank: int, numel: int) -> torch.Tensor:
    """Rank r holds [r*n, r*n + 1, ..., r*n + n - 1]: distinct values, so we can see where each one lands."""
    return torch.arange(rank * numel, (rank + 1) * numel, dtype=torch.float32)


def expected_gather(world_size: int, numel: int) -> torch.Tensor:
    # shape (world_size, numel): row r is rank r's tensor
    return torch.stack([local_tensor(r, numel) for r in range(world_size)])


def expected_sum(world_size: int, numel: int) -> torch.Tensor:
    # element i of the sum is sum_r (r*n + i) = n * W(W-1)/2 + W*i
    i = torch.arange(numel, dtype=torch.float32)
    return numel * world_size * (world_size - 1) / 2 + world_size * i
# --8<-- [end:expected]


# --8<-- [start:worker]
def worker(ctx: RankContext, args: Settings) -> dict:
    x = local_tensor(ctx.rank, args.numel).to(ctx.device)
    ctx.print(f"world_size={ctx.world_size} backend={ctx.backend} device={ctx.device}")
    ctx.print_ordered(f"before:     {x.tolist()}")

    # all_gather: a list of W empty tensors is filled with every rank's x, in rank order.
    gathered = [torch.empty_like(x) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, x)
    if ctx.rank == args.crash_rank:
        raise RuntimeError(f"rank {ctx.rank} crashes on purpose (--crash-rank)")
    ctx.print_ordered(f"all_gather: {torch.stack(gathered).flatten().tolist()}")

    # all_reduce works in place: afterwards every rank's tensor holds the sum over ranks.
    summed = x.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    ctx.print_ordered(f"all_reduce: {summed.tolist()}")

    # Self-check on every rank against values computed without any communication.
    report.expect_equal(f"rank {ctx.rank} all_gather", torch.stack(gathered),
                        expected_gather(ctx.world_size, args.numel))
    report.expect_equal(f"rank {ctx.rank} all_reduce", summed, expected_sum(ctx.world_size, args.numel))

    # Collect what each rank really holds, so rank 0 can report and draw it.
    held = [None] * ctx.world_size
    dist.all_gather_object(held, {"before": x.tolist(), "gathered": torch.stack(gathered).flatten().tolist(),
                                  "summed": summed.tolist(), "process": where_am_i(ctx)})
    return {"world_size": ctx.world_size, "backend": ctx.backend, "per_rank": held}
# --8<-- [end:worker]


def where_am_i(ctx: RankContext) -> dict:
    """For the process-layout figure: this rank's pids and what it sees of the store's sockets (see _layout.py)."""
    import _layout  # this chapter's helper

    port = int(os.environ["MASTER_PORT"])
    return {"rank": ctx.rank, "local_rank": ctx.local_rank, "store": f"{os.environ['MASTER_ADDR']}:{port}",
            **_layout.observe(port)}


def draw_layout(result: dict, args: Settings) -> tuple[str, dict]:
    """The process tree the ranks observed, rooted at this process (the launcher), or at torchrun's agent."""
    import _layout

    ranks = [held["process"] for held in result["per_rank"]]
    if cli.under_torchrun():
        root, roles = os.getppid(), {os.getppid(): "torchrun (its elastic agent)"}
        title = f"torchrun --nproc-per-node {len(ranks)} hello_distributed.py: the process tree"
    else:
        root = os.getpid()
        roles = {root: "python hello_distributed.py (the launcher)"}
        roles |= {r["ppid"]: "fork server (torch already imported)" for r in ranks if r["ppid"] != root}
        title = f"The book's launcher, {len(ranks)} ranks: the process tree"
    return _layout.draw(ranks, root, roles, args, "layout", title)


def draw(result: dict, args: Settings) -> str:
    plt = plot.pyplot()
    import seaborn as sns

    panels = [("before", "before: own tensor"), ("gathered", "after all_gather"), ("summed", "after all_reduce (sum)")]
    fig, axes = plt.subplots(1, 3, figsize=(12, 1.8 + 0.5 * result["world_size"]),
                             gridspec_kw={"width_ratios": [1, result["world_size"], 1]})
    # One colour scale for all three panels, so that equal numbers have equal shades everywhere.
    values = [v for row in result["per_rank"] for key, _ in panels for v in row[key]]
    vmin, vmax = min(values), max(values)
    for ax, (key, title) in zip(axes, panels):
        grid = [row[key] for row in result["per_rank"]]
        sns.heatmap(grid, annot=len(grid[0]) <= 24, fmt="g", cbar=False, cmap="crest", ax=ax, linewidths=0.5,
                    vmin=vmin, vmax=vmax)
        ax.set_title(title)
        ax.set_xlabel("element")
        ax.set_ylabel("rank")
    fig.suptitle(f"What each of {result['world_size']} ranks holds (one colour scale for all panels)")
    fig.tight_layout()
    return str(plot.save(fig, args, "placement"))


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "numel": 2}, world_sizes=lambda w: w >= 1,
                     world_sizes_text=">= 1")
    torch.manual_seed(args.seed)
    result = launch(worker, args)
    if result is None:  # a non-zero torchrun rank: rank 0 reports
        return 0
    print(f"OK: all_gather and all_reduce match the expected values on all {result['world_size']} ranks")
    print(f"figure: {draw(result, args)}")
    path, drawn = draw_layout(result, args)
    print(f"figure: {path}")
    result["layout"] = {"parent_pid": None if cli.under_torchrun() else os.getpid(), "drawn": drawn}
    if args.json:
        report.write_json(args.json, {"ok": True, **result}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
