"""The head-to-head deadlock, shown safely: both ranks send first, and a short timeout ends the wait.

What it shows
    Ranks are paired (0,1), (2,3), ...; each pair swaps a tensor.
    NAIVE     both partners call the blocking dist.send first, then dist.recv. A gloo send returns only when the
              peer has posted the matching recv, so each waits for the other forever. Here the send runs on a
              separate gloo process group with a short timeout (--deadlock-timeout), so it fails with
              "Timed out" and the script prints "deadlocked: timed out after X s" instead of hanging. It is tried
              with a 1-element tensor and with a large one (--numel): on gloo both deadlock, because gloo never
              buffers a send on its own, whatever its size. Many MPI libraries send small messages eagerly, which
              is why this bug can hide in tests with tiny tensors and appear in production; NCCL promises no
              buffering at all (a send may wait for its receive: NVIDIA/nccl issues 479 and 783).
    ORDERED   even ranks send then receive, odd ranks receive then send: completes.
    NONBLOCK  isend + irecv, then wait on both: completes, in any order.
    --ring    the same three versions around a ring (every rank sends to its right neighbour first): the ring
              deadlock the lesson describes, for any W >= 2.
    The two fixed versions check that each rank received its partner's tensor (exit 1 if not). The broken group
    is destroyed afterwards; the default group was never involved, so the job goes on normally.
    The figure (lanes.png, printed as `figure: <path>`) draws every call each rank made in the large naive attempt
    and in both fixes, from when it was entered to when it returned or raised, one lane per rank; the same calls
    are in the JSON under `lanes`.

How to run (even world sizes; any W >= 2 with --ring)
    python tutorial/part1-distributed/chapter02-point-to-point/scripts/deadlock.py
    torchrun --nproc-per-node 2 tutorial/part1-distributed/chapter02-point-to-point/scripts/deadlock.py
    ... --deadlock-timeout 5        # wait longer before giving up on the naive version

Contract flags: --seed changes nothing here (the tensors hold rank numbers, so nothing is random).

Runtime on 2 cores: about 8 s (two naive attempts of 2 s each, plus starting the ranks), 6 s with --smoke.

Try next
    python tutorial/part1-distributed/chapter02-point-to-point/scripts/deadlock.py -w 3 --ring
        -> a ring where every rank sends first: every rank times out (or sees its peer time out) after 2 s,
           then both fixes complete
    python tutorial/part1-distributed/chapter02-point-to-point/scripts/deadlock.py --numel 1 --deadlock-timeout 5
        -> a one-element swap still deadlocks on gloo; each naive attempt now waits 5 s
    python tutorial/part1-distributed/chapter02-point-to-point/scripts/deadlock.py -w 3
        -> a usage error (exit 2): pairs need an even world size, unless you pass --ring
"""

from __future__ import annotations

import datetime
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.launch import RankContext, launch
from mlsys.trace import recording


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    numel: int = 1 << 22
    """Elements (float32) in the large tensor each partner sends: 4M elements = 16 MiB."""
    deadlock_timeout: float = 2.0
    """Seconds the naive send may wait before it is declared deadlocked."""
    ring: bool = False
    """Exchange around a ring instead of in pairs: every rank sends to (r+1) mod W, then receives from (r-1) mod W.
    Any world size >= 2 (with W = 2 the ring is the pair)."""

    def validate(self) -> None:
        if not self.ring and self.world_size % 2:
            raise cli.UsageError(f"pairs need an even world size, got {self.world_size} (or pass --ring)")
        if self.numel < 1:
            raise cli.UsageError(f"--numel must be at least 1, got {self.numel}")
        if not 0 < self.deadlock_timeout < self.timeout:
            raise cli.UsageError(f"--deadlock-timeout must be in (0, --timeout={self.timeout}), "
                                 f"got {self.deadlock_timeout}")


def partner_of(rank: int) -> int:
    return rank ^ 1  # pairs (0,1), (2,3), ...: flip the lowest bit


def peers(ctx: RankContext, ring: bool) -> tuple[int, int]:
    """(who I send to, who I receive from): my partner twice, or my right and left neighbours on the ring."""
    if ring:
        return (ctx.rank + 1) % ctx.world_size, (ctx.rank - 1) % ctx.world_size
    return partner_of(ctx.rank), partner_of(ctx.rank)


def payload(rank: int, numel: int, device: torch.device) -> torch.Tensor:
    return torch.full((numel,), float(rank), device=device)  # rank r sends r's: easy to tell who sent what


