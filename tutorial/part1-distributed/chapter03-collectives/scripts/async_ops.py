"""Asynchronous collectives: async_op=True returns a work handle at once; compute while the bytes move, then wait.

What it shows
    1. The handle: `work = dist.all_reduce(x, async_op=True)` returns before the sum is known. `work.is_completed()`
       asks without blocking, `work.wait()` blocks until the result may be used, and `work.get_future()` gives a
       torch.futures.Future whose `.then(fn)` runs fn on the result (here: divide by W to get the mean). Every rank
       checks the sum and the mean against values computed without communication.
    2. Overlap, measured: an all_reduce of --mib MiB and --matmuls independent (n x n) matmuls, timed four ways on
       every rank (the slowest rank counts): compute alone, communication alone, one after the other, and
       overlapped (issue the all_reduce, compute, then wait). The overlapped result is checked equal to the
       sequential one. Each variant's median over --repeats rounds is printed in ms with one decimal, and
       "hidden" is computed from those printed values: how much of the shorter of the two the overlap saved
       against the two parts timed alone, (compute + communication - overlapped) / min(compute, communication):
       1 = fully hidden, 0 = no gain; undefined (null in the JSON) with --matmuls 0 or on one rank. (The
       sequential step, the two timed as one call, is printed too; it can differ from the sum of the parts.) A last line
       says which case the run fell into, including the one no real overlap can produce (overlapped faster than
       its longer part alone), which only timing noise explains.
    3. The figure (timeline.png, printed as `figure: <path>`): one more round of each order, untimed, with every
       all_reduce call, wait() and the moment the sum was ready (the handle's future completing, on gloo's thread)
       recorded on every rank (mlsys.trace.recording), one lane per rank. The compute is drawn where it ran: in
       `overlapped` between the all_reduce's return and the wait() call, in `sequential` after the all_reduce until
       the function returned (nothing else runs there). The JSON keeps the recorded calls under `timeline`. One
       line reads that round (`figure_summary` in the JSON): each rank's wait() against its own blocking all_reduce
       (short: most of its bytes moved during the compute), whether the overlapped round ended sooner, and, if not,
       whether the compute itself slowed on every rank. With no compute between post and
       wait() (--matmuls 0) the line says so instead. The longer readings stay in the JSON (`figure_text`,
       `figure_wait`). A last line sets that single round beside the table's medians (`figure_note`): one sample,
       its gain or loss need not match the verdict.

What "completed" means depends on the backend
    gloo (CPU): the collective runs on gloo's own threads; wait() returns once the result is in x.
    NCCL (GPU): the collective is a kernel on NCCL's stream. wait() returns to Python at once and makes the current
    CUDA stream wait for it, so later kernels see the result; is_completed() turns True when the kernel has run.
    To time it on a GPU, the script synchronizes the device, as a timer must.

How to run (any world size from 1 to 8)
    python tutorial/part1-distributed/chapter03-collectives/scripts/async_ops.py -w 2
    torchrun --nproc-per-node 2 tutorial/part1-distributed/chapter03-collectives/scripts/async_ops.py

Runtime on 2 idle cores: about 7 s at the defaults, 5 s with --smoke; two or three times that on a busy machine.

Try next
    python tutorial/part1-distributed/chapter03-collectives/scripts/async_ops.py --matmuls 0
        -> nothing to overlap with: "hidden: undefined, no compute to hide behind" (null in the --json), and the
           verdict says so; communication, sequential and overlapped then time the same all-reduce, so any
           difference is noise, but under load the three times can differ by a third or more. The figure's line
           says "no compute ran" and that wait() only measured the all-reduce itself
    python tutorial/part1-distributed/chapter03-collectives/scripts/async_ops.py -w 4 --mib 32
        -> four ranks on two cores and a 32 MiB all-reduce: every time grows, and the "hidden" line says how much
           of the shorter part the overlap still saved against the two parts timed alone; it varies from run to run,
           since both orders compete with three other ranks for the same cores
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mlsys import bench, cli, plot, report
from mlsys.launch import RankContext, launch
from mlsys.trace import note, recording


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 2
    """Number of ranks to start (1 to 8). Under torchrun it is taken from WORLD_SIZE."""
    mib: float = 16.0
    """Size of the all_reduce buffer in MiB (float32) for the overlap timing."""
    matmuls: int = 4
    """Independent (n x n) matmuls of compute to overlap with the all_reduce (0: none)."""
    n: int = 512
    """Side of the square matrices multiplied."""
    repeats: int = 7
    """Timed rounds of the four variants, taken in turn; each variant's median is reported (after a warm-up
    round)."""

    def validate(self) -> None:
        if not 0 < self.mib <= 1024:
            raise cli.UsageError(f"--mib must lie in (0, 1024], got {self.mib}")
        if self.matmuls < 0 or self.n < 1 or self.repeats < 1:
            raise cli.UsageError("--matmuls must be >= 0, --n and --repeats >= 1")


# --8<-- [start:handle]
def handle_demo(ctx: RankContext, numel: int = 4) -> dict:
    """all_reduce with async_op=True: the handle, its future, and a .then() callback on the result."""
    W, r = ctx.world_size, ctx.rank
    x = torch.full((numel,), float(r + 1), device=ctx.device)
    work = dist.all_reduce(x, async_op=True)  # returns at once; x must not be read or written yet
    at_issue = work.is_completed()  # a non-blocking question: False while the bytes move, True if already done
    mean = work.get_future().then(lambda fut: fut.value()[0] / W)  # runs when the all_reduce is done
    work.wait()  # from here on, x holds the sum (on NCCL: every later kernel on this stream sees it)
    report.expect_equal(f"sum on rank {r}", x.cpu().tolist(), [W * (W + 1) / 2] * numel)
    report.expect_equal(f"mean on rank {r}", mean.wait().cpu().tolist(), [(W + 1) / 2] * numel)
    return {"completed_at_issue": at_issue, "completed_after_wait": work.is_completed()}
# --8<-- [end:handle]


def finish(device: torch.device) -> None:
    """A timer's end: on a GPU, wait until the kernels queued so far have run."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --8<-- [start:overlap]
