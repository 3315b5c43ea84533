"""Debugging a distributed job: a mismatched collective, a rank that never arrives, and where a hung rank waits.

What it shows (each scenario on its own gloo group with a short timeout, so nothing hangs for long)
    1. A mismatched collective: the last rank all-reduces one element more than the others, the kind of bug a
       single typo makes. With the debug level at DETAIL (TORCH_DISTRIBUTED_DEBUG=DETAIL for the whole job, or
       dist.set_debug_level before a group is created), torch checks every collective's op, shapes and dtypes
       across ranks first, and every rank raises an error that names two ranks and what each one called.
       Checked: every rank raised it. Without the check (--unchecked runs only this, on a plain group, and
       always exits 1) the outcome depends on the sizes: gloo may abort a process from its own thread
       (SIGABRT, no Python traceback), or some ranks return garbage while the others time out.
    2. A rank that never arrives: the last rank is stuck elsewhere (waiting for a message), the others call
       dist.monitored_barrier(wait_all_ranks=True). Rank 0's error names the ranks that did not arrive in time;
       a plain barrier would only time out. Checked: rank 0's error names the late rank.
    3. Where does a hung rank wait? Ranks 0 and 1 both receive first (chapter 2's deadlock). faulthandler's
       dump_traceback_later prints each rank's Python stack while it waits: the frame in this script and the
       torch.distributed call it is blocked in. Checked: the dump shows the recv. From outside the job,
       `py-spy dump --pid PID` prints the same for a running process without any change to its code.
    The figure (lanes.png, printed as `figure: <path>`) is the job's flight record of the three scenarios: every
    collective and point-to-point call each rank made (mlsys.trace.recording), from when it was entered to when it
    returned or raised, one lane per rank, with the error each raised call ended in. The JSON keeps the calls
    under `lanes`.

How to run (2 to 8 ranks)
    python tutorial/part1-distributed/chapter02-point-to-point/scripts/debugging.py
    python tutorial/part1-distributed/chapter02-point-to-point/scripts/debugging.py -w 4 --all-ranks

Runtime on 2 cores: about 11 s at the defaults (mostly the timeouts themselves), 8 s with --smoke.

Try next
    TORCH_DISTRIBUTED_DEBUG=DETAIL python tutorial/part1-distributed/chapter02-point-to-point/scripts/debugging.py
        -> the same output: scenario 1 already runs on a DETAIL group, and scenarios 2 and 3 make no mismatched
           collective, so checking every group of the job changes nothing you can see here
    TORCH_DISTRIBUTED_DEBUG=DETAIL \\
        python tutorial/part1-distributed/chapter02-point-to-point/scripts/debugging.py --unchecked
        -> now the "plain" group is checked too: every rank raises "Detected mismatch", and the job exits 1
    python tutorial/part1-distributed/chapter02-point-to-point/scripts/debugging.py -w 4
        -> rank 0's monitored_barrier error names rank 3; ranks 1 and 2 are told to look at rank 0's log
"""

from __future__ import annotations

import faulthandler
import re
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.launch import RankContext, launch
from mlsys.trace import recording

SCENARIOS = ("1. mismatched all_reduce (DETAIL group)", "2. monitored_barrier, one rank late",
             "3. ranks 0 and 1 both recv first")


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 2
    """Number of ranks to start (2 to 8). Under torchrun it is taken from WORLD_SIZE."""
    wait_timeout: float = 2.0
    """Seconds the mismatched all_reduce and the deadlocked recv wait before their groups give up."""
    barrier_timeout: float = 1.0
    """Seconds monitored_barrier waits for every rank to arrive."""
    unchecked: bool = False
    """Run only the mismatched all_reduce, on a plain group with no DETAIL check, and report what each rank saw
    (the job fails: exit code 1, by design)."""

    def validate(self) -> None:
        if not 0 < self.barrier_timeout < self.timeout or not 0 < self.wait_timeout < self.timeout:
            raise cli.UsageError(f"--wait-timeout and --barrier-timeout must lie in (0, --timeout={self.timeout})")


