"""Point-to-point: a value passed down a chain, and tensors shifted around a ring, three ways each.

What it shows
    CHAIN  rank 0 starts a tensor; rank r receives it from r-1, adds r, and passes it to r+1. Done twice: with
           blocking send/recv, and with isend/irecv + wait(). Rank r must end up holding start + r(r+1)/2.
    RING   every rank sends its own tensor to (r+1) % W and receives from (r-1) % W at the same moment. Done
           three ways: blocking calls in even/odd order, isend/irecv + wait(), and batch_isend_irecv (P2POp).
           Rank r must end up holding rank (r-1) % W's tensor.
    Every rank computes the value it must hold without any communication and compares (exit 1 on a mismatch).
    Each pattern is repeated --repeats times; the mean time per rank and pattern goes to --json only (W ranks on
    2 shared cores time the scheduler, not the pattern).
    Figures: chain_and_ring.png draws the chain and the ring with the values each rank really held;
    ring_shift_on_W_ranks_written_three_ways.png (W the world size) runs each ring version once more with
    every call recorded (mlsys.trace.recording) and draws one lane per rank, a box per call from its start to
    its return, and an arrow per message from the call that posted it to the call that completed its receive.
    The JSON keeps them under `ring_lanes` and `ring_messages`.

How to run (any world size >= 2)
    python tutorial/part1-distributed/chapter02-point-to-point/scripts/send_recv.py -w 4
    torchrun --nproc-per-node 4 tutorial/part1-distributed/chapter02-point-to-point/scripts/send_recv.py
    ... --numel 4 --verbose      # trace every send and recv on every rank

Contract flags: --seed changes nothing here (every value is a function of the rank, so nothing is random).

Runtime on 2 cores: about 5-15 s with -w 4 (mostly starting the ranks and drawing; 14 s at load 8), 4-10 s with
--smoke.

Try next
    python tutorial/part1-distributed/chapter02-point-to-point/scripts/send_recv.py -w 5
        -> an odd ring: the even/odd order still completes; the chain ends at rank 4 holding 0 + 10
    python tutorial/part1-distributed/chapter02-point-to-point/scripts/send_recv.py -w 2 --numel 2 --verbose
        -> every send and recv of every rank on stderr, a line when it starts and one when it returns
    torchrun --nproc-per-node 3 tutorial/part1-distributed/chapter02-point-to-point/scripts/send_recv.py
        -> the same checks under torchrun
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.bench import steady_timing
from mlsys.launch import RankContext, launch
from mlsys.trace import recording


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 4
    """Number of ranks to start (at least 2). Under torchrun it is taken from WORLD_SIZE."""
    numel: int = 1024
    """Elements in the tensor each pattern moves (float32)."""
    repeats: int = 20
    """How many times each pattern runs; the timings are the mean over these runs."""

    def validate(self) -> None:
        if self.numel < 1:
            raise cli.UsageError(f"--numel must be at least 1, got {self.numel}")
        if self.repeats < 1:
            raise cli.UsageError(f"--repeats must be at least 1, got {self.repeats}")


# --8<-- [start:expected]
def chain_start(numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32)  # what rank 0 starts with: [0, 1, ..., numel-1]


def expected_chain(rank: int, numel: int) -> torch.Tensor:
    # rank r adds r to what it received, so it holds start + 1 + 2 + ... + r = start + r(r+1)/2
    return chain_start(numel) + rank * (rank + 1) / 2


def ring_own(rank: int, numel: int) -> torch.Tensor:
    return 100.0 * rank + torch.arange(numel, dtype=torch.float32)  # rank r's tensor: 100r + [0, 1, ...]


def expected_ring(rank: int, world_size: int, numel: int) -> torch.Tensor:
    return ring_own((rank - 1) % world_size, numel)  # everyone receives from its left neighbour
# --8<-- [end:expected]


# --8<-- [start:chain]
def chain_blocking(ctx: RankContext, numel: int) -> torch.Tensor:
    """Rank r waits for r-1, adds r, hands on to r+1. The ranks run one after the other."""
    if ctx.rank == 0:
        value = chain_start(numel).to(ctx.device)
    else:
        # recv fills a buffer we allocate: shape and dtype must match the sender's
        value = torch.empty(numel, device=ctx.device)
        dist.recv(value, src=ctx.rank - 1)
        value += ctx.rank
    if ctx.rank < ctx.world_size - 1:
        # on gloo, returns once rank + 1 has posted its recv and the bytes are handed to the connection,
        # which can be before rank + 1's recv returns
        dist.send(value, dst=ctx.rank + 1)
    return value


def chain_nonblocking(ctx: RankContext, numel: int) -> torch.Tensor:
    """The same chain with isend/irecv: each call returns a request at once; wait() is where we block."""
    if ctx.rank == 0:
        value = chain_start(numel).to(ctx.device)
    else:
        value = torch.empty(numel, device=ctx.device)
        dist.irecv(value, src=ctx.rank - 1).wait()  # we need the data before adding to it
        value += ctx.rank
    if ctx.rank < ctx.world_size - 1:
        request = dist.isend(value, dst=ctx.rank + 1)
        request.wait()  # `value` must not change until this returns (see silent_bugs.py)
    return value
# --8<-- [end:chain]


# --8<-- [start:ring_ordered]
def ring_even_odd(ctx: RankContext, own: torch.Tensor) -> torch.Tensor:
    """Blocking calls. If every rank sent first, every send would wait for a recv that never comes.

    Even ranks send then receive, odd ranks receive then send. With an odd W, rank W-1 and rank 0 are both even:
    rank W-1's send cannot complete until rank 0 has finished its own send and posted its recv, which it always does.
    """
    right, left = (ctx.rank + 1) % ctx.world_size, (ctx.rank - 1) % ctx.world_size
    got = torch.empty_like(own)
    if ctx.rank % 2 == 0:
        dist.send(own, dst=right)
        dist.recv(got, src=left)
    else:
        dist.recv(got, src=left)
        dist.send(own, dst=right)
    return got
# --8<-- [end:ring_ordered]


# --8<-- [start:ring_nonblocking]
def ring_isend_irecv(ctx: RankContext, own: torch.Tensor) -> torch.Tensor:
    """Post both operations first, then wait: no rank blocks before its recv is posted, so no order is needed."""
    right, left = (ctx.rank + 1) % ctx.world_size, (ctx.rank - 1) % ctx.world_size
    got = torch.empty_like(own)
    requests = [dist.isend(own, dst=right), dist.irecv(got, src=left)]
    for request in requests:
        request.wait()
    return got
# --8<-- [end:ring_nonblocking]


# --8<-- [start:ring_batched]
def ring_batched(ctx: RankContext, own: torch.Tensor) -> torch.Tensor:
    """The same with one call: batch_isend_irecv posts a list of P2POps (with NCCL, as one fused group)."""
    right, left = (ctx.rank + 1) % ctx.world_size, (ctx.rank - 1) % ctx.world_size
    got = torch.empty_like(own)
    ops = [dist.P2POp(dist.isend, own, right), dist.P2POp(dist.irecv, got, left)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return got
# --8<-- [end:ring_batched]


def timed(fn, repeats: int) -> tuple[torch.Tensor, float]:
    """Run fn() `repeats` times; return its last result and the mean wall time in microseconds."""
    with steady_timing():  # no garbage-collector pass inside the timed loop
        dist.barrier()  # start every pattern together, so no rank's time includes waiting for a slow starter
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn()
        return out, (time.perf_counter() - start) / repeats * 1e6


RING_VERSIONS = {  # the panels of ring_shift_on_W_ranks_written_three_ways.png, in the lesson's order
    "1. order the calls: even ranks send first, odd ranks receive first": ring_even_odd,
    "2. non-blocking: post isend and irecv, then wait on both": ring_isend_irecv,
    "3. batched: batch_isend_irecv posts both in one call, then wait on both": ring_batched,
}


def record_ring(ctx: RankContext, own: torch.Tensor) -> dict[str, list[dict]]:
    """Each ring version once more, started together, with every call this rank makes recorded."""
    calls: dict[str, list[dict]] = {}
    for name, version in RING_VERSIONS.items():
        dist.barrier()  # not recorded: the lanes begin with the ring's own calls
        with recording(calls.setdefault(name, [])):
            version(ctx, own)
    return calls


def worker(ctx: RankContext, args: Settings) -> dict:
    own = ring_own(ctx.rank, args.numel).to(ctx.device)  # cuda:<local rank> under nccl, else cpu
    patterns = {
        "chain send/recv": lambda: chain_blocking(ctx, args.numel),
        "chain isend/irecv": lambda: chain_nonblocking(ctx, args.numel),
        "ring even/odd": lambda: ring_even_odd(ctx, own),
        "ring isend/irecv": lambda: ring_isend_irecv(ctx, own),
        "ring batch_isend_irecv": lambda: ring_batched(ctx, own),
    }
    held, times_us = {}, {}
    for name, fn in patterns.items():
        held[name], times_us[name] = timed(fn, args.repeats)

    # Self-check on every rank, against values computed with no communication at all.
    for name, value in held.items():
        want = expected_chain(ctx.rank, args.numel) if name.startswith("chain") else \
            expected_ring(ctx.rank, ctx.world_size, args.numel)
        report.expect_equal(f"rank {ctx.rank} {name}", value, want)

    shown = min(args.numel, 3)
    ctx.print_ordered(f"chain holds {held['chain send/recv'][:shown].tolist()}...  "
                      f"ring got {held['ring isend/irecv'][:shown].tolist()}... "
                      f"(from rank {(ctx.rank - 1) % ctx.world_size})")
    calls = record_ring(ctx, own)
    mine = {"rank": ctx.rank, "values": {k: v.cpu().tolist() for k, v in held.items()}, "times_us": times_us,
            "calls": calls}
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return {"world_size": ctx.world_size, "numel": args.numel, "repeats": args.repeats, "per_rank": everyone}


def draw(result: dict, args: Settings) -> str:
    """Left: the chain, each rank labelled with the first value it holds. Right: the ring, each arrow labelled
    with the first value that travelled along it (what the receiver holds afterwards)."""
    plt = plot.pyplot()
    from matplotlib.patches import FancyArrowPatch

    W = result["world_size"]
    first = [p["values"] for p in result["per_rank"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.4, 1]})
    box = dict(boxstyle="round", fc="#dbe9f6", ec="#33658a")
    arrow = dict(arrowstyle="-|>", mutation_scale=18, lw=2, color="#33658a")
    for r in range(W):  # chain: a row of ranks, r -> r+1
        left.text(r, 0, f"rank {r}\nholds {first[r]['chain send/recv'][0]:g}", ha="center", va="center", bbox=box)
        if r < W - 1:
            left.add_patch(FancyArrowPatch((r + 0.3, 0), (r + 0.7, 0), **arrow))
            left.text(r + 0.5, 0.12, f"+{r + 1}", ha="center", fontsize=9, color="#b23a48")
    left.set_xlim(-0.6, W - 0.4)
    left.set_ylim(-0.5, 0.5)
    left.set_title("chain: rank r receives from r-1, adds r, sends to r+1\n(first element; rank 0 starts with 0)")
    angle = [math.pi / 2 - 2 * math.pi * r / W for r in range(W)]  # ranks clockwise from the top
    pos = [(math.cos(a), math.sin(a)) for a in angle]
    for r in range(W):  # ring: r -> (r+1) % W, the arrow labelled with what arrived
        dst = (r + 1) % W
        (x0, y0), (x1, y1) = pos[r], pos[dst]
        right.add_patch(FancyArrowPatch((x0 + 0.25 * (x1 - x0), y0 + 0.25 * (y1 - y0)),
                                        (x0 + 0.75 * (x1 - x0), y0 + 0.75 * (y1 - y0)),
                                        connectionstyle="arc3,rad=-0.2", **arrow))
        got = first[dst]["ring isend/irecv"][0]
        right.text(1.25 * (x0 + x1) / 2, 1.25 * (y0 + y1) / 2, f"{got:g}", ha="center", fontsize=9,
                   color="#b23a48")
        right.text(x0, y0, f"rank {r}\nowns {100 * r}", ha="center", va="center", bbox=box)
    right.set_xlim(-1.6, 1.6)
    right.set_ylim(-1.6, 1.6)
    right.set_aspect("equal")
    right.set_title("ring: every rank sends to (r+1) mod W at once\n(red: the first element that arrived)")
    for ax in (left, right):
        ax.axis("off")
    return str(plot.save(fig, args, "chain_and_ring"))


def ring_lanes(per_rank: list[dict]) -> dict[str, list[dict]]:
    """Per ring version, every rank's recorded calls in ms since the first rank entered that version's first call."""
    out = {}
    for version in RING_VERSIONS:
        origin = min(c["start"] for p in per_rank for c in p["calls"][version])
        out[version] = [{"rank": p["rank"], "call": c["call"], "peer": c["peer"], "numel": c["numel"],
                         "ops": c.get("ops"), "start_ms": round(1e3 * (c["start"] - origin), 3),
                         "end_ms": round(1e3 * (c["end"] - origin), 3)}
                        for p in per_rank for c in p["calls"][version]]
    return out


def ring_messages(calls: list[dict]) -> list[dict]:
    """The messages of one version, read off the recorded calls: for each send a rank posted (send, isend, or an
    isend inside batch_isend_irecv), the call that posted it and the call on the receiver that completed the
    matching receive (recv, or wait on an irecv). Between two ranks the k-th send matches the k-th receive."""
    def posts(c: dict) -> list[tuple[str, int]]:  # ("send", peer) it posted or ("recv", peer) it completed
        if c["call"] == "batch_isend_irecv":  # its receives complete in the wait(irecv) calls that follow
            return [("send", peer) for kind, peer, _ in c["ops"] if kind == "isend"]
        return {"send": [("send", c["peer"])], "isend": [("send", c["peer"])], "recv": [("recv", c["peer"])],
                "wait(irecv)": [("recv", c["peer"])]}.get(c["call"], [])

    sends = [(c, peer) for c in calls for kind, peer in posts(c) if kind == "send"]  # in each rank's call order
    recvs = [(c, peer) for c in calls for kind, peer in posts(c) if kind == "recv"]
    out = []
    for i, (c, dst) in enumerate(sends):
        k = sum(1 for o, d in sends[:i] if o["rank"] == c["rank"] and d == dst)  # earlier sends on this pair
        matching = [r for r, src in recvs if r["rank"] == dst and src == c["rank"]]
        if k < len(matching):
            out.append({"src": c["rank"], "dst": dst, "posted_by": c["call"], "posted_ms": c["start_ms"],
                        "received_by": matching[k]["call"], "received_ms": matching[k]["end_ms"]})
    return out


def event_order(calls: list[dict]) -> dict[float, int]:
    """Every start and end time of the calls, all ranks together, numbered in the order they happened."""
    return {t: i for i, t in enumerate(sorted({c[k] for c in calls for k in ("start_ms", "end_ms")}))}


def draw_lanes(lanes: dict[str, list[dict]], messages: dict[str, list[dict]], world_size: int, numel: int,
               args: Settings) -> str:
    """One panel per ring version, one lane per rank, a box per call, an arrow per message. The x axis is the
    order of events, not milliseconds: W processes on 2 shared cores space them mostly by the scheduler's whims."""
    plt = plot.pyplot()
    kind = {"send": "blocking send", "recv": "blocking recv", "isend": "post (isend, irecv, batch)",
            "irecv": "post (isend, irecv, batch)", "batch_isend_irecv": "post (isend, irecv, batch)",
            "wait(isend)": "wait", "wait(irecv)": "wait"}
    c10 = list(plot.colours(map(str, range(10))).values())  # the book's colour-blind palette, by index
    palette = {"blocking send": c10[1], "blocking recv": c10[2], "post (isend, irecv, batch)": c10[9],
               "wait": c10[4]}  # the colours of deadlock.py's lanes
    names = [f"rank {r}" for r in range(world_size)]
    fig, axes = plt.subplots(len(lanes), 1, figsize=(11, 1.2 + len(lanes) * (0.8 + 0.42 * world_size)))
    for ax, (version, calls) in zip(axes, lanes.items()):
        at = event_order(calls)
        spans = [plot.Span(f"rank {c['rank']}", at[c["start_ms"]], at[c["end_ms"]] + 0.05, "", kind[c["call"]])
                 for c in calls]
        plot.timeline(ax, spans, names, palette=palette, legend=False)
        for c, span in zip(calls, spans):  # the call's name inside its box; narrow boxes get it upright
            label = "batch" if c["call"] == "batch_isend_irecv" else c["call"] + (
                "" if c["peer"] is None else f" {'->' if 'send' in c['call'] else '<-'} {c['peer']}")
            px_per_unit = ax.get_window_extent().width / (len(at) + 1)
            wide = (span.end - span.start) * px_per_unit >= 0.6 * 7 * fig.dpi / 72 * len(label) + 4
            short = label.split(" ")[0]  # upright: the arrows name the peers; a wait names the request it waits on
            if c["call"].startswith("wait") and c["peer"] is not None:
                short = f"wait\n{'->' if c['call'] == 'wait(isend)' else '<-'}{c['peer']}"
            ax.text((span.start + span.end) / 2, world_size - 1 - c["rank"], label if wide else short, ha="center",
                    va="center", fontsize=7 if wide else 6.5, rotation=0 if wide else 90)
        for m in messages[version]:  # the message: from where it was posted to where its receive completed
            ax.annotate("", xy=(at[m["received_ms"]] + 0.05, world_size - 1 - m["dst"]),
                        xytext=(at[m["posted_ms"]], world_size - 1 - m["src"]),
                        arrowprops={"arrowstyle": "-|>", "color": "black", "lw": 1.2, "shrinkA": 0, "shrinkB": 0})
        ax.set_xlim(-0.3, len(at) - 0.7)
        ax.set_xticks([])
        ax.set_title(version, fontsize=9, loc="left")
    axes[-1].set_xlabel("order of events: every start and end of a call, all ranks together, in the order they "
                        "happened (milliseconds in the JSON)", fontsize=8)
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=c, edgecolor="black", label=k) for k, c in palette.items()]
    handles.append(plt.Line2D([], [], color="black", marker=">", label="a message: posted -> its receive done"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(f"The ring shift on {world_size} ranks ({numel:,} float32 elements each): every call each rank "
                 "made, three ways", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    # the name is its caption on the script page (the lesson draws -w 3, so it cannot lend its caption there)
    return str(plot.save(fig, args, f"ring_shift_on_{world_size}_ranks_written_three_ways"))


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "numel": 8, "repeats": 3},
                     world_sizes=lambda w: w >= 2, world_sizes_text=">= 2 (point-to-point needs a peer)")
    result = launch(worker, args)
    if result is None:  # a non-zero torchrun rank: rank 0 reports
        return 0
    # The mean times per pattern go to --json only: W ranks sharing 2 cores time the scheduler, not the patterns.
    print(f"figure: {draw(result, args)}")
    result["ring_lanes"] = ring_lanes(result["per_rank"])
    for p in result["per_rank"]:
        del p["calls"]  # raw perf_counter seconds: ring_lanes holds the same calls, in ms from a common origin
    result["ring_messages"] = {v: ring_messages(calls) for v, calls in result["ring_lanes"].items()}
    lanes_png = draw_lanes(result["ring_lanes"], result["ring_messages"], result["world_size"], args.numel, args)
    print(f"figure: {lanes_png}")
    print(f"OK: chain and ring values match the expected values on all {result['world_size']} ranks")
    if args.json:
        report.write_json(args.json, {"ok": True, **result}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