def compute(mats: list[torch.Tensor]) -> None:
    for m in mats:
        torch.mm(m, m)  # independent of the buffer being all-reduced


def sequential(buf: torch.Tensor, mats: list[torch.Tensor]) -> None:
    dist.all_reduce(buf)  # blocks until the sum has arrived
    compute(mats)


def overlapped(buf: torch.Tensor, mats: list[torch.Tensor]) -> None:
    work = dist.all_reduce(buf, async_op=True)  # the bytes start moving ...
    compute(mats)  # ... while this rank computes
    work.wait()  # buf is used only after this line
# --8<-- [end:overlap]


def slowest(fn, device: torch.device) -> float:
    """One timed call of fn, all ranks starting together; the slowest rank's seconds."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    finish(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def summarize(times_ms: dict[str, float]) -> tuple[dict[str, float], float, str]:
    """The four medians rounded to 0.1 ms as printed, `hidden` computed from those printed values (so that it can be
    checked by hand), and a verdict on what the run shows against two baselines: the sum of the parts (compute plus
    communication, each timed alone) and the sequential step (the `sequential` variant, the two timed as one call).

    hidden = (compute + communication - overlapped) / min(compute, communication): the share of the shorter part
    that disappeared when the two ran together, measured against the two parts timed alone."""
    t = {k: round(v, 1) for k, v in times_ms.items()}
    longer, shorter = max(t["compute"], t["communication"]), min(t["compute"], t["communication"])
    both = round(t["compute"] + t["communication"], 1)
    hidden = (both - t["overlapped"]) / shorter if shorter > 0 else 0.0
    if t["overlapped"] < longer:
        verdict = (f"overlapped ({t['overlapped']:.1f} ms) came out below its longer part alone ({longer:.1f} ms), "
                   "which no overlap can do: here the timing noise of shared cores is larger than the effect, "
                   "so read `hidden` as approximate")
    elif t["overlapped"] >= both:
        verdict = (f"overlapped took at least as long as the sum of the parts ({both:.1f} ms): nothing was hidden "
                   "in this run (both parts competed for the same cores)")
    elif t["overlapped"] >= t["sequential"]:
        verdict = (f"overlapped beat the sum of the parts ({both:.1f} ms) but not the sequential step "
                   f"({t['sequential']:.1f} ms): the two baselines disagree by more than the effect, so this "
                   "run shows no clear gain")
    else:
        verdict = (f"overlapped lies between its longer part alone ({longer:.1f} ms) and the sum of the parts "
                   f"({both:.1f} ms), and below the sequential step ({t['sequential']:.1f} ms): part of "
                   "the shorter part was hidden")
    return t, round(hidden, 2), verdict


def recorded_round(buf: torch.Tensor, mats: list[torch.Tensor], device: torch.device) -> dict[str, list[dict]]:
    """One more call of each order, untimed, with its all_reduce, wait() and the sum's arrival recorded; a note
    marks the moment the function returned (after the device finished)."""
    rounds: dict[str, list[dict]] = {}
    for name, fn in (("sequential", sequential), ("overlapped", overlapped)):
        dist.barrier()  # not recorded: start together, so that the lanes line up
        with recording(rounds.setdefault(name, []), also=("all_reduce",)) as calls:
            fn(buf, mats)
            finish(device)
            note(calls, "returned")
    return rounds


def timeline(per_rank: list[dict]) -> dict[str, list[dict]]:
    """Per order, every rank's recorded calls in ms since the first rank entered that order's first call."""
    out = {}
    for order in per_rank[0]:
        origin = min(c["start"] for rounds in per_rank for c in rounds[order])
        out[order] = [{"rank": q, "call": c["call"], "start_ms": round(1e3 * (c["start"] - origin), 3),
                       "end_ms": round(1e3 * (c["end"] - origin), 3),
                       **({"done_ms": round(1e3 * (c["done"] - origin), 3)} if "done" in c else {})}
                      for q, rounds in enumerate(per_rank) for c in rounds[order]]
    return out


def compute_spans(lanes: dict[str, list[dict]]) -> dict[str, dict]:
    """Per order, from the recorded calls: every rank's compute box (as drawn: after the all_reduce until the
    function returned, or until wait() was called; `compute_by_rank`, in rank order), the longest of them
    (compute_ms, on rank compute_rank, the first such rank on a tie) and when the last rank returned, in ms; for the
    sequential order also every rank's blocking all_reduce (comm_by_rank) and the longest (comm_ms), for the
    overlapped one every rank's wait() (wait_by_rank), the shortest and the longest (wait_ms, wait_max_ms)."""
    out: dict[str, dict] = {}
    for order, calls in lanes.items():
        boxes, ends, comms, waits = [], [], [], []
        for q in sorted({c["rank"] for c in calls}):
            call = {c["call"]: c for c in calls if c["rank"] == q}
            stop = call["wait(all_reduce)"]["start_ms"] if order == "overlapped" else call["returned"]["start_ms"]
            boxes.append(round(stop - call["all_reduce"]["end_ms"], 1))
            ends.append(call["returned"]["end_ms"])
            comms.append(round(call["all_reduce"]["end_ms"] - call["all_reduce"]["start_ms"], 1))
            if order == "overlapped":
                waits.append(round(call["wait(all_reduce)"]["end_ms"] - call["wait(all_reduce)"]["start_ms"], 1))
        out[order] = {"compute_ms": max(boxes), "compute_rank": boxes.index(max(boxes)),
                      "compute_by_rank": boxes, "round_ms": round(max(ends), 1)}
        if order == "overlapped":
            out[order].update(wait_by_rank=waits, wait_ms=min(waits), wait_max_ms=max(waits))
        else:
            out[order].update(comm_by_rank=comms, comm_ms=max(comms))
    return out