def short_group(seconds: float, detail: bool = False) -> dist.ProcessGroup:
    """A fresh gloo group of all ranks whose calls give up after `seconds`; checked collectives if `detail`."""
    before = dist.get_debug_level()
    if detail:
        dist.set_debug_level(dist.DebugLevel.DETAIL)  # read when the group is created
    try:
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
    finally:
        dist.set_debug_level(before)


def clip(text: str, limit: int) -> str:
    """At most `limit` characters, cut between two words and marked with " ..." when cut."""
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def first_line(err: BaseException, limit: int = 500) -> str:
    text = " ".join(str(err).split())
    text = re.sub(r", TensorDeviceTypes=TensorOptions\(.*?memory_format=\([^)]*\)\)", "", text)  # long, all alike
    return clip(text, limit)


# --8<-- [start:mismatch]
def mismatched_all_reduce(ctx: RankContext, group: dist.ProcessGroup) -> dict:
    """The last rank all-reduces 5 elements, every other rank 4: a one-character bug."""
    x = torch.ones(5 if ctx.rank == ctx.world_size - 1 else 4)
    try:
        dist.all_reduce(x, group=group)
        return {"outcome": "returned", "values": x.tolist()}
    except RuntimeError as err:
        return {"outcome": "raised", "error": first_line(err)}
# --8<-- [end:mismatch]


# --8<-- [start:late]
def late_rank(ctx: RankContext, args: Settings, group: dist.ProcessGroup) -> dict:
    """Every rank but the last calls monitored_barrier; the last is stuck in a recv that rank 0 answers only
    after its barrier has given up, then arrives too late."""
    late, wait = ctx.world_size - 1, timedelta(seconds=args.barrier_timeout)
    error = None
    if ctx.rank == late:
        dist.recv(torch.zeros(1), src=0)  # stuck here, as a rank stuck in a data loader or a long step would be
    try:
        dist.monitored_barrier(group, timeout=wait, wait_all_ranks=True)
    except RuntimeError as err:
        error = first_line(err)
    if ctx.rank == 0:
        dist.send(torch.ones(1), dst=late)  # release the late rank
    return {"late_rank": late, "error": error}
# --8<-- [end:late]


# --8<-- [start:hang]
def where_it_hangs(ctx: RankContext, args: Settings, group: dist.ProcessGroup) -> dict:
    """Ranks 0 and 1 both recv first (a deadlock). Half-way through the wait, faulthandler dumps the stack."""
    if ctx.rank > 1:
        return {}
    with tempfile.TemporaryFile("w+") as dump:
        faulthandler.dump_traceback_later(args.wait_timeout / 2, file=dump)  # fires only if we are still here
        try:
            dist.recv(torch.zeros(1), src=1 - ctx.rank, group=group)  # both wait for the other: nobody sends
            error = None
        except RuntimeError as err:
            error = first_line(err, 160)
        finally:
            faulthandler.cancel_dump_traceback_later()
        dump.seek(0)
        threads = dump.read().split("\n\n")  # one block per thread: the main thread's is the one that waits here
        stack = next(([line.strip() for line in block.splitlines() if line.strip().startswith("File")]
                      for block in threads if "in where_it_hangs" in block), [])
    return {"stack": stack, "error": error}
# --8<-- [end:hang]


def short_path(frame: str) -> str:
    """'File "/long/path/x.py", line 12 in f' -> 'x.py:12 in f'."""
    path, _, rest = frame.removeprefix('File "').partition('", line ')
    return f"{path.rsplit('/', 1)[-1]}:{rest}"


def unchecked(ctx: RankContext, args: Settings) -> None:
    """The mismatch on a plain group: whatever each rank sees, nobody gets a right answer, so the job fails."""
    dist.barrier()
    seen = mismatched_all_reduce(ctx, short_group(args.wait_timeout))  # gloo may abort this process in here
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, seen)
    for q, p in enumerate(everyone):
        ctx.print(f"rank {q}: " + (f"returned {p['values']} with no error" if p["outcome"] == "returned"
                                   else f"raised: {clip(p['error'], 150)}"))
    if ctx.rank == 0:  # one rank judges what all of them saw, so the job fails once, for the mismatch itself
        report.expect_equal("ranks that did not return the sum of the ones", [
            q for q, p in enumerate(everyone)
            if not (p["outcome"] == "returned" and set(p["values"]) == {float(ctx.world_size)})], [])


