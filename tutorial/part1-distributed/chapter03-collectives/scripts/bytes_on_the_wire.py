"""Bytes on the wire: every collective written as the algorithm comm_volume assumes, each message logged and drawn.

What it shows
    The eight collectives (broadcast, scatter, gather, all_gather, reduce, all_reduce, reduce_scatter,
    all_to_all), each written from isend/irecv as the algorithm mlsys.collectives.comm_volume counts: a pipelined
    chain for broadcast and reduce, direct messages to or from the root for scatter and gather, the ring for
    all_gather, reduce_scatter and all_reduce, direct pairwise exchanges for all_to_all. Rank 0 is the root.
    The full buffer of N bytes (comm_volume's N) is cut into W pieces of N/W bytes, and in every step a rank sends
    at most one piece and receives at most one, so a step is the time one piece takes over one link.
    Every rank logs each message it posts: the step, the peer, and the bytes of the tensor it handed to isend or
    irecv. Then:
    1. every result is compared with numpy on all the ranks' inputs (exit 1 on a difference);
    2. the log's bytes, summed per rank, are compared with comm_volume's sent and received for this W and N;
    3. the figure (bytes_on_the_wire.png) draws the log: a panel per collective, two lanes per rank (what it sent,
       what it received), a box per piece per step; the JSON keeps the log under `messages`.

How to run (any world size from 2 to 8)
    python tutorial/part1-distributed/chapter03-collectives/scripts/bytes_on_the_wire.py
    torchrun --nproc-per-node 4 tutorial/part1-distributed/chapter03-collectives/scripts/bytes_on_the_wire.py

Contract flags: --seed picks the inputs (small integers, so every sum is exact).

Runtime on 2 idle cores: about 6 s at -w 4 (mostly starting the ranks and drawing), 5 s with --smoke; two or three
times that on a busy machine.

Try next
    python tutorial/part1-distributed/chapter03-collectives/scripts/bytes_on_the_wire.py -w 8
        -> all_gather, reduce_scatter and all_to_all send (W-1)/W of N per rank (7/8 now), the ring all_reduce
           twice that (1.75), while the root of scatter and gather moves 7 pieces and every other rank one
    python tutorial/part1-distributed/chapter03-collectives/scripts/bytes_on_the_wire.py -w 2
        -> two ranks: every collective is a single exchange of half the buffer, except all_reduce and the chains
           (two pieces each)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.collectives import COLLECTIVES, comm_volume
from mlsys.launch import RankContext, launch


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 4
    """Number of ranks (2 to 8). Under torchrun it is taken from WORLD_SIZE."""
    piece_numel: int = 256
    """float32 elements in one piece; the full buffer N is W pieces."""

    def validate(self) -> None:
        if self.piece_numel < 1:
            raise cli.UsageError(f"--piece-numel must be at least 1, got {self.piece_numel}")


def all_inputs(seed: int, world_size: int, piece_numel: int) -> np.ndarray:
    """(W, W * piece_numel): row r is rank r's full buffer, small integers (exact sums). Every rank can build it."""
    return np.random.default_rng(seed).integers(0, 10, (world_size, world_size * piece_numel)).astype(np.float32)


# --8<-- [start:step]
def step(log: list, t: int, send: torch.Tensor | None = None, dst: int = -1, recv: torch.Tensor | None = None,
         src: int = -1) -> None:
    """Step t of an algorithm on this rank: post at most one send and one receive, wait for both, log both."""
    works = []
    if send is not None:
        works.append(dist.isend(send, dst))
        log.append({"step": t, "op": "send", "peer": dst, "bytes": send.nbytes})
    if recv is not None:
        works.append(dist.irecv(recv, src))
        log.append({"step": t, "op": "recv", "peer": src, "bytes": recv.nbytes})
    for work in works:
        work.wait()
# --8<-- [end:step]