# --8<-- [start:naive]
def naive_swap(ctx: RankContext, numel: int, deadlock_timeout: float, ring: bool = False) -> dict:
    """Both partners send first. Run on a fresh gloo group whose timeout is short, so the deadlock ends in an error.

    A timed-out gloo send closes that group's connection to the peer, so the group is thrown away afterwards; the
    default group (used by everything else) never saw these calls.
    """
    dist.barrier()  # in step first: creating the group is itself a wait bounded by the short timeout
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=deadlock_timeout))  # collective
    mine, theirs = payload(ctx.rank, numel, torch.device("cpu")), torch.empty(numel)  # gloo group: CPU tensors
    dst, src = peers(ctx, ring)  # the partner twice; with --ring, right and left neighbours
    start = time.perf_counter()
    try:
        dist.send(mine, dst=dst, group=group)  # waits for the partner's recv... which never comes
        dist.recv(theirs, src=src, group=group)
        outcome = "completed"
    except RuntimeError as err:
        # Whichever partner's timer fires first reports "Timed out" and closes the connection; the other one,
        # still waiting, may see "Connection closed by peer" a moment later instead. Both were deadlocked.
        message = str(err).lower()
        if "timed out" in message:
            outcome = "timed out"
        elif "connection closed by peer" in message:
            outcome = "peer timed out"
        else:
            raise
    seconds = time.perf_counter() - start
    dist.destroy_process_group(group)
    return {"numel": numel, "outcome": outcome, "seconds": round(seconds, 3),
            "received_ok": outcome == "completed" and bool((theirs == src).all())}
# --8<-- [end:naive]


# --8<-- [start:fixed]
def ordered_swap(ctx: RankContext, mine: torch.Tensor, ring: bool = False) -> torch.Tensor:
    """Break the symmetry: the even partner sends first, the odd one receives first."""
    dst, src = peers(ctx, ring)
    theirs = torch.empty_like(mine)
    if ctx.rank % 2 == 0:
        dist.send(mine, dst=dst)
        dist.recv(theirs, src=src)
    else:
        dist.recv(theirs, src=src)
        dist.send(mine, dst=dst)
    return theirs


def nonblocking_swap(ctx: RankContext, mine: torch.Tensor, ring: bool = False) -> torch.Tensor:
    """Post the send and the recv, then wait on both: neither call blocks, so the order does not matter."""
    dst, src = peers(ctx, ring)
    theirs = torch.empty_like(mine)
    requests = [dist.isend(mine, dst=dst), dist.irecv(theirs, src=src)]
    for request in requests:
        request.wait()
    return theirs
# --8<-- [end:fixed]


# The lanes figure records every call each rank made with mlsys.trace.recording (see the lesson's Under the hood).


def trace_failure(ctx: RankContext, attempt: dict) -> None:
    """Under --verbose, end a naive attempt that failed the way the trace ends a call that returned: the send
    raised (naive_swap caught the error, so the tracer never saw it return)."""
    if ctx.verbose and attempt["outcome"] != "completed":
        sys.stderr.write(f"[rank {ctx.rank}] <- send raised: {attempt['outcome']} after {attempt['seconds']:.2f} s "
                         "(it never reached its recv)\n")


def worker(ctx: RankContext, args: Settings) -> dict:
    calls: dict[str, list] = {}
    naive = [naive_swap(ctx, 1, args.deadlock_timeout, args.ring)]
    trace_failure(ctx, naive[-1])
    naive_name = "naive: every rank sends first (ring)" if args.ring else "naive: send first on both"
    with recording(calls.setdefault(naive_name, [])):
        naive.append(naive_swap(ctx, args.numel, args.deadlock_timeout, args.ring))
    trace_failure(ctx, naive[-1])
    mine = payload(ctx.rank, args.numel, ctx.device)
    want = payload(peers(ctx, args.ring)[1], args.numel, ctx.device)
    fixed = {}
    for name, swap in (("ordered send/recv", ordered_swap), ("isend + irecv + wait", nonblocking_swap)):
        with recording(calls.setdefault(f"fix: {name}", [])):
            dist.barrier()  # start together, so the lanes line up
            start = time.perf_counter()
            theirs = swap(ctx, mine, args.ring)
        fixed[name] = {"seconds": round(time.perf_counter() - start, 4), "from_rank": int(theirs[0].item())}
        report.expect_equal(f"rank {ctx.rank} {name}", theirs, want)

    lines = []
    for attempt in naive:
        if attempt["outcome"] == "completed":
            verdict = f"completed in {attempt['seconds']:.3f} s (this backend buffered the send)"
        else:
            verdict = f"deadlocked: {attempt['outcome']} after {attempt['seconds']:.1f} s"
        lines.append(f"{'naive send-first':<22} {attempt['numel']:>8} elements: {verdict}")
    for name, info in fixed.items():
        lines.append(f"{name:<22} {args.numel:>8} elements: completed in {info['seconds']:.3f} s, "
                     f"got rank {info['from_rank']}'s tensor")
    ctx.print_ordered("\n".join(lines))
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, {"rank": ctx.rank, "naive": naive, "fixed": fixed, "calls": calls})
    return {"world_size": ctx.world_size, "numel": args.numel, "deadlock_timeout": args.deadlock_timeout,
            "per_rank": everyone}