def no_compute(spans: dict[str, dict]) -> bool:
    """True when no rank computed between its post and its wait() for long enough to hide anything: every overlapped
    compute box under 1 ms or under 5% of the longest blocking all_reduce (--matmuls 0 leaves only the empty loop).
    Then the overlapped round is the all-reduce alone, and neither its wait() nor its end says anything about
    overlap."""
    limit = max(1.0, 0.05 * spans["sequential"].get("comm_ms", 0.0))
    return max(spans["overlapped"]["compute_by_rank"]) < limit


def figure_text(spans: dict[str, dict]) -> str:
    """One sentence on the figure's round, its direction computed from the recorded spans: each rank's overlapped
    compute box against the same rank's sequential one (boxes on different ranks are never compared), and whether
    the overlapped round ended sooner. A direction is stated only when every rank agrees. With no compute between
    post and wait() (no_compute) both rounds are one all-reduce, and the sentence says so instead."""
    seq, ovl = spans["sequential"], spans["overlapped"]
    if no_compute(spans):  # both rounds are one all-reduce each: a difference between them is not overlap
        head = (f"there was no compute to overlap (at most {max(ovl['compute_by_rank']):.1f} ms between post and "
                "wait() on any rank), so each round is a single all-reduce")
        if ovl["round_ms"] < seq["round_ms"]:
            return (f"{head}: the overlapped round ended {seq['round_ms'] - ovl['round_ms']:.1f} ms sooner "
                    f"({ovl['round_ms']:.1f} ms against {seq['round_ms']:.1f} ms), a difference between two single "
                    "all-reduces, not a gain from overlap")
        return (f"{head}: the overlapped round ended no sooner ({ovl['round_ms']:.1f} ms against "
                f"{seq['round_ms']:.1f} ms), as nothing could be overlapped")
    pairs = list(zip(ovl["compute_by_rank"], seq["compute_by_rank"]))  # (overlapped, sequential) box, rank by rank
    # under a millisecond (--matmuls 0: no matmuls, only the loop around them) a ratio of two tiny times says nothing
    if min(min(pair) for pair in pairs) < 1.0:
        q = max(range(len(pairs)), key=lambda k: pairs[k][0])
        why = (f"was too short to compare ({pairs[q][0]:.1f} ms against {pairs[q][1]:.1f} ms sequential, "
               f"on rank {q})")
    else:
        ratios = [o / s for o, s in pairs]
        lo, hi = min(range(len(pairs)), key=ratios.__getitem__), max(range(len(pairs)), key=ratios.__getitem__)
        ranks = [lo] if lo == hi else sorted({lo, hi})
        boxes = "; ".join(f"rank {q}: {pairs[q][0]:.1f} ms overlapped against {pairs[q][1]:.1f} ms sequential"
                          for q in ranks)
        span = (f"{ratios[lo]:.1f}x" if f"{ratios[lo]:.1f}" == f"{ratios[hi]:.1f}" else
                f"{ratios[lo]:.1f}x to {ratios[hi]:.1f}x")
        if ratios[lo] > 1.1:
            why = (f"took {span} the same rank's sequential compute ({boxes}): the all-reduce's work ran on the "
                   "same cores and slowed the matmuls down")
        elif ratios[hi] < 0.9:
            why = (f"took {span} the same rank's sequential compute ({boxes}): the same matmuls vary that much "
                   "from one round to the next")
        elif ratios[lo] >= 0.9 and ratios[hi] <= 1.1:
            why = f"took about the same rank's sequential compute time ({boxes})"
        else:
            why = (f"took {span} the same rank's sequential compute ({boxes}): the ranks disagree, so this round "
                   "shows no direction")
    if ovl["round_ms"] < seq["round_ms"]:
        saved = (f"the overlapped round ended {seq['round_ms'] - ovl['round_ms']:.1f} ms sooner "
                 f"({ovl['round_ms']:.1f} ms against {seq['round_ms']:.1f} ms), in this one sample")
    else:
        # "wait() found the sum ready" only if some rank's wait() was near zero: under 1 ms or 5% of the blocking
        # all_reduce's time; a long wait means the sum was not ready, and the clause would be false
        wait, comm = ovl.get("wait_ms"), seq.get("comm_ms", 0.0)
        ready = wait is not None and wait < max(1.0, 0.05 * comm)
        saved = (f"the overlapped round ended no sooner ({ovl['round_ms']:.1f} ms against {seq['round_ms']:.1f} "
                 "ms): " + ("even where wait() found the sum ready, " if ready else "") + "nothing was saved")
    return f"the overlapped compute {why}, and {saved}"


