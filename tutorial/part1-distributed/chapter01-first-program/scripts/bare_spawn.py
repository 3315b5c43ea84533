"""The whole distributed program with nothing from this book: torch.multiprocessing.spawn starts the ranks.

This is the program most tutorials begin with, and the one to copy into a notebook or a workshop: it imports
only torch and the standard library. It sets the rendezvous address itself, starts W processes with
`torch.multiprocessing.spawn`, and in each one joins the process group, runs one all_reduce, checks it against a
sum computed with no communication, and leaves the group. The book's launcher (mlsys.launch) does the same job;
chapter 1's lesson shows what it adds on top and why.

For the book, each rank also records its pid, its parent's pid and which process listens on the store's port
(`for_the_book`, with the chapter's _layout.py), and the parent draws the process tree (layout.png; printed as
`figure: <path>`). A copy of the program for your own use can drop those parts.

    python tutorial/part1-distributed/chapter01-first-program/scripts/bare_spawn.py -w 4
    torchrun --nproc-per-node 2 tutorial/part1-distributed/chapter01-first-program/scripts/bare_spawn.py
    python tutorial/part1-distributed/chapter01-first-program/scripts/bare_spawn.py -w 3 --crash-rank 1

Under torchrun the script does not spawn: torchrun has already started one copy per rank and set RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, so each copy runs the worker directly.
Exit codes: 0 the all_reduce matched, 1 a rank failed or the check failed, 2 bad flags.

Runtime on 2 cores: 13 to 40 s in the book's builds, nearly all of it the fresh processes each importing torch
(spawn re-imports; the book's launcher forks its ranks from a process that already has); --smoke (2 ranks) is
only a little faster.

Try next
    python tutorial/part1-distributed/chapter01-first-program/scripts/bare_spawn.py -w 3 --crash-rank 2
        -> rank 2 raises after joining; spawn terminates the others and reports the first failure it
           noticed, and the line above the traceback says whose: the culprit's own error or a victim's
           "Connection closed by peer" or "reset by peer" (usually the culprit's on a lightly loaded machine,
           a victim's mostly under load); exit 1
    python tutorial/part1-distributed/chapter01-first-program/scripts/bare_spawn.py -w 8 --numel 1000000
        -> eight ranks, a million numbers each: the same sum, still checked with no communication
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# --8<-- [start:worker]
def rank_tensor(rank: int, numel: int, seed: int) -> torch.Tensor:
    """What rank `rank` contributes: random numbers from its own seed, so any process can recompute them."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed + rank), dtype=torch.float64)


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """One rank. mp.spawn calls worker(i, *args) with i = 0..W-1 in W fresh processes."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank))  # set by torchrun; with spawn, one machine: = rank
    device = torch.device(f"cuda:{local_rank}" if args.backend == "nccl" else "cpu")
    if args.backend == "nccl":
        torch.cuda.set_device(device)
    # env:// rendezvous: MASTER_ADDR and MASTER_PORT come from the environment, rank and size from the call
    dist.init_process_group(args.backend, rank=rank, world_size=world_size)
    try:
        if rank == args.crash_rank:
            raise RuntimeError(f"rank {rank} crashes on purpose (--crash-rank)")
        x = rank_tensor(rank, args.numel, args.seed).to(device)
        dist.all_reduce(x)  # in place: every rank now holds the element-wise sum over all ranks
        # the check: the same sum computed here, with no communication, from every rank's seed
        expected = sum(rank_tensor(r, args.numel, args.seed) for r in range(world_size))
        err = (x.cpu() - expected).abs().max().item()
        # one write per line: print's separate writes of text and newline can interleave between processes
        sys.stdout.write(f"rank {rank} of {world_size} (pid {os.getpid()}, parent {os.getppid()}): all_reduce "
                         f"sum[:2] = [{x[0].item():.4f}, {x[1 % args.numel].item():.4f}], "
                         f"max error vs local sum {err:.1e}\n")
        sys.stdout.flush()
        if err > 1e-9 * world_size:
            raise RuntimeError(f"rank {rank}: all_reduce differs from the local sum by {err:.3g}")
        for_the_book(rank, world_size, x, err, args)  # the book's JSON and process picture: not needed to run
    finally:
        dist.destroy_process_group()  # leave the group, error or not
# --8<-- [end:worker]


# ---- for the book: record where each rank ran, and draw it. A copy of the program can drop all of this. ----
# --8<-- [start:book]
def for_the_book(rank: int, world_size: int, x: torch.Tensor, err: float, args: argparse.Namespace) -> None:
    """Collective: every rank observes its pids and the store's sockets; rank 0 writes the JSON and, under
    torchrun (no parent of ours to do it), draws the process tree itself."""
    import _layout  # this chapter's helper: standard library and /proc only

    mine = {"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
            "store": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            **_layout.observe(int(os.environ["MASTER_PORT"]))}
    ranks: list = [None] * world_size
    dist.all_gather_object(ranks, mine)
    if rank != 0:
        return
    layout = {"parent_pid": None, "ranks": ranks}
    if getattr(args, "layout_file", ""):  # spawned: the parent draws, with its own pid as the root
        with open(args.layout_file, "w") as f:
            json.dump(ranks, f)
    else:  # torchrun: our parent is torchrun's agent
        command = _layout.launcher_command(os.getppid(), f"torchrun --nproc-per-node {world_size}")
        title = f"{command}: the process tree"
        path, layout["drawn"] = _layout.draw(ranks, os.getppid(), {os.getppid(): "torchrun (its elastic agent)"},
                                             args, "layout", title)
        print(f"figure: {path}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k != "layout_file"} |
                       {"world_size": world_size},
                       "results": {"sum": x.cpu().tolist(), "max_error": err, "layout": layout}}, f, indent=1)
# --8<-- [end:book]


def layout_file() -> str:
    import tempfile

    fd, path = tempfile.mkstemp(prefix="bare_spawn_layout_", suffix=".json")
    os.close(fd)
    return path


def draw_spawn_layout(args: argparse.Namespace) -> None:
    """In the parent, after mp.spawn returned: draw the tree from the ranks' observations, rooted at our own pid."""
    import _layout

    with open(args.layout_file) as f:
        text = f.read()
    os.unlink(args.layout_file)
    if not text:  # the job failed before rank 0 wrote it
        return
    ranks = json.loads(text)
    path, drawn = _layout.draw(ranks, os.getpid(), {os.getpid(): "python bare_spawn.py (calls mp.spawn)"}, args,
                               "layout", f"mp.spawn, {len(ranks)} ranks: the process tree")
    print(f"figure: {path}")
    if args.json:  # rank 0 wrote the results; add what the parent itself knows
        with open(args.json) as f:
            doc = json.load(f)
        doc["results"]["layout"].update(parent_pid=os.getpid(), drawn=drawn)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-w", "--world-size", type=int, default=4, help="number of ranks to spawn (default 4)")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                        help="auto: nccl with one GPU per rank, else gloo")
    parser.add_argument("--numel", type=int, default=8, help="elements per rank's tensor (default 8)")
    parser.add_argument("--crash-rank", type=int, default=-1, help="this rank raises after joining the group")
    parser.add_argument("--seed", type=int, default=0, help="seed of rank 0's tensor; rank r uses seed + r")
    parser.add_argument("--smoke", action="store_true", help="the smallest run: 2 ranks, 4 elements")
    parser.add_argument("--json", default="", help="rank 0 writes its settings and results here")
    parser.add_argument("--plot-dir", default="", help="where the process-layout figure goes "
                        "(default: .cache/figures/bare_spawn)")

    def usage_error(message: str) -> None:  # one line and exit code 2, like every script in the book
        print(f"{os.path.basename(sys.argv[0])}: {message}", file=sys.stderr)
        sys.exit(2)

    parser.error = usage_error
    args = parser.parse_args()
    if args.smoke:  # the smoke preset changes the defaults; flags given explicitly still win
        parser.set_defaults(world_size=2, numel=4)
        args = parser.parse_args()
    gpus = torch.cuda.device_count()
    if args.backend == "auto":
        args.backend = "nccl" if gpus >= args.world_size and dist.is_nccl_available() else "gloo"
    if args.world_size < 1 or args.numel < 1:
        usage_error(f"-w and --numel must be >= 1, got {args.world_size} and {args.numel}")
    if args.backend == "nccl" and gpus < int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size)):
        usage_error(f"--backend nccl needs one GPU per rank; this machine has {gpus}")
    return args