def worker(ctx: RankContext, args: Settings) -> dict | None:
    W, r = ctx.world_size, ctx.rank
    if args.unchecked:
        return unchecked(ctx, args)
    # Every group is created up front, while the ranks are in step: creating a group is itself a wait bounded by
    # its timeout, and after the late-rank scenario the ranks are seconds apart.
    dist.barrier()
    groups = [short_group(args.wait_timeout, detail=True), short_group(args.wait_timeout),
              short_group(args.wait_timeout)]
    calls: dict[str, list] = {name: [] for name in SCENARIOS}  # the flight record: every call, for the picture
    # Each scenario starts with the ranks lined up (a barrier on the default group, whose timeout is long): its
    # short timeouts are meant for the bug it stages, not for one rank starting late on a loaded machine.
    dist.barrier()
    with recording(calls[SCENARIOS[0]], also=("all_reduce",)):
        checked = mismatched_all_reduce(ctx, groups[0])
    dist.barrier()
    with recording(calls[SCENARIOS[1]], also=("monitored_barrier",)):
        barrier = late_rank(ctx, args, groups[1])
    dist.barrier()
    with recording(calls[SCENARIOS[2]]):
        hang = where_it_hangs(ctx, args, groups[2])
    if hang:  # the recorder's own frame (mlsys/trace.py) is not the program's: leave it out of the dump
        hang["stack"] = [f for f in hang["stack"] if "/mlsys/trace.py" not in f]
    everyone = [None] * W
    dist.all_gather_object(everyone, {"checked": checked, "barrier": barrier, "hang": hang, "calls": calls})

    report.expect_equal(f"rank {r} raised on the checked group", checked["outcome"], "raised")
    report.expect_equal(f"rank {r}'s error names the mismatch", "Detected mismatch" in checked["error"], True)
    if r == 0:
        report.expect_equal("rank 0's monitored_barrier names the late rank",
                            f"Ranks {W - 1} failed to pass monitoredBarrier" in (barrier["error"] or ""), True)
    if r <= 1:
        report.expect_equal(f"rank {r}'s stack dump shows where it waits",
                            any("in where_it_hangs" in f for f in hang["stack"])
                            and any(" in recv" in f for f in hang["stack"]), True)

    ctx.print(f"1. mismatched all_reduce (rank {W - 1} passes 5 elements, the others 4) on a DETAIL group")
    ctx.print(f"   rank 0 raised: {everyone[0]['checked']['error']}")
    ctx.print(f"\n2. monitored_barrier while rank {W - 1} is stuck elsewhere")
    for q, seen in enumerate(everyone):
        ctx.print(clip(f"   rank {q}: {seen['barrier']['error'] or 'passed'}", 230))
    ctx.print("\n3. ranks 0 and 1 both recv first; faulthandler's dump while they wait (innermost frame first):")
    for q in (0, 1):
        ctx.print(f"   rank {q}: " + " <- ".join(short_path(f) for f in everyone[q]["hang"]["stack"][:4]))
    ctx.print(f"   then the wait ended (the group's timeout, or the peer closing the connection when its own "
              f"timer fired first): {clip(everyone[0]['hang']['error'], 120)}")
    return {"checked_all_raised": True, "lanes": lanes(everyone),
            "barrier_error_rank0": everyone[0]["barrier"]["error"], "stack_rank0": everyone[0]["hang"]["stack"]}


def lanes(everyone: list[dict]) -> dict[str, list[dict]]:
    """Per scenario, every rank's recorded calls in ms since the first rank entered that scenario's first call,
    a raised call with the error the scenario caught on that rank."""
    out = {}
    for scenario, key in zip(SCENARIOS, ("checked", "barrier", "hang")):
        recorded = [c for p in everyone for c in p["calls"][scenario]]
        origin = min(c["start"] for c in recorded)
        out[scenario] = [{"rank": q, "call": c["call"], "peer": c["peer"], "numel": c["numel"],
                          "outcome": c["outcome"], "start_ms": round(1e3 * (c["start"] - origin), 3),
                          "end_ms": round(1e3 * (c["end"] - origin), 3),
                          **({"error": p[key].get("error")} if c["outcome"] == "raised" else {})}
                         for q, p in enumerate(everyone) for c in p["calls"][scenario]]
    return out