def wait_reading(spans: dict[str, dict]) -> str:
    """One sentence reading the diamonds of the figure's overlapped round: each rank's wait() against the same
    rank's blocking all_reduce in the top panel. A wait under half the blocking call means most of the bytes moved
    during the compute; one above 80% of it, that almost none did; in between, part did. With no compute between
    post and wait() (no_compute) nothing can have moved during a compute, and the sentence says that wait() only
    measured the all-reduce. A case is named only when every rank falls in it."""
    comms, waits = spans["sequential"]["comm_by_rank"], spans["overlapped"]["wait_by_rank"]
    ratios = [w / c if c > 0 else float("inf") for w, c in zip(waits, comms)]
    lo, hi = min(range(len(ratios)), key=ratios.__getitem__), max(range(len(ratios)), key=ratios.__getitem__)
    W = len(waits)
    shown = list(range(W)) if W <= 2 else sorted({lo, hi})  # more than two ranks: the lowest and highest ratio
    extremes = ("" if len(shown) == W else f" (the extremes of the {W} ranks)" if len(shown) > 1 else
                f" (the same ratio on all {W} ranks)")
    head = ("wait() against the same rank's blocking all_reduce above: " +
            "; ".join(f"rank {q} {waits[q]:.1f} ms against {comms[q]:.1f} ms" for q in shown) + extremes)
    if no_compute(spans):
        return (f"{head}: no compute ran between the post and wait() (at most "
                f"{max(spans['overlapped']['compute_by_rank']):.1f} ms on any rank), so wait() only measured the "
                "all-reduce itself, and no bytes can have moved during a compute")
    if min(comms) < 1.0:
        return f"{head}: the blocking call was too short to compare with"

    def case(wait: float, comm: float) -> str:
        return "most" if wait < 0.5 * comm else "none" if wait > 0.8 * comm else "part"

    cases = {case(w, c) for w, c in zip(waits, comms)}
    if len(cases) > 1:
        return f"{head}: the ranks fall in different cases, so this round names none"
    return head + {"most": ": much shorter, so most of the bytes moved during the compute",
                   "part": ": part of the bytes moved during the compute, the rest after it",
                   "none": ": about as long, so almost none of the bytes moved during the compute"}[cases.pop()]