# --8<-- [start:algorithms]
def broadcast(x: torch.Tensor, r: int, W: int, log: list) -> torch.Tensor:
    """Pipelined chain 0 -> 1 -> ... -> W-1: rank r receives piece j at step j + r - 1 and forwards it at j + r."""
    p = list(x.chunk(W))  # on the root, its data; elsewhere, overwritten as the pieces arrive
    for t in range(2 * W - 2):
        out, into = t - r, t - r + 1
        step(log, t, p[out] if r < W - 1 and 0 <= out < W else None, r + 1,
             p[into] if r > 0 and 0 <= into < W else None, r - 1)
    return x


def reduce(x: torch.Tensor, r: int, W: int, log: list) -> torch.Tensor:
    """Pipelined chain W-1 -> ... -> 1 -> 0: rank r adds the partial sum of piece j from r+1 to its own, then
    passes it on. Rank r sends piece j at step j + W-1-r; the root ends with the total."""
    p = list(x.chunk(W))
    for t in range(2 * W - 2):
        out, into = t - (W - 1 - r), t - (W - 2 - r)
        incoming = torch.empty_like(p[0]) if r < W - 1 and 0 <= into < W else None
        step(log, t, p[out] if r > 0 and 0 <= out < W else None, r - 1, incoming, r + 1)
        if incoming is not None:
            p[into] += incoming
    return x


def scatter(x: torch.Tensor, r: int, W: int, log: list) -> torch.Tensor:
    """The root sends piece s+1 to rank s+1 at step s; rank r keeps piece r."""
    p = list(x.chunk(W))
    for t in range(W - 1):
        step(log, t, p[t + 1] if r == 0 else None, t + 1, p[r] if r == t + 1 else None, 0)
    return p[r]


def gather(x: torch.Tensor, r: int, W: int, log: list) -> torch.Tensor:
    """Rank s+1 sends its piece (the first piece of its buffer) to the root at step s; the root lines them up."""
    out = x.clone()  # on the root: piece r <- rank r's first piece
    p = list(out.chunk(W))
    for t in range(W - 1):
        step(log, t, x.chunk(W)[0] if r == t + 1 else None, 0, p[t + 1] if r == 0 else None, t + 1)
    return out


def all_gather(x: torch.Tensor, r: int, W: int, log: list, t0: int = 0) -> torch.Tensor:
    """Ring: rank r starts with piece r in place; at step s it sends piece r-s on and receives piece r-s-1."""
    p = list(x.chunk(W))
    for s in range(W - 1):
        step(log, t0 + s, p[(r - s) % W], (r + 1) % W, p[(r - s - 1) % W], (r - 1) % W)
    return x


def reduce_scatter(x: torch.Tensor, r: int, W: int, log: list) -> torch.Tensor:
    """Ring: at step s rank r sends its partial sum of piece r-s-1 and adds the incoming piece r-s-2 to its own;
    after W-1 steps it holds the total of piece r."""
    p = list(x.chunk(W))
    for s in range(W - 1):
        incoming = torch.empty_like(p[0])
        step(log, s, p[(r - s - 1) % W], (r + 1) % W, incoming, (r - 1) % W)
        p[(r - s - 2) % W] += incoming
    return p[r]


def all_reduce(x: torch.Tensor, r: int, W: int, log: list) -> torch.Tensor:
    """Reduce-scatter, then all-gather: rank r's total of piece r is exactly where the ring all-gather starts."""
    reduce_scatter(x, r, W, log)
    return all_gather(x, r, W, log, t0=W - 1)


def all_to_all(x: torch.Tensor, r: int, W: int, log: list) -> torch.Tensor:
    """At step s-1 (s = 1..W-1) rank r sends its block r+s to rank r+s and receives block r from rank r-s."""
    out = x.clone()  # block r stays where it is
    for s in range(1, W):
        step(log, s - 1, x.chunk(W)[(r + s) % W], (r + s) % W, out.chunk(W)[(r - s) % W], (r - s) % W)
    return out
