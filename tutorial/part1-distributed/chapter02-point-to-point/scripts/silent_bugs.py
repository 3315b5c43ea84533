"""Two non-blocking bugs that give a wrong answer without any error, each run wrong and then right, and drawn.

What it shows
    BUFFER REUSE  rank 0 isends [1,1,1,1], then fills the same tensor with 7s before wait(). gloo reads the tensor
                  only once the receiver's recv is posted, so rank 1 receives the 7s.
    MISSING WAIT  rank 1 reads its irecv buffer before wait(): it sees the zeros it allocated, although rank 0's
                  [5,5,5,5] arrives intact a moment later.
    Each is made deterministic with a dist.barrier() handshake, not left to timing luck, and each is checked: the
    buggy version must really get a wrong value and the fixed one the right value (exit 1 otherwise).
    The figure (silent_bugs.png) draws what happened in the run: one lane per rank, a box per call (recorded with
    mlsys.trace.recording), and a marker where the script changed or read a buffer, with the value it wrote or saw.
    The JSON keeps the same calls under `lanes` and the values under `pitfalls`.

How to run (any world size >= 2; ranks above 1 only take part in the barriers)
    python tutorial/part1-distributed/chapter02-point-to-point/scripts/silent_bugs.py
    torchrun --nproc-per-node 2 tutorial/part1-distributed/chapter02-point-to-point/scripts/silent_bugs.py

Contract flags: --seed changes nothing here (the tensors hold fixed values). The demonstrations move CPU tensors
and are written for gloo's transfers, so the backend is gloo (--backend nccl is refused).

Runtime on 2 cores: about 4 s (mostly starting the ranks and drawing), 4 s with --smoke.

Try next
    python tutorial/part1-distributed/chapter02-point-to-point/scripts/silent_bugs.py --verbose
        -> every isend, recv and barrier of both ranks on stderr as it happens, then, per panel of the figure, the
           same story in text: every call's start and return (waits included), and each write or read of a buffer
           with its value, all ranks merged in the order they happened
    python tutorial/part1-distributed/chapter02-point-to-point/scripts/silent_bugs.py -w 3
        -> a third rank joins the barriers only; the values are the same
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.launch import RankContext, launch
from mlsys.trace import note, recording


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 2
    """Number of ranks (at least 2; ranks 0 and 1 do the work). Under torchrun it is taken from WORLD_SIZE."""

    def validate(self) -> None:
        if self.backend == "nccl":
            raise cli.UsageError("the demonstrations move CPU tensors with gloo: use --backend gloo (or auto)")


# --8<-- [start:pitfalls]
def buffer_reuse(ctx: RankContext, safe: bool, log: list) -> list[float] | None:
    """Rank 0 isends [1,1,1,1] to rank 1, then overwrites the tensor with 7s. Returns what rank 1 received.
    `note(log, ...)` only records the moment and the value for the picture."""
    if ctx.rank == 0:
        data = torch.ones(4)
        request = dist.isend(data, dst=1)
        if safe:
            dist.barrier()  # handshake first (so the timing is the same in both versions)...
            request.wait()  # ...and change the tensor only after the send has completed
            data.fill_(7.0)
            note(log, "fill_(7)", data)
        else:
            data.fill_(7.0)  # BUG: the send is still in flight; gloo has not read `data` yet
            note(log, "fill_(7)", data)
            dist.barrier()  # handshake: rank 1 posts its recv only now, after the change
            request.wait()
    elif ctx.rank == 1:
        got = torch.zeros(4)
        dist.barrier()
        dist.recv(got, src=0)
        note(log, "read", got)
        return got.tolist()
    else:
        dist.barrier()
    return None


def missing_wait(ctx: RankContext, safe: bool, log: list) -> list[float] | None:
    """Rank 0 sends [5,5,5,5] only after a barrier; rank 1 reads its irecv buffer. Returns what rank 1 read."""
    if ctx.rank == 1:
        got = torch.zeros(4)
        request = dist.irecv(got, src=0)
        if safe:
            dist.barrier()
            request.wait()  # the data is ours only after wait() returns
            seen = got.clone()
            note(log, "read", seen)
        else:
            seen = got.clone()  # BUG: read before wait(); rank 0 cannot even have sent yet (it waits on the barrier)
            note(log, "read", seen)
            dist.barrier()
            request.wait()
            note(log, "read after wait", got)  # what the buggy version never looked at: the message, intact
        return seen.tolist()
    dist.barrier()
    if ctx.rank == 0:
        dist.send(torch.full((4,), 5.0), dst=1)
    return None
# --8<-- [end:pitfalls]


PITFALLS = {"buffer reuse": (buffer_reuse, [1.0] * 4), "missing wait": (missing_wait, [5.0] * 4)}


def worker(ctx: RankContext, args: Settings) -> dict:
    results, lanes = {}, {}
    for name, (fn, sent) in PITFALLS.items():
        got = {}
        for version, safe in (("buggy", False), ("fixed", True)):
            dist.barrier()  # not recorded: each panel begins with its own calls
            with recording(lanes.setdefault(f"{name}, {version}", [])) as log:
                got[version] = fn(ctx, safe, log)
        if ctx.rank == 1:
            # The demonstration is itself checked: the buggy version must differ, the fixed one must match.
            if got["buggy"] == sent:
                raise cli.SelfCheckFailed(f"{name}: the buggy version got the right value {got['buggy']}; "
                                          "bug not shown")
            report.expect_equal(f"{name} (fixed)", got["fixed"], sent)
            results[name] = {"sent": sent, "buggy_received": got["buggy"], "fixed_received": got["fixed"]}
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, {"rank": ctx.rank, "pitfalls": results, "lanes": lanes})
    return {"world_size": ctx.world_size, "per_rank": everyone}


def lanes_in_ms(per_rank: list[dict]) -> dict[str, list[dict]]:
    """Per panel, every rank's recorded calls and notes in ms since the first of them."""
    out = {}
    for panel in per_rank[0]["lanes"]:
        origin = min(c["start"] for p in per_rank for c in p["lanes"][panel])
        out[panel] = [{"rank": p["rank"], "call": c["call"], "peer": c["peer"], "outcome": c["outcome"],
                       "value": c.get("value"), "start_ms": round(1e3 * (c["start"] - origin), 3),
                       "end_ms": round(1e3 * (c["end"] - origin), 3)}
                      for p in per_rank for c in p["lanes"][panel]]
    return out