def figure_summary(spans: dict[str, dict]) -> str:
    """The drawn round in plain words, printed under the figure (`figure_summary` in the JSON; figure_text and
    figure_wait keep the long form), every direction from the recorded spans: each rank's wait() against its own
    blocking all_reduce (under half: most of its bytes moved during the compute; above 80%: few if any did; in
    between: part did), whether the overlapped round ended sooner, and, when it did not, whether
    the compute itself slowed (every rank's overlapped box over 1.1x its sequential one)."""
    seq, ovl = spans["sequential"], spans["overlapped"]
    if no_compute(spans):
        return (f"no compute ran between the post and wait() (at most {max(ovl['compute_by_rank']):.1f} ms on any "
                "rank), so wait() only measured the all-reduce itself, and the round says nothing about overlap")
    readings = []
    for q, (w, c) in enumerate(zip(ovl["wait_by_rank"], seq["comm_by_rank"])):
        how = ("the blocking call was too short to compare" if c < 1.0 else
               "so most of its bytes moved during the compute" if w < 0.5 * c else
               "so few if any of its bytes moved during the compute" if w > 0.8 * c else
               "so part of its bytes moved during the compute")
        readings.append(f"rank {q} waited {w:.1f} ms against {c:.1f} ms for its blocking all_reduce, {how}")
    moved = "; ".join(readings)
    if ovl["round_ms"] < seq["round_ms"]:
        return (f"{moved}; and the round ended {seq['round_ms'] - ovl['round_ms']:.1f} ms sooner "
                f"({ovl['round_ms']:.1f} ms against {seq['round_ms']:.1f} ms)")
    early = all(1.0 <= c and w <= 0.8 * c for w, c in zip(ovl["wait_by_rank"], seq["comm_by_rank"]))
    pairs = list(zip(ovl["compute_by_rank"], seq["compute_by_rank"]))  # (overlapped, sequential) box, rank by rank
    slowed = all(s >= 1.0 and o > 1.1 * s for o, s in pairs)
    why = (f", because the compute slowed on every rank (rank 0 from {pairs[0][1]:.1f} to {pairs[0][0]:.1f} ms)"
           if slowed else "")
    return (f"{moved}; {'yet' if early else 'and'} nothing was saved (the round ended at "
            f"{ovl['round_ms']:.1f} ms against {seq['round_ms']:.1f} ms){why}")