def lanes(per_rank: list[dict]) -> dict[str, list[dict]]:
    """Per variant, every rank's recorded calls in ms since the first rank entered that variant's first call."""
    out = {}
    for variant in per_rank[0]["calls"]:
        origin = min(c["start"] for p in per_rank for c in p["calls"][variant])
        out[variant] = [{"rank": p["rank"], "call": c["call"], "peer": c["peer"], "outcome": c["outcome"],
                         "start_ms": round(1e3 * (c["start"] - origin), 3),
                         "end_ms": round(1e3 * (c["end"] - origin), 3)}
                        for p in per_rank for c in p["calls"][variant]]
    return out


def draw(drawn: dict[str, list[dict]], world_size: int, numel: int, args: Settings) -> str:
    """One panel per variant, one lane per rank, one box per call from its start to its return (or its error)."""
    plt = plot.pyplot()
    kind = {"barrier": "barrier / new_group (set-up)", "new_group": "barrier / new_group (set-up)",
            "send": "blocking send", "recv": "blocking recv", "isend": "post isend / irecv",
            "irecv": "post isend / irecv", "wait(isend)": "wait", "wait(irecv)": "wait"}
    c10 = list(plot.colours(map(str, range(10))).values())  # the book's colour-blind palette, by index
    palette = dict(zip(dict.fromkeys(kind.values()), (c10[7], c10[1], c10[2], c10[9], c10[4])))  # as in ring_lanes
    names = [f"rank {r}" for r in range(world_size)]
    fig, axes = plt.subplots(len(drawn), 1, figsize=(13, 0.9 + len(drawn) * (0.75 + 0.45 * world_size)))
    from matplotlib.transforms import blended_transform_factory

    for ax, (variant, calls) in zip(axes, drawn.items()):
        def label(c: dict) -> str:
            name = c["call"] + ("" if c["peer"] is None else f" {'->' if 'send' in c['call'] else '<-'} {c['peer']}")
            return name + (" (gave up at the timeout; never reached its recv)" if c["outcome"] == "raised" else "")

        spans = [plot.Span(f"rank {c['rank']}", c["start_ms"], c["end_ms"], label(c), kind[c["call"]])
                 for c in calls]
        plot.timeline(ax, spans, names, unit="ms", palette=palette, legend=False, fontsize=7)
        width = max(c["end_ms"] for c in calls) - min(c["start_ms"] for c in calls)
        beside = blended_transform_factory(ax.transAxes, ax.transData)  # x in axes fractions, y in lanes
        for r in range(world_size):
            y = world_size - 1 - r
            # the calls too short for their name to fit in their box (plot.timeline's rule), in the order made
            small = [c for c in calls if c["rank"] == r
                     and (c["end_ms"] - c["start_ms"]) / width * 60 < len(label(c)) * 7 / 8]
            for c in small:
                if (c["end_ms"] - c["start_ms"]) < 0.004 * width:  # a call of microseconds: a tick, not a box
                    ax.plot([c["start_ms"]] * 2, [y - 0.4, y + 0.4], color="black", lw=0.8)
            if small:
                listed = ", ".join(f"{label(c)}: {c['end_ms'] - c['start_ms']:.2f}" for c in small)
                ax.text(1.01, y, "too short to label in its box, in ms:\n" + listed, transform=beside, va="center",
                        ha="left", fontsize=6.5, wrap=False)
        ax.set_xlim(0, max(c["end_ms"] for c in calls) * 1.02)
        ax.set_title(variant, fontsize=9, loc="left", pad=6)
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(facecolor=c, edgecolor="black", label=k) for k, c in palette.items()],
               loc="lower center", bbox_to_anchor=(0.37, 0), ncol=len(palette), fontsize=8, frameon=False)
    fig.suptitle(f"Swapping {numel:,} float32 elements, every call each rank made. Each panel has its own time "
                 "scale:\n0 ms is the moment the first rank entered that version's first call", fontsize=10, x=0.37)
    fig.tight_layout(rect=(0, 0.05, 0.74, 1))
    return str(plot.save(fig, args, "lanes"))


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"numel": 1 << 16, "deadlock_timeout": 1.0},
                     world_sizes=lambda w: w >= 2, world_sizes_text=">= 2 (even, unless --ring)")
    result = launch(worker, args)
    if result is None:
        return 0
    hung = sum(a["outcome"] != "completed" for p in result["per_rank"] for a in p["naive"])
    total = sum(len(p["naive"]) for p in result["per_rank"])
    print(f"naive version ({'ring' if args.ring else 'pairs'}, every rank sends first): {hung} of {total} "
          "rank-attempts deadlocked and were stopped by the "
          f"{result['deadlock_timeout']} s timeout")
    print(f"OK: the ordered and the non-blocking swaps delivered every {'left neighbour' if args.ring else 'partner'}"
          "'s tensor")
    result["lanes"] = lanes(result["per_rank"])
    for p in result["per_rank"]:
        del p["calls"]  # raw perf_counter seconds: the lanes hold the same calls, in ms from a common origin
    print(f"figure: {draw(result['lanes'], result['world_size'], args.numel, args)}")
    if args.json:
        report.write_json(args.json, {"ok": True, **result}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