def gist(error: str | None) -> str:
    """A few words for an error in the picture (the run's output prints it whole)."""
    text = error or ""
    found = re.search(r"Ranks? [\d, ]+ failed to pass monitoredBarrier", text)
    for key, words in (("Detected mismatch", "Detected mismatch between collectives"),
                       ("failed to pass monitoredBarrier", found.group(0) if found else ""),
                       ("rank 0", "rank 0 gave up: see its log"), ("imed out", "timed out"),
                       ("onnection closed", "peer closed the connection")):
        if key in text:
            return words
    return clip(text, 40)


def draw(drawn: dict[str, list[dict]], world_size: int, args: Settings) -> str:
    """One panel per scenario, one lane per rank, one box per call; a raised call gets a red edge and its error."""
    plt = plot.pyplot()
    c10 = list(plot.colours(map(str, range(10))).values())  # the book's colour-blind palette, by index
    palette = {"all_reduce": c10[0], "monitored_barrier": c10[4], "recv": c10[2], "send": c10[3]}  # pink barrier:
    # far from send's vermilion
    names = [f"rank {q}" for q in range(world_size)]
    fig, axes = plt.subplots(len(drawn), 1, figsize=(12, 1.0 + len(drawn) * (0.75 + 0.5 * world_size)))
    for ax, (scenario, calls) in zip(axes, drawn.items()):
        def label(c: dict) -> str:
            if c["call"] == "all_reduce":
                return f"all_reduce of {c['numel']}"
            return c["call"] + ("" if c["peer"] is None else f" {'->' if c['call'] == 'send' else '<-'} {c['peer']}")

        spans = [plot.Span(f"rank {c['rank']}", c["start_ms"], c["end_ms"], label(c), c["call"]) for c in calls]
        plot.timeline(ax, spans, names, unit="ms", palette=palette, legend=False, fontsize=7)
        end = max(c["end_ms"] for c in calls)
        for c in calls:
            y = world_size - 1 - c["rank"]
            short = (c["end_ms"] - c["start_ms"]) / end * 60 < len(label(c)) * 7 / 8  # no room for its label inside
            if short:  # too short to see: a sliver of its colour, at least 0.6% of the panel, and a black tick
                ax.barh(y, max(c["end_ms"] - c["start_ms"], 0.006 * end), left=c["start_ms"], height=0.8,
                        color=palette[c["call"]], edgecolor="none")
                ax.plot([c["start_ms"]] * 2, [y - 0.4, y + 0.4], color="black", lw=0.8)
            if c["outcome"] == "raised":
                ax.barh(y, c["end_ms"] - c["start_ms"], left=c["start_ms"], height=0.8, fill=False,
                        edgecolor="red", linewidth=1.8)
                ax.text(c["end_ms"] + 0.01 * end, y, (f"then {label(c)} " if short else "") +
                        f"raised: {gist(c.get('error'))}", color="red", fontsize=7, va="center")
            elif short:
                ax.text(c["start_ms"], y + 0.42, label(c), fontsize=6.5, va="bottom")
        ax.set_xlim(0, end * 1.5)
        ax.set_title(scenario, fontsize=9, loc="left")
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=c, edgecolor="black", label=k) for k, c in palette.items()]
    handles.append(Patch(facecolor="white", edgecolor="red", linewidth=1.8, label="raised (its error in red)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle("The flight record of the three scenarios: every call each rank made, from entry to return or "
                 "error.\nEach panel has its own time scale; 0 ms = the first rank's first call there", fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return str(plot.save(fig, args, "lanes"))


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"wait_timeout": 1.0, "barrier_timeout": 0.5},
                     world_sizes=range(2, 9), world_sizes_text="2..8")
    result = launch(worker, args)
    if result is None:  # not rank 0's process (torchrun)
        return 0
    print("OK: DETAIL named the mismatch on every rank, monitored_barrier named the late rank, "
          "the stack dumps showed the recv")
    print(f"figure: {draw(result['lanes'], args.world_size, args)}")
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