def figure_note(spans: dict[str, dict[str, float]], times: dict[str, float]) -> str:
    """One sentence setting the figure's single round beside the table's medians: its sequential compute box
    against the compute median, its two rounds against the two orders' medians; "slower" or "faster" only when
    all three point the same way by more than 5%."""
    seq, ovl = spans["sequential"], spans["overlapped"]
    pairs = [(seq["compute_ms"], times["compute"]), (seq["round_ms"], times["sequential"]),
             (ovl["round_ms"], times["overlapped"])]
    way = ("slower than" if all(a > 1.05 * b for a, b in pairs) else
           "faster than" if all(a < b / 1.05 for a, b in pairs) else "not")
    return (f"The drawn round is a single sample, {way} the table's medians: its sequential compute box "
            f"{seq['compute_ms']:.1f} ms (rank {seq.get('compute_rank', '?')}) against the compute median of "
            f"{times['compute']:.1f} ms, its rounds {seq['round_ms']:.1f} ms sequential and {ovl['round_ms']:.1f} ms "
            f"overlapped against medians of {times['sequential']:.1f} and {times['overlapped']:.1f} ms, so the "
            "figure's gain or loss need not match the verdict")


def draw(lanes: dict[str, list[dict]], W: int, args: Settings) -> str:
    """One panel per order, one lane per rank: the all_reduce (blocking, or its post), the compute where it ran,
    wait(), and a diamond where the sum was ready; both panels on one time axis."""
    plt = plot.pyplot()
    kinds = {"all_reduce": "all_reduce, blocking", "post": "all_reduce(async_op=True): post",
             "compute": "compute (matmuls)", "wait(all_reduce)": "wait()"}
    palette = plot.colours(kinds.values())
    names = [f"rank {q}" for q in range(W)]
    fig, axes = plt.subplots(2, 1, figsize=(11, 1.6 + 2 * (0.6 + 0.45 * W)), sharex=True)
    for ax, (order, calls) in zip(axes, lanes.items()):
        spans = []
        for q in range(W):
            mine = [c for c in calls if c["rank"] == q]
            call = {c["call"]: c for c in mine}
            ar, back = call["all_reduce"], call["returned"]
            if order == "sequential":
                spans += [plot.Span(names[q], ar["start_ms"], ar["end_ms"], "all_reduce", kinds["all_reduce"]),
                          plot.Span(names[q], ar["end_ms"], back["start_ms"], "compute", kinds["compute"])]
            else:
                waited = call["wait(all_reduce)"]
                spans += [plot.Span(names[q], ar["start_ms"], ar["end_ms"], "", kinds["post"]),
                          plot.Span(names[q], ar["end_ms"], waited["start_ms"], "compute", kinds["compute"]),
                          plot.Span(names[q], waited["start_ms"], waited["end_ms"], "", kinds["wait(all_reduce)"])]
            ready = ar.get("done_ms", ar["end_ms"])
            ax.plot([ready], [W - 1 - q], marker="D", color="black", markersize=7, zorder=5)
            if order == "overlapped":  # the post and the wait are often too short to see: their times, in text
                ax.text(back["end_ms"], W - 1 - q, f"  post {ar['end_ms'] - ar['start_ms']:.2f} ms, wait "
                        f"{waited['end_ms'] - waited['start_ms']:.2f} ms", va="center", fontsize=7)
        plot.timeline(ax, spans, names, unit="ms" if order == "overlapped" else "", palette=palette, legend=False)
        ax.set_title({"sequential": "sequential(buf, mats): the all_reduce, then the compute",
                      "overlapped": "overlapped(buf, mats): post the all_reduce, compute, wait()"}[order],
                     fontsize=9, loc="left")
        ax.set_xlim(right=max(c["end_ms"] for c in lanes["overlapped"] + lanes["sequential"]) * 1.25)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=c, edgecolor="black", label=k) for k, c in palette.items()]
    handles.append(Line2D([], [], marker="D", color="black", lw=0, label="the sum is ready on this rank"))
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"One round of each order, {args.mib:g} MiB all_reduce and {args.matmuls} matmuls of "
                 f"{args.n}x{args.n}, every rank's calls as recorded; 0 ms = the first call of the round", fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return str(plot.save(fig, args, "timeline"))