def events_text(lanes: dict[str, list[dict]]) -> list[str]:
    """The figure in text: per panel, every call's start and return and every note, all ranks in time order."""
    lines = []
    for panel, calls in lanes.items():
        lines.append(f"{panel}:")
        events = []
        for c in calls:
            name = c["call"] + ("" if c["peer"] is None else f" {'->' if 'send' in c['call'] else '<-'} {c['peer']}")
            if c["outcome"] == "note":
                events.append((c["start_ms"], c["rank"], f"* {c['call']}: {c['value']}"))
            else:
                events.append((c["start_ms"], c["rank"], f"-> {name}"))
                events.append((c["end_ms"], c["rank"], f"<- {name} {c['outcome']}"))
        lines += [f"  {t:9.3f} ms  rank {r}  {text}" for t, r, text in sorted(events, key=lambda e: e[0])]
    return lines


def draw(lanes: dict[str, list[dict]], world_size: int, args: Settings) -> str:
    """A panel per (bug, version): one lane per rank, a box per call, a marker per note with its value. The x axis
    is the order in which things happened (milliseconds in the JSON): with ranks sharing cores, the spacing in
    milliseconds is mostly the scheduler's."""
    plt = plot.pyplot()
    kind = {"barrier": "barrier", "isend": "post isend / irecv", "irecv": "post isend / irecv",
            "send": "blocking send", "recv": "blocking recv", "wait(isend)": "wait", "wait(irecv)": "wait"}
    c10 = list(plot.colours(map(str, range(10))).values())  # the book's colour-blind palette, by index
    palette = {"blocking send": c10[1], "blocking recv": c10[2], "post isend / irecv": c10[9], "wait": c10[4],
               "barrier": c10[7]}  # the colours of deadlock.py's lanes
    names = [f"rank {r}" for r in range(world_size)]
    fig, axes = plt.subplots(2, 2, figsize=(13, 2.2 + 2 * (0.9 + 0.55 * world_size)))
    for ax, (panel, calls) in zip(axes.ravel(), lanes.items()):
        at = {t: i for i, t in enumerate(sorted({c[k] for c in calls for k in ("start_ms", "end_ms")}))}
        boxes = [c for c in calls if c["outcome"] != "note"]
        spans = [plot.Span(f"rank {c['rank']}", at[c["start_ms"]], at[c["end_ms"]] + 0.05, "", kind[c["call"]])
                 for c in boxes]
        plot.timeline(ax, spans, names, palette=palette, legend=False)
        for c, span in zip(boxes, spans):  # the call's name inside its box; narrow boxes get it upright
            label = c["call"] + ("" if c["peer"] is None else f" {'->' if 'send' in c['call'] else '<-'} {c['peer']}")
            px_per_unit = ax.get_window_extent().width / (len(at) + 1)
            wide = (span.end - span.start) * px_per_unit >= 0.6 * 7 * fig.dpi / 72 * len(label) + 4
            short = "wait" if c["call"].startswith("wait") else label.split(" ")[0]  # upright: the name only
            ax.text((span.start + span.end) / 2, world_size - 1 - c["rank"], label if wide else short, ha="center",
                    va="center", fontsize=7 if wide else 6.5, rotation=0 if wide else 90)
        for c in (c for c in calls if c["outcome"] == "note"):
            x, y = at[c["start_ms"]] + 0.025, world_size - 1 - c["rank"]
            ax.axvline(x, color="0.25", lw=1, ls="--", zorder=0)  # across every lane: what came before, what after
            ax.plot(x, y, marker="*", ms=15, color=c10[8], mec="black", zorder=5)
            value = ",".join(f"{v:g}" for v in c["value"])
            # the label sits just above the lane's boxes (the space between lanes), clear of the names inside them
            ax.annotate(f"{c['call']}: [{value}]", (x, y + 0.4), xytext=(4, 1), textcoords="offset points",
                        fontsize=8, va="bottom", color="black", weight="bold", zorder=6,
                        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85})
        ax.set_xlim(-0.4, len(at) + 1.5)
        ax.set_xticks([])
        ax.set_title(panel, fontsize=10, loc="left")
    for ax in axes[-1]:
        ax.set_xlabel("order of events, all ranks together (milliseconds in the JSON)", fontsize=8)
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=c, edgecolor="black", label=k) for k, c in palette.items()]
    handles.append(plt.Line2D([], [], color="0.25", marker="*", ms=11, mfc=c10[8], mec="black", ls="--",
                              label="the script wrote or read a buffer"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle("What happened in each run: every call of each rank, and where the script touched a buffer",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return str(plot.save(fig, args, "silent_bugs"))


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={}, world_sizes=lambda w: w >= 2, world_sizes_text=">= 2")
    args.backend = "gloo"  # CPU tensors; auto would pick nccl on a GPU machine
    result = launch(worker, args)
    if result is None:  # a non-zero torchrun rank: rank 0 reports
        return 0
    pitfalls = result["per_rank"][1]["pitfalls"]
    for name, seen in pitfalls.items():
        print(f"{name:<13} sent {seen['sent']}  buggy version got {seen['buggy_received']}  "
              f"fixed version got {seen['fixed_received']}")
    lanes = lanes_in_ms(result["per_rank"])
    if args.verbose:  # the picture in text: the waits and the buffer writes and reads that the live trace omits
        print("\n".join(events_text(lanes)))
    print(f"figure: {draw(lanes, result['world_size'], args)}")
    print("OK: both bugs gave a wrong value without any error, and both fixes the value that was sent")
    if args.json:
        report.write_json(args.json, {"ok": True, "world_size": result["world_size"], "pitfalls": pitfalls,
                                      "lanes": lanes}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