# --8<-- [end:algorithms]


ALGORITHMS = {"broadcast": broadcast, "scatter": scatter, "gather": gather, "all_gather": all_gather,
              "reduce": reduce, "all_reduce": all_reduce, "reduce_scatter": reduce_scatter, "all_to_all": all_to_all}


def expected(name: str, X: np.ndarray, r: int) -> np.ndarray | None:
    """What rank r must hold after `name`, from numpy on every rank's input (None: nothing defined there)."""
    W = len(X)
    pieces = X.reshape(W, W, -1)  # (rank, piece, elements)
    return {"broadcast": X[0], "scatter": pieces[0, r], "gather": pieces[:, 0].ravel() if r == 0 else None,
            "all_gather": pieces[np.arange(W), np.arange(W)].ravel(), "reduce": X.sum(0) if r == 0 else None,
            "all_reduce": X.sum(0), "reduce_scatter": pieces[:, r].sum(0),
            "all_to_all": pieces[:, r].ravel()}[name]


def start_buffer(name: str, X: np.ndarray, r: int) -> np.ndarray:
    """Rank r's buffer before `name`: its row, except where the algorithm writes into a buffer it receives into."""
    W, row = len(X), X[r].copy()
    if name == "broadcast" and r > 0:
        row[:] = 0  # filled by the chain
    if name == "all_gather":  # rank r contributes its own piece r; the rest is filled by the ring
        mine = row.reshape(W, -1)[r].copy()
        row[:] = 0
        row.reshape(W, -1)[r] = mine
    return row


def worker(ctx: RankContext, args: Settings) -> dict:
    W, r = ctx.world_size, ctx.rank
    X = all_inputs(args.seed, W, args.piece_numel)
    logs = {}
    for name in COLLECTIVES:
        x = torch.from_numpy(start_buffer(name, X, r))
        logs[name] = []
        dist.barrier()  # one collective at a time
        got = ALGORITHMS[name](x, r, W, logs[name])
        want = expected(name, X, r)
        if want is not None:
            report.expect_equal(f"{name} on rank {r}", got.numpy(), want)
    everyone: list = [None] * W
    dist.all_gather_object(everyone, logs)
    return {"world_size": W, "piece_bytes": 4 * args.piece_numel, "logs": everyone}


def messages_from_logs(logs: list[dict]) -> dict[str, list[dict]]:
    """Per collective, every message as {step, src, dst, bytes}, from the senders' logs; each must match a receive
    the receiver logged at the same step with the same size."""
    out = {}
    for name in COLLECTIVES:
        sends = sorted((e["step"], r, e["peer"], e["bytes"]) for r, log in enumerate(logs) for e in log[name]
                       if e["op"] == "send")
        recvs = sorted((e["step"], e["peer"], r, e["bytes"]) for r, log in enumerate(logs) for e in log[name]
                       if e["op"] == "recv")
        report.expect_equal(f"{name}: every send has its receive", np.array(sends), np.array(recvs))
        out[name] = [{"step": t, "src": s, "dst": d, "bytes": b} for t, s, d, b in sends]
    return out


