"""Rendezvous by hand: build a process group from a bare key-value store, once over TCP and once over a file.

What it shows
    Under init_process_group sits a key-value store that every rank can reach. This script builds a process
    group from a bare store by hand, with a small rendezvous protocol of its own (more than torch runs: see
    `rendezvous` below), for two kinds of store:
      tcp   a TCPStore server hosted by rank 0 on a port the kernel picks (what env:// and tcp:// use);
      file  a FileStore: a file every rank can open (what file:// uses; on a cluster, a shared disk).
    For each store every rank: registers its address under its own key, takes a ticket from an atomic counter
    (its arrival order), waits until every rank's key exists, reads all the addresses; then hands the store to
    gloo, which runs its own exchange through it to build a new process group. An all_reduce over that new group
    is checked against W(W+1)/2 (rank r contributes r + 1). Rank 0 prints what each rank saw and how long each
    step took, draws the steps as one bar per rank and store, prints the `stores:` line (where the job's own
    store, the launcher's or torchrun's, and the hand-built TCPStore listened) and one sentence on the FileStore's
    last ticket: whether its blue bar was the shortest and its orange bar the longest (`file_store_text` in the
    JSON).

How to run (any world size >= 1)
    python tutorial/part1-distributed/chapter01-first-program/scripts/rendezvous.py -w 4
    torchrun --nproc-per-node 3 tutorial/part1-distributed/chapter01-first-program/scripts/rendezvous.py

Contract flags: --smoke uses 2 ranks and 1 round; --seed changes nothing, as nothing here is random (the arrival
tickets differ between runs because the ranks race to the store, which is the point).

Runtime on 2 idle cores: about 4 s (3 s with --smoke); two or three times that on a busy machine.

Try next
    python tutorial/part1-distributed/chapter01-first-program/scripts/rendezvous.py -w 6
        -> six tickets 1..6 per store, in an order that changes from run to run
    torchrun --nproc-per-node 3 tutorial/part1-distributed/chapter01-first-program/scripts/rendezvous.py
        -> the same protocol inside a torchrun job: the hand-built stores sit beside torchrun's
    torchrun --nproc-per-node 2 tutorial/part1-distributed/chapter01-first-program/scripts/bare_spawn.py
        -> no launcher, no store by hand: the bare init_process_group program
    python tutorial/part1-distributed/chapter01-first-program/scripts/rendezvous.py &
    python tutorial/part1-distributed/chapter01-first-program/scripts/rendezvous.py --plot-dir /tmp/rv2; wait
        -> two jobs at once (the second draws into /tmp/rv2), both OK: their `stores:` lines show different
           ports, as each launcher got its own free port; their other lines interleave
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.launch import RankContext, launch


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 4
    """Number of ranks to start. Under torchrun it is taken from WORLD_SIZE."""
    rounds: int = 3
    """all_reduce calls timed on each hand-built group."""

    def validate(self) -> None:
        if self.rounds < 1:
            raise cli.UsageError(f"--rounds must be at least 1, got {self.rounds}")


def open_store(kind: str, ctx: RankContext, tmpdir: str | None) -> dist.Store:
    """Rank 0 creates the store. Only its address travels over the job's existing group, standing in for what a
    launcher hands every rank before any group exists (MASTER_ADDR and MASTER_PORT, or a tcp:// or file:// URL);
    everything after that goes through the new store alone."""
    if kind == "tcp":
        server = dist.TCPStore("127.0.0.1", 0, ctx.world_size, is_master=True, wait_for_workers=False) \
            if ctx.rank == 0 else None
        port = [server.port if server else None]
        dist.broadcast_object_list(port, src=0)  # in a real job: MASTER_PORT, or the port in tcp://host:port
        return server or dist.TCPStore("127.0.0.1", port[0], ctx.world_size, is_master=False)
    path = [os.path.join(tmpdir, "rendezvous") if ctx.rank == 0 else None]
    dist.broadcast_object_list(path, src=0)  # in a real job: the path in file:///shared/disk/rendezvous
    return dist.FileStore(path[0], ctx.world_size)


# --8<-- [start:protocol]
def rendezvous(store: dist.Store, ctx: RankContext) -> tuple[int, list[str]]:
    """Register, take a ticket, wait for everyone, read everyone: a hand-written rendezvous over a store.

    init_process_group itself does less: by default it runs no store barrier (TORCH_DIST_INIT_BARRIER=0); the
    store counts the clients that connect, and the backend (gloo, NCCL) exchanges its own addresses through it."""
    store.set(f"addr/{ctx.rank}", f"{socket.gethostname()}:{os.getpid()}")  # where to find me
    ticket = store.add("arrivals", 1)  # atomic: returns 1 for the first rank to get here, W for the last
    keys = [f"addr/{r}" for r in range(ctx.world_size)]
    store.wait(keys, datetime.timedelta(seconds=30))  # blocks until every rank has registered
    return ticket, [store.get(k).decode() for k in keys]


def group_from_store(store: dist.Store, ctx: RankContext, kind: str) -> dist.ProcessGroup:
    # gloo runs its own exchange of connection details through the store; the prefix keeps its keys apart
    return dist.ProcessGroupGloo(dist.PrefixStore(f"gloo/{kind}", store), ctx.rank, ctx.world_size,
                                 datetime.timedelta(seconds=30))
# --8<-- [end:protocol]


def one_store(kind: str, ctx: RankContext, args: Settings, tmpdir: str | None) -> dict:
    start = time.perf_counter()
    store = open_store(kind, ctx, tmpdir)
    ticket, peers = rendezvous(store, ctx)
    met = time.perf_counter()
    group = group_from_store(store, ctx, kind)
    built = time.perf_counter()
    for _ in range(args.rounds):
        t = torch.tensor([float(ctx.rank + 1)])
        group.allreduce([t]).wait()  # the process-group object's own call: no default group involved
    done = time.perf_counter()
    report.expect_equal(f"rank {ctx.rank} all_reduce over the {kind} group", t,
                        torch.tensor([ctx.world_size * (ctx.world_size + 1) / 2]))
    dist.barrier()  # every client is done before rank 0's store server goes away
    del group
    return {"store": kind, "port": store.port if kind == "tcp" else None,
            "ticket": ticket, "peers_seen": len(peers), "all_reduce": t.item(),
            "rendezvous_ms": 1e3 * (met - start), "build_group_ms": 1e3 * (built - met),
            "all_reduce_ms": 1e3 * (done - built) / args.rounds}


def worker(ctx: RankContext, args: Settings) -> dict:
    rows = []
    # the job's own store: where the launcher (or torchrun) told this rank to meet the others
    stores = {"the job's store": f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"}
    with tempfile.TemporaryDirectory() as tmpdir:
        for kind in ("tcp", "file"):
            mine = one_store(kind, ctx, args, tmpdir if ctx.rank == 0 else None)
            port = mine.pop("port")
            if port:
                stores["hand-built TCPStore"] = f"127.0.0.1:{port}"
            everyone: list = [None] * ctx.world_size
            dist.all_gather_object(everyone, mine)
            rows += [{"rank": r, **row} for r, row in enumerate(everyone)]
        dist.barrier()  # rank 0 removes the temporary directory only after every rank closed the file store
    return {"world_size": ctx.world_size, "rows": rows, "stores": stores}


def file_store_text(rows: list[dict]) -> str:
    """One sentence on the FileStore's last ticket in this run, its directions computed from the rows: whether the
    rank that drew ticket W had the shortest blue bar (rendezvous_ms) and the longest orange one (build_group_ms)."""
    mine = [r for r in rows if r["store"] == "file"]
    last = max(mine, key=lambda r: r["ticket"])
    if len(mine) == 1:
        return f"With a single rank there is no one to wait for: rank {last['rank']} drew ticket 1."
    others = [r for r in mine if r is not last]

    def span(key: str) -> str:
        lo, hi = min(r[key] for r in others), max(r[key] for r in others)
        return f"{lo:.1f} ms" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f} to {hi:.1f} ms"

    blue, orange = last["rendezvous_ms"], last["build_group_ms"]
    text = f"In this run rank {last['rank']} drew the FileStore's last ticket ({last['ticket']})"
    if blue < min(r["rendezvous_ms"] for r in others):
        text += f" and had the shortest blue bar ({blue:.1f} ms, the others {span('rendezvous_ms')})"
    else:
        text += (f" but not the shortest blue bar ({blue:.1f} ms, the others {span('rendezvous_ms')}): it did not "
                 "wait in `store.wait`, but that step also holds getting the store's path and the scheduling of the "
                 "processes")
    if orange > max(r["build_group_ms"] for r in others):
        return (text + f"; its orange bar was the longest ({orange:.1f} ms, the others {span('build_group_ms')}): "
                "it waited in gloo's exchange for the others, still asleep in their poll.")
    return text + f"; its orange bar was not the longest ({orange:.1f} ms, the others {span('build_group_ms')})."


def draw(rows: list[dict], args: Settings) -> str:
    """Per store, one bar per rank: the time of each step of the protocol, labelled with the rank's ticket."""
    plt = plot.pyplot()
    steps = [("rendezvous_ms", "open store + rendezvous (set, add, wait, get)"),
             ("build_group_ms", "gloo's own exchange: ProcessGroupGloo(PrefixStore)"),
             ("all_reduce_ms", "one all_reduce over the new group (mean of --rounds)")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.6 + 0.45 * args.world_size), sharex=True)
    for ax, kind in zip(axes, ("tcp", "file")):
        mine = [r for r in rows if r["store"] == kind]
        left = [0.0] * len(mine)
        for key, label in steps:
            widths = [r[key] for r in mine]
            ax.barh([r["rank"] for r in mine], widths, left=left, label=label)
            left = [a + b for a, b in zip(left, widths)]
        for r, end in zip(mine, left):
            ax.text(end, r["rank"], f" ticket {r['ticket']}", va="center", fontsize=8)
        ax.set_yticks([r["rank"] for r in mine], [f"rank {r['rank']}" for r in mine])
        ax.invert_yaxis()
        ax.set_xlabel("ms since the rank started this store")
        ax.set_title(f"{kind} store ({'TCPStore hosted by rank 0' if kind == 'tcp' else 'FileStore'})")
    axes[0].legend(loc="upper center", bbox_to_anchor=(1.05, -0.22), ncol=3, fontsize=8)
    return str(plot.save(fig, args, "steps"))


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "rounds": 1}, world_sizes=lambda w: w >= 1,
                     world_sizes_text=">= 1")
    result = launch(worker, args)
    if result is None:
        return 0
    rows = result["rows"]
    print(report.table(rows, floatfmt=".2f"))
    tickets = {kind: sorted(r["ticket"] for r in rows if r["store"] == kind) for kind in ("tcp", "file")}
    w = result["world_size"]
    if any(t != list(range(1, w + 1)) for t in tickets.values()):  # the counter must hand out each ticket once
        raise cli.SelfCheckFailed(f"arrival tickets {tickets} are not 1..{w} once each")
    print(f"figure: {draw(rows, args)}")
    print("stores: " + ", ".join(f"{name} at {where}" for name, where in result["stores"].items()))
    result["file_store_text"] = file_store_text(rows)
    print(result["file_store_text"])
    print(f"\nOK: on both stores, {w} ranks took tickets 1..{w} (one each), saw all {w} addresses, "
          f"and an all_reduce over the group built from the store gave {w * (w + 1) // 2} on every rank.")
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