# --8<-- [start:main]
def free_port() -> int:
    """A port the OS says is free now. It is closed again before rank 0 binds it, so another program can take it
    in between: the race the book's launcher avoids by binding the store itself."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    args = parse_args()
    if "RANK" in os.environ:  # torchrun started this copy and set the rendezvous: just be one rank
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the children inherit the environment
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    print(f"parent pid {os.getpid()}: spawning {args.world_size} ranks; they meet at "
          f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    args.layout_file = layout_file()  # for the book's figure: rank 0 leaves what the ranks observed there
    try:
        mp.spawn(worker, args=(args.world_size, args), nprocs=args.world_size, join=True)
    except mp.ProcessRaisedException as err:  # a rank raised: spawn stopped the others and passes its traceback
        who = ("" if args.crash_rank < 0 else " (the culprit)" if err.error_index == args.crash_rank
               else f" (a victim: rank {args.crash_rank} is the one that crashed)")
        print(f"a rank failed; the others were terminated. spawn passes on the traceback of rank "
              f"{err.error_index}{who}:\n{err}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as err:  # a rank died without a Python exception (a signal, os._exit)
        print(f"a rank died: {err}", file=sys.stderr)
        return 1
    finally:
        draw_spawn_layout(args)  # the book's figure of the processes that ran (skipped if the job failed)
    return 0


if __name__ == "__main__":  # required: spawn re-imports this file in every child
    sys.exit(main())
# --8<-- [end:main]