def totals(messages: dict[str, list[dict]], W: int, piece_bytes: int) -> list[dict]:
    """Per collective: the pieces each rank sent and received, the busiest rank's bytes, and comm_volume's."""
    rows = []
    for name, msgs in messages.items():
        sent = [sum(m["bytes"] for m in msgs if m["src"] == r) for r in range(W)]
        received = [sum(m["bytes"] for m in msgs if m["dst"] == r) for r in range(W)]
        v, n = comm_volume(name, W * piece_bytes, W), W * piece_bytes
        rows.append({"collective": name, "algorithm": v["algorithm"],
                     "steps": 1 + max(m["step"] for m in msgs),
                     "pieces sent by rank 0..W-1": " ".join(str(b // piece_bytes) for b in sent),
                     "received": " ".join(str(b // piece_bytes) for b in received),
                     "max sent/N": max(sent) / n, "comm_volume sent/N": v["sent"] / n,
                     "max received/N": max(received) / n, "comm_volume received/N": v["received"] / n})
        report.expect_close(f"{name}: the busiest sender against comm_volume", max(sent), v["sent"], rtol=0, atol=0)
        report.expect_close(f"{name}: the busiest receiver against comm_volume", max(received), v["received"],
                            rtol=0, atol=0)
    return rows


def draw(messages: dict[str, list[dict]], W: int, args: Settings) -> str:
    """A panel per collective: for each rank a lane of what it sent and a lane of what it received, one box per
    piece per step, labelled with the peer; the total in pieces at the end of each lane."""
    plt = plot.pyplot()
    c10 = list(plot.colours(map(str, range(10))).values())
    palette = {"sent one piece (N/W bytes)": c10[0], "received one piece": c10[1]}
    steps = 2 * W - 2
    lanes = [name for r in range(W) for name in (f"rank {r} sent", f"rank {r} received")]
    fig, axes = plt.subplots(4, 2, figsize=(13, 4 * (0.7 + 0.27 * len(lanes))))
    for ax, (name, msgs) in zip(axes.T.ravel(), messages.items()):
        spans = [plot.Span(f"rank {m['src']} sent", m["step"] + 0.05, m["step"] + 0.95, f"to {m['dst']}",
                           "sent one piece (N/W bytes)") for m in msgs]
        spans += [plot.Span(f"rank {m['dst']} received", m["step"] + 0.05, m["step"] + 0.95, f"from {m['src']}",
                            "received one piece") for m in msgs]
        plot.timeline(ax, spans, lanes, palette=palette, legend=False, fontsize=7)
        for i, lane in enumerate(lanes):  # the lane's total, in pieces, right of the last step
            count = sum(1 for s in spans if s.lane == lane)
            ax.text(steps + 0.15, len(lanes) - 1 - i, f"{count} x N/{W}" if count else "0", va="center",
                    fontsize=7, weight="bold" if count == max(sum(1 for s in spans if s.lane == other)
                                                              for other in lanes) else "normal")
        ax.set_xlim(0, steps + 1.1)
        ax.set_xticks([t + 0.5 for t in range(steps)], [str(t) for t in range(steps)], fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
        for r in range(1, W):  # a line between ranks
            ax.axhline(len(lanes) - 2 * r - 0.5, color="0.6", lw=0.6)
        ax.set_title(f"{name} ({comm_volume(name, 1, W)['algorithm']})", fontsize=9, loc="left")
    for ax in axes[-1]:
        ax.set_xlabel("step (one piece of N/W bytes over one link)", fontsize=8)
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(facecolor=c, edgecolor="black", label=k) for k, c in palette.items()],
               loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(f"Every message each of {W} ranks sent and received, per step, from the run's log "
                 f"(N = the full buffer, W = {W} pieces; the busiest lane's total in bold)", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    return str(plot.save(fig, args, "bytes_on_the_wire"))


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 3, "piece_numel": 4},
                     world_sizes=range(2, 9), world_sizes_text="2..8")
    result = launch(worker, args)
    if result is None:
        return 0
    W, piece = result["world_size"], result["piece_bytes"]
    messages = messages_from_logs(result["logs"])
    rows = totals(messages, W, piece)
    print(f"W = {W} ranks, root 0; N = {W} pieces of {piece} bytes = {W * piece} bytes, the full buffer "
          "(comm_volume's N); every result matched numpy.\n")
    print(report.table(rows, floatfmt=".4g"))
    print(f"\nfigure: {draw(messages, W, args)}")
    print("OK: for every collective, the busiest rank sent and received exactly comm_volume's bytes")
    if args.json:
        report.write_json(args.json, {"ok": True, "world_size": W, "piece_bytes": piece, "totals": rows,
                                      "messages": messages}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