def worker(ctx: RankContext, args: Settings) -> dict:
    W, r, dev = ctx.world_size, ctx.rank, ctx.device
    results = {"world_size": W, "backend": ctx.backend}
    flags = handle_demo(ctx)
    ctx.print(f"handles: all_reduce(async_op=True) returned at once; sum and .then() mean checked on all {W} ranks")
    ctx.print_ordered(f"is_completed() right after the call: {flags['completed_at_issue']}, after wait(): "
                      f"{flags['completed_after_wait']}")
    results["completed_after_wait"] = flags["completed_after_wait"]

    numel = int(args.mib * 2**20 / 4)
    gen = torch.Generator().manual_seed(args.seed + r)
    base = torch.randn(numel, generator=gen).to(dev)
    mats = [torch.randn(args.n, args.n, generator=gen).to(dev) for _ in range(args.matmuls)]
    a, b = base.clone(), base.clone()
    sequential(a, mats)
    overlapped(b, mats)
    report.expect_equal(f"overlapped == sequential all_reduce on rank {r}", torch.equal(a, b), True)

    buf = base.clone()  # summing the same buffer again and again: only the time matters below
    variants = {"compute": lambda: compute(mats), "communication": lambda: dist.all_reduce(buf),
                "sequential": lambda: sequential(buf, mats), "overlapped": lambda: overlapped(buf, mats)}
    samples: dict[str, list[float]] = {name: [] for name in variants}
    with bench.steady_timing():
        for rep in range(args.repeats + 1):  # round-robin, so that drift in the machine hits every variant alike
            for name, fn in variants.items():
                t = slowest(fn, dev)
                if rep > 0:  # the first round is a warm-up
                    samples[name].append(t)
    times, hidden, verdict = summarize({name: 1e3 * float(np.median(ts)) for name, ts in samples.items()})
    nothing = "no compute to hide behind" if not args.matmuls else "no communication on a single rank" if W == 1 else ""
    if nothing:  # the ratio has no meaning here (no shorter part to hide): None in the JSON, not a made-up 0
        hidden, verdict = None, f"nothing to overlap ({nothing})"
    ctx.print(f"\noverlap: all_reduce of {args.mib:g} MiB with {args.matmuls} matmuls of {args.n}x{args.n}, "
              f"median of {args.repeats}, slowest rank ({bench.load_average()})")
    ctx.print(report.table([{"variant": k, "ms": v} for k, v in times.items()], floatfmt=".1f"))
    shorter = min(times["compute"], times["communication"])
    if hidden is None:
        ctx.print(f"hidden: undefined, {nothing}")
    else:
        ctx.print(f"hidden: ({times['compute']:.1f} + {times['communication']:.1f} - {times['overlapped']:.1f}) / "
                  f"{shorter:.1f} = {hidden:.2f} of the shorter part (compute or communication)")
    ctx.print(f"verdict: {verdict}")
    results.update({f"{k}_ms": v for k, v in times.items()}, hidden=hidden, verdict=verdict,
                   overlap_saving_ms=round(times["compute"] + times["communication"] - times["overlapped"], 1))
    everyone: list = [None] * W
    dist.all_gather_object(everyone, recorded_round(buf, mats, dev))
    results["timeline"] = timeline(everyone)
    results["figure_spans"] = compute_spans(results["timeline"])
    results["figure_text"] = figure_text(results["figure_spans"])
    results["figure_wait"] = wait_reading(results["figure_spans"])
    results["figure_summary"] = figure_summary(results["figure_spans"])
    results["figure_note"] = figure_note(results["figure_spans"], times)
    return results


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"mib": 2.0, "matmuls": 2, "n": 128, "repeats": 2},
                     world_sizes=range(1, 9), world_sizes_text="1..8")
    result = launch(worker, args)
    if result is None:
        return 0
    print(f"OK: async all_reduce sums, .then() means and overlapped results checked on all {args.world_size} ranks")
    print(f"figure: {draw(result['timeline'], args.world_size, args)}")
    print(f"in the figure's round, {result['figure_summary']}")
    print(result["figure_note"])
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
