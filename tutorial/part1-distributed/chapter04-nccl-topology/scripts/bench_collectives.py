"""A collective benchmark in the layout of NVIDIA's nccl-tests: time, algbw and busbw over a sweep of sizes.

What it shows
    One collective (all_reduce by default) timed at message sizes from a few bytes to tens of MiB. Each size is
    checked and warmed up, then all sizes are timed in --rounds rounds (8): every round times every size once, the
    sizes taking turns, so that a burst of load from elsewhere lands on one round of many sizes rather than on one
    size. One timing is a warm-up call and a timed loop of `iters` calls (barrier first, time.perf_counter around
    the loop, the MAX of the elapsed time over ranks: nccl-tests' -a 3; its default, -a 1, averages over ranks).
    The time shown is the BEST round's (nccl-tests shows the mean of one loop): load from other processes only ever
    adds time, so the fastest round is the least disturbed; the JSON keeps every round and the median. The garbage
    collector runs once, then is frozen and switched off for the whole sweep. Columns as in nccl-tests:
      size (B)    bytes of the full buffer (all_reduce/broadcast: the tensor; all_gather: the gathered output;
                  reduce_scatter: the input being scattered; all_to_all: each rank's send buffer)
      count       elements of float32 in that buffer
      iters       timed calls per round
      time (us)   per call, the best round's
      algbw       size / time
      busbw       algbw * factor(collective, world size): the factors published in nccl-tests'
                  doc/PERFORMANCE.md (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md)
    and a closing "# Avg bus bandwidth : X" line. Small messages are latency-bound (on a quiet machine the time is
    about flat; on a loaded one it goes up and down with the noise, whatever the size; busbw tiny), apart from an
    all-reduce over gloo of fewer than 2p float32 values (8 B at 2 ranks): gloo's ring cuts the buffer into at least
    2p segments and skips the empty ones, so it sends fewer messages and can be faster than the sizes above it;
    large ones bandwidth-bound (time grows with size; busbw climbs until the links or the memory are saturated,
    and may fall again once the buffers outgrow the CPU caches; the "# busbw" line says which this run
    shows: no peak at all, when no size of the sweep is bandwidth-bound (the "# fit" test below); still rising; a
    dip that recovers, where a larger size gets back to at least RECOVERY = 1.2 times the lowest busbw after the
    peak (load); or a fall that stays to the end, where none does (a check the sentence states only when some size
    follows the lowest point; a smaller rise, if any, is named with its factor). A fall is called a limit only when
    every round shows it: in each round the largest size's busbw below the peak size's of the same round;
    otherwise the line says it cannot tell load from a limit). A fitted time = t0 + size/B line (t0: a fixed cost
    per call) puts the
    boundary at size = t0 * B (printed in B below 1 KiB, in KiB above), shaded on the figure; it is one
    least-squares line through all the points, each row weighted by 1/time (the relative error (model/time - 1)^2,
    so a fast row counts as much as one a hundred times slower), and the points scatter on both sides of it, so
    its B can be below the peak busbw. The weighting also pulls the line toward the fastest rows: a point above the
    line costs at most 1, one below it without limit. The sweep is called bandwidth-bound beyond the boundary only
    if it really is: the boundary must lie at most half the largest size, at least two sizes must lie above it, the
    time must rise from the first of them to the largest, and the largest size must take at least twice the
    slowest time at or below the boundary (the size term clear of the latency-bound noise); otherwise the line
    fits noise, and the output says the sweep has no bandwidth-bound points. Each size is checked once against a
    closed-form answer
    before it is timed. Over gloo on CPU here; with one GPU per rank, --backend auto picks NCCL and CUDA tensors.

How to run (any world size >= 1; the busbw factors are defined for every number of ranks p)
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/bench_collectives.py
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/bench_collectives.py -w 4 --collective all_gather
    torchrun --nproc-per-node 2 tutorial/part1-distributed/chapter04-nccl-topology/scripts/bench_collectives.py

Contract flags: --smoke sweeps 8 B .. 64 KiB with few iterations; --seed changes nothing (the data are fixed).

Runtime on 2 cores: about 6-20 s (2 ranks, 8 B .. 32 MiB, 8 rounds), the longer under heavy load; --smoke about
4-9 s.

Try next
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/bench_collectives.py --collective all_gather -w 4
        -> the same sweep for all_gather: busbw uses the factor (p-1)/p for p ranks; four ranks on two cores take
           longer than the default two (each waits for a core), and at a load L on C cores up to about L/C times
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/bench_collectives.py --max-bytes 1024
        -> only the latency-bound end: busbw stays tiny, and the "# fit" line says why it gives no bandwidth
           (one it does print, rarely, is noise that a rerun does not repeat)
    torchrun --nproc-per-node 2 tutorial/part1-distributed/chapter04-nccl-topology/scripts/bench_collectives.py
        -> the benchmark started by torchrun, as nccl-tests is on a GPU node
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.bench import algbw, busbw, busbw_factor, load_average, steady_timing, time_collective
from mlsys.launch import RankContext, launch

Collective = typing.Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all"]
ELEMENT_BYTES = 4  # float32


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    collective: Collective = "all_reduce"
    """Which collective to time."""
    min_bytes: int = 8
    """Smallest message size in bytes."""
    max_bytes: int = 32 * 2**20
    """Largest message size in bytes."""
    step_factor: int = 4
    """Each size is this many times the previous one (nccl-tests' -f)."""
    warmup: int = 2
    """Untimed calls per size before the rounds (connection setup, first-touch of memory); each round adds one."""
    max_iters: int = 50
    """Timed calls at the smallest sizes, over all rounds; large sizes get fewer (about bytes_per_size / size, at
    least 3). Each round times iters / rounds of them (at least one)."""
    rounds: int = 8
    """Every size is timed once per round, the sizes taking turns; the time shown is the best round's."""
    bytes_per_size: int = 128 * 2**20
    """Bytes moved per size, which sets the iteration count of large sizes."""

    def validate(self) -> None:
        if self.min_bytes < ELEMENT_BYTES or self.max_bytes < self.min_bytes:
            raise cli.UsageError(f"need {ELEMENT_BYTES} <= --min-bytes <= --max-bytes, got {self.min_bytes}, "
                                 f"{self.max_bytes}")
        if self.step_factor < 2 or self.warmup < 0 or self.max_iters < 1 or self.rounds < 1:
            raise cli.UsageError("need --step-factor >= 2, --warmup >= 0, --max-iters >= 1 and --rounds >= 1")


def sizes(args: Settings) -> list[int]:
    """min_bytes, times step_factor, .. up to max_bytes, which is always included."""
    out, size = [], args.min_bytes
    while size < args.max_bytes:
        out.append(size)
        size *= args.step_factor
    return out + [args.max_bytes]


def iterations(size_bytes: int, args: Settings) -> int:
    """Many calls for tiny messages (each is ~100 us), few for large ones (each is many ms)."""
    return max(3, min(args.max_iters, args.bytes_per_size // size_bytes))


def element_count(collective: str, size_bytes: int, world_size: int) -> int:
    """float32 elements of the full buffer; a multiple of world_size where the buffer is split into n pieces."""
    count = max(1, size_bytes // ELEMENT_BYTES)
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        count = max(world_size, count // world_size * world_size)
    return count


def make_call(collective: str, count: int, ctx: RankContext) -> tuple[typing.Callable[[], None], typing.Callable]:
    """Buffers for one size, a zero-argument call that runs the collective once, and a check of its result.

    Inputs hold rank + 1 everywhere, so every answer has a closed form: a sum is n(n+1)/2, a gathered piece from
    rank r is r + 1, a broadcast from rank 0 is 1.
    """
    n, r, dev = ctx.world_size, ctx.rank, ctx.device
    piece = count // n  # elements per rank where the buffer is split (all_gather, reduce_scatter, all_to_all)
    total = float(n * (n + 1) // 2)
    if collective == "all_reduce" or collective == "reduce":
        buf = torch.full((count,), r + 1.0, device=dev)  # [count]
        call = (lambda: dist.all_reduce(buf)) if collective == "all_reduce" else (lambda: dist.reduce(buf, dst=0))
        if collective == "reduce" and r != 0:  # only the root's result is defined; others may hold partial sums
            return call, lambda: (buf.cpu(), buf.cpu())
        return call, lambda: (buf, torch.full((count,), total))
    if collective == "broadcast":
        buf = torch.full((count,), r + 1.0, device=dev)
        return (lambda: dist.broadcast(buf, src=0)), lambda: (buf, torch.ones(count))
    if collective == "all_gather":
        src, out = torch.full((piece,), r + 1.0, device=dev), torch.empty(count, device=dev)  # [count/n] -> [count]
        want = torch.arange(1.0, n + 1).repeat_interleave(piece)
        return (lambda: dist.all_gather_single(out, src)), lambda: (out, want)
    if collective == "reduce_scatter":
        src, out = torch.full((count,), r + 1.0, device=dev), torch.empty(piece, device=dev)  # [count] -> [count/n]
        return (lambda: dist.reduce_scatter_single(out, src)), lambda: (out, torch.full((piece,), total))
    # all_to_all: rank r sends piece j to rank j and receives piece r of every rank: out[j-th piece] = j + 1
    src, out = torch.full((count,), r + 1.0, device=dev), torch.empty(count, device=dev)
    want = torch.arange(1.0, n + 1).repeat_interleave(piece)
    return (lambda: dist.all_to_all_single(out, src)), lambda: (out, want)


# --8<-- [start:rounds]
def worker(ctx: RankContext, args: Settings) -> dict:
    """Every size checked once, warmed up, then timed in rounds: each round times every size once, smallest to
    largest, so a burst of load from elsewhere lands on one round of many sizes instead of on all the calls of one
    size. A size's time is its best round: load from elsewhere only ever adds time, so the fastest round is the
    one least disturbed (the median is kept beside it, for the spread)."""
    calls, counts = [], []
    for size in sizes(args):
        count = element_count(args.collective, size, ctx.world_size)
        if count in counts:  # two requested sizes round to the same buffer (e.g. 8 B and 32 B at 5 ranks)
            continue
        counts.append(count)
        call, result = make_call(args.collective, count, ctx)
        call()  # one checked call before timing: a fast wrong answer is worth nothing
        got, want = result()
        report.expect_equal(f"rank {ctx.rank} {args.collective} of {count} elements", got.cpu(), want)
        for _ in range(args.warmup):  # connection setup, first touch of the buffers
            call()
        calls.append((call, count, math.ceil(iterations(size, args) / args.rounds)))
    per_round: list[list[float]] = [[] for _ in calls]
    with steady_timing():  # one garbage collection, then none, for the whole sweep
        for _ in range(args.rounds):
            for times, (call, _, iters) in zip(per_round, calls):  # one warm-up call: the previous size left the
                times.append(time_collective(call, 1, iters, ctx.device))  # caches full of other buffers
    rows = []
    for times, (_, count, iters) in zip(per_round, calls):
        seconds, nbytes = min(times), count * ELEMENT_BYTES
        rows.append({"size (B)": nbytes, "count": count, "type": "float", "iters": iters,
                     "time (us)": seconds * 1e6, "algbw (GB/s)": algbw(nbytes, seconds),
                     "busbw (GB/s)": busbw(args.collective, nbytes, seconds, ctx.world_size)})
    return {"rows": rows, "round_times_us": [[t * 1e6 for t in times] for times in per_round],
            "median_time_us": [float(np.median(times)) * 1e6 for times in per_round]}
# --8<-- [end:rounds]


def fit_latency_bandwidth(size_bytes: np.ndarray, time_s: np.ndarray) -> tuple[float, float]:
    """Least squares of time = t0 + size / B, weighted by 1/time so the microsecond points count as much as
    the millisecond ones. Returns (t0, the fixed cost per call in s, B in bytes/s); the two terms are equal at
    size = t0 * B.
    B is infinite when the sweep never left the latency-bound regime (no measurable growth with size)."""
    design = np.stack([np.ones_like(size_bytes), size_bytes], axis=1) / time_s[:, None]  # [sizes, 2]
    (t0, inv_bandwidth), *_ = np.linalg.lstsq(design, np.ones_like(time_s), rcond=None)
    return max(float(t0), 1e-9), (1.0 / float(inv_bandwidth) if inv_bandwidth > 0 else math.inf)


def bandwidth_bound_points(size_bytes: np.ndarray, time_s: np.ndarray, t0: float, bandwidth: float) -> bool:
    """Whether the sweep reaches the bandwidth-bound regime. Four tests, all needed: the fitted boundary t0 * B
    lies at most half the largest size; at least two measured sizes lie above it; the time rises from the first of
    them to the largest (overall: a loaded row in between may dip); and
    the largest size took at least twice the SLOWEST time at or below the boundary (not merely twice the fastest:
    on a loaded box the latency-bound times alone can spread 4x). A fit through a latency-bound sweep can put the
    boundary inside it with a tiny, noise-made bandwidth (a reader's --max-bytes 1024 run: 435 B, 0.002 GB/s);
    this says no to it."""
    knee = t0 * bandwidth
    if not (math.isfinite(knee) and size_bytes.min() <= knee <= size_bytes.max() / 2):
        return False
    above, at_or_below = split_at(size_bytes, time_s, knee)
    rising = bool(above.size >= 2 and above[-1] > above[0])  # overall: one loaded row may dip between them
    return bool(rising and above[-1] >= 2 * at_or_below.max())


def split_at(size: np.ndarray, times: np.ndarray, knee: float) -> tuple[np.ndarray, np.ndarray]:
    """(times of the sizes above the boundary, times of those at or below it), each in order of size."""
    order = np.argsort(size)
    return times[order][size[order] > knee], times[order][size[order] <= knee]


def boundary_text(num_bytes: float) -> str:
    """The boundary t0 * B, whole bytes below 1 KiB (a 435 B boundary is not "0 KiB"), whole KiB above."""
    return f"{num_bytes:.0f} B" if num_bytes < 1024 else f"{num_bytes / 1024:.0f} KiB"


def size_text(num_bytes: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:g} {unit}"
    return f"{num_bytes:g} B"


def few_value_rows(rows: list[dict], below: int) -> list[dict]:
    """The rows whose buffer holds fewer float32 values than `below`: for gloo's all-reduce, 2p, the fewest
    segments its ring cuts a buffer into (gloo/allreduce.cc), so some segments are empty and their messages are
    skipped (at 2 ranks, 8 B: two values, four segments, half the ring's messages). 0 for any other case."""
    return [r for r in rows if r.get("count", r["size (B)"] // ELEMENT_BYTES) < below]


def reading(rows: list[dict], few_values_below: int = 0, round_times_us: list[list[float]] | None = None,
            bandwidth_bound: bool = True) -> dict:
    """The numbers the lesson's reading of the table quotes, whatever the run: how much the time changed over the
    small sizes (up to 8 KiB, apart from the rows too small to fill gloo's ring, which take fewer messages), how
    those rows compare with the others, how the time grew from the second-largest size to the largest, where
    busbw peaked."""
    few = few_value_rows(rows, few_values_below)
    small = [r for r in rows if r["size (B)"] <= 8 * 2**10 and r not in few]
    small_t = [r["time (us)"] for r in small]
    last, before = rows[-1], rows[-2] if len(rows) > 1 else rows[-1]
    peak = max(rows, key=lambda r: r["busbw (GB/s)"])
    small_text = f"{size_text(small[0]['size (B)'])} to {size_text(small[-1]['size (B)'])}" if small else "none"
    return {"small_sizes_text": small_text,
            "small_size_growth": small[-1]["size (B)"] / small[0]["size (B)"] if small else 1,
            "small_time_ratio": max(small_t) / min(small_t) if small else 1.0,
            "few_values_text": few_values_text(few, small_t, small_text),
            "last_step_size_ratio": last["size (B)"] / before["size (B)"],
            "last_step_time_ratio": last["time (us)"] / before["time (us)"],
            "peak_busbw_GBps": peak["busbw (GB/s)"], "peak_busbw_size_text": size_text(peak["size (B)"]),
            "largest_busbw_GBps": last["busbw (GB/s)"], "largest_size_text": size_text(last["size (B)"]),
            "busbw_trend_text": busbw_trend_text(rows, round_times_us, bandwidth_bound),
            "busbw_summary_text": busbw_summary_text(rows, round_times_us, bandwidth_bound),
            "busbw_pattern": busbw_pattern(rows, round_times_us, bandwidth_bound)[0],
            "busbw_verdict": busbw_verdict(rows, round_times_us, bandwidth_bound), "busbw_recovery_factor": RECOVERY}


def few_values_text(few: list[dict], small_t: list[float], small_text: str) -> str:
    """The too-small rows against the median of the other small rows, the direction computed from the run."""
    if not few:
        return "no row of this sweep is smaller than gloo's ring has segments"
    if not small_t:
        return f"{' and '.join(size_text(r['size (B)']) for r in few)}: no larger small size to compare with"
    ratio = max(r["time (us)"] for r in few) / float(np.median(small_t))
    label = (f"the {size_text(few[0]['size (B)'])} row" if len(few) == 1 else
             f"the slowest of the {' and '.join(size_text(r['size (B)']) for r in few)} rows")
    way = "faster" if ratio < 1 else "no faster"
    return f"{label} took {ratio:.2f}x the median time of the rows from {small_text}, {way}"


def busbw_trend_text(rows: list[dict], round_times_us: list[list[float]] | None = None,
                     bandwidth_bound: bool = True) -> str:
    """What the busbw column shows, in words computed from the run (busbw_pattern's sentence)."""
    return busbw_pattern(rows, round_times_us, bandwidth_bound)[1]


def busbw_line(rows: list[dict], round_times_us: list[list[float]] | None = None,
               bandwidth_bound: bool = True) -> str:
    """The '# busbw' line: busbw_trend_text, which says itself what its pattern can and cannot tell."""
    return f"# busbw {busbw_trend_text(rows, round_times_us, bandwidth_bound)}"


RECOVERY = 1.2  # a later size at least this many times the lowest busbw after the peak: the dip recovered


def round_busbw(row: dict, times_us: list[float]) -> list[float]:
    """The row's busbw in each round: busbw is bytes over time, so it scales as the best time over the round's."""
    return [row["busbw (GB/s)"] * row["time (us)"] / t for t in times_us]


def fall_evidence(rows: list[dict], round_times_us: list[list[float]] | None, top: int) -> tuple[str, str]:
    """(verdict, words) for a fall that stays to the end, read off every round, not only the best: "limit" when in
    each of at least two rounds the largest size's busbw was below the peak size's busbw of the SAME round (the
    sizes take turns, so the two were timed in the same pass); otherwise "cannot tell", naming the first round that
    does not show the fall. A single slow round of the largest size (one call per round there) cannot make a
    limit: the best round of each size decides the table, and every round must agree."""
    last = len(rows) - 1
    if not round_times_us or len(round_times_us[last]) < 2:
        return "cannot tell", ("; with fewer than two rounds there is no second look at it, so this run cannot tell "
                               "load from a limit (rerun with --rounds 2 or more)")
    peak_bw, last_bw = round_busbw(rows[top], round_times_us[top]), round_busbw(rows[last], round_times_us[last])
    rounds = len(peak_bw)
    peak_size, last_size = size_text(rows[top]["size (B)"]), size_text(rows[last]["size (B)"])
    against = next((k for k in range(rounds) if last_bw[k] >= peak_bw[k]), None)
    if against is None:
        return "limit", (f"; it shows in every one of the {rounds} rounds (in each, {last_size} had a lower busbw "
                         f"than {peak_size} in the same round): the pattern of a limit, such as the caches")
    return "cannot tell", (
        f"; but not in every round: in round {against + 1} of {rounds} the fall did not happen ({last_size}'s "
        f"busbw {last_bw[against]:.3f} GB/s, {peak_size}'s {peak_bw[against]:.3f} GB/s), so this run "
        "cannot tell load from a limit (rerun: a limit shows in every round, load moves)")


def busbw_pattern(rows: list[dict], round_times_us: list[list[float]] | None = None,
                  bandwidth_bound: bool = True) -> tuple[str, str]:
    """(pattern, sentence): pattern is "none" (busbw 0 at every size: one rank), "one size", "latency-bound" (the
    sweep has no bandwidth-bound size, bandwidth_bound_points: no peak to read), "rising" (the peak is the last
    row), "dip that recovers" (after the peak, a larger size reached at least RECOVERY times the lowest point after
    the peak: the pattern of load), or "fall that stays" (none did). A fall is called a limit only when every round
    shows it (fall_evidence); otherwise the sentence says the run cannot tell load from a limit. When the lowest
    point is the largest size, as when only one size follows the peak, there is nothing after it to check and the
    sentence leaves that check out. A smaller rise after the lowest point is named with its factor."""
    bw = [r["busbw (GB/s)"] for r in rows]
    if max(bw) <= 0:  # one rank: the busbw factor is 0, and no byte crosses a link
        return "none", ("is 0 at every size: the busbw factor is 0 here (with one rank no byte crosses a link), so "
                        "this sweep says nothing about links")
    if len(rows) < 2:
        return "one size", f"was measured at one size only ({bw[0]:.2f} GB/s), so it has no trend to read"
    if not bandwidth_bound:
        return "latency-bound", ("stays in the latency-bound regime: the whole sweep is latency-bound (the '# fit' "
                                 "line says why), so busbw has no peak to read; larger sizes (--max-bytes) reach "
                                 "the bandwidth-bound regime")
    top = int(np.argmax(bw))
    last = rows[-1]
    if top == len(rows) - 1:
        return "rising", (f"was still rising at the largest size: it peaked there, at {bw[-1]:.2f} GB/s at "
                          f"{size_text(last['size (B)'])}, so this sweep does not show where it stops (larger "
                          "sizes, --max-bytes, would)")
    low = top + 1 + int(np.argmin(bw[top + 1:]))  # the lowest point after the peak
    later = bw[low + 1:]
    peak_text = f"peaked at {bw[top]:.2f} GB/s at {size_text(rows[top]['size (B)'])}"
    best = low + 1 + int(np.argmax(later)) if later else low  # the highest point after the lowest one
    rise = bw[best] / bw[low] if bw[low] > 0 else math.inf
    if rise >= RECOVERY:
        return "dip that recovers", (
            f"{peak_text}, dipped to {bw[low]:.2f} GB/s at {size_text(rows[low]['size (B)'])} and rose again to "
            f"{bw[best]:.2f} GB/s at {size_text(rows[best]['size (B)'])}, {rise:.2f}x the low point (at least "
            f"{RECOVERY:g}x): a dip that recovers, not a fall that stays to the end (the pattern of load: rerun "
            "and it moves or goes)")
    drop = 1 - bw[-1] / bw[top]
    partial = (f"; after its low point, {bw[low]:.2f} GB/s at {size_text(rows[low]['size (B)'])}, the best later "
               f"size ({size_text(rows[best]['size (B)'])}) reached only {rise:.2f}x it, under the {RECOVERY:g}x "
               "that counts as a recovery" if best != low else "")
    # the parenthesis checks the sizes after the lowest point; when the lowest point is the largest size (as
    # when only one size follows the peak) there are none, so it would state a test that tested nothing
    check = (f" (no larger size rose {RECOVERY:g}x above the lowest point after the peak)" if later else "")
    return "fall that stays", (
        f"{peak_text} and ended {drop:.1%} lower, at {bw[-1]:.2f} GB/s at the largest size, "
        f"{size_text(last['size (B)'])}{partial}: a fall that stays to the end{check}, not a dip that recovers"
        f"{fall_evidence(rows, round_times_us, top)[1]}")


def busbw_verdict(rows: list[dict], round_times_us: list[list[float]] | None = None,
                  bandwidth_bound: bool = True) -> str:
    """What the busbw pattern points to: "load" (a dip that recovers), "limit" or "cannot tell" (a fall that stays,
    by fall_evidence), "" for the other patterns."""
    pattern = busbw_pattern(rows, round_times_us, bandwidth_bound)[0]
    if pattern == "dip that recovers":
        return "load"
    return fall_evidence(rows, round_times_us, int(np.argmax([r["busbw (GB/s)"] for r in rows])))[0] if (
        pattern == "fall that stays") else ""


def busbw_summary_text(rows: list[dict], round_times_us: list[list[float]] | None = None,
                       bandwidth_bound: bool = True) -> str:
    """The '# busbw' line's conclusion in a few words, for the lesson: where busbw peaked and what the pattern
    points to (busbw_pattern, busbw_verdict); the line itself gives the numbers and the rule."""
    pattern = busbw_pattern(rows, round_times_us, bandwidth_bound)[0]
    peak = size_text(max(rows, key=lambda r: r["busbw (GB/s)"])["size (B)"])
    if pattern != "fall that stays":
        return {"none": "is 0 at every size (one rank: no byte crosses a link)",
                "one size": "was measured at one size only", "latency-bound": "has no peak: the sweep is latency-bound",
                "rising": f"was still rising at the largest size, {peak}",
                "dip that recovers": f"peaked at {peak}, dipped and recovered: load, which moves when you rerun",
                }[pattern]
    if busbw_verdict(rows, round_times_us, bandwidth_bound) == "limit":
        return f"peaked at {peak} and stayed lower to the end in every round: the pattern of a limit"
    return f"peaked at {peak} and stayed lower to the end, but not in every round, so this could be load: rerun"


def above_text(size: np.ndarray, times: np.ndarray, knee: float) -> str:
    """The sizes above the boundary and whether their times rise, for the '# fit' line's reasons."""
    above, _ = split_at(size, times, knee)
    if above.size < 2:
        return f"{above.size} size(s) above it here"
    way = "rising" if above[-1] > above[0] else "not rising"
    return f"{above.size} here, {way}"


def slowest_ratio(size: np.ndarray, times: np.ndarray, knee: float) -> float:
    """The largest size's time over the slowest time at sizes at or below the boundary."""
    return float(times[np.argmax(size)] / split_at(size, times, knee)[1].max())


def fit_line(size: np.ndarray, times: np.ndarray, t0: float, bandwidth: float) -> str:
    """The '# fit' line. A bandwidth is printed only when the sweep has bandwidth-bound points: in a latency-bound
    sweep the fitted size term is smaller than the noise, and its slope (size / some GB/s) is no bandwidth."""
    knee = t0 * bandwidth  # where the fixed cost and the size term are equal
    if len(np.unique(size)) < 2:
        return "# no fit: a line needs at least two sizes (see --min-bytes and --max-bytes)"
    if not math.isfinite(bandwidth):
        return f"# fit: time = {t0 * 1e6:.1f} us, flat: the whole sweep is latency-bound"
    if t0 <= 1e-9 or knee < size.min():  # no fixed cost left: the size term only fits noise
        return ("# no fit shown: the fitted fixed cost is not positive, so the line says nothing about where the "
                "regimes meet; the time does not grow clearly with size here (a latency-bound sweep, noisy when "
                "the machine is loaded)")
    if knee > size.max():
        return (f"# fit: time = {t0 * 1e6:.1f} us per call, the whole sweep latency-bound: the fitted size term "
                f"would equal that only at about {knee:,.0f} B, beyond the largest size, so within the sweep it is "
                "smaller than the noise and its slope gives no bandwidth")
    if not bandwidth_bound_points(size, times, t0, bandwidth):
        return (f"# fit: no bandwidth-bound points in this sweep: all latency-bound. The fitted line (fixed cost "
                f"{t0 * 1e6:.1f} us, terms equal at {knee:,.0f} B) is not trusted: a sweep with bandwidth-bound "
                f"points has that size at most half its largest ({size.max() / 2:,.0f} B here), at least two sizes "
                f"above it, the time rising from the first to the largest ({above_text(size, times, knee)}), and "
                f"its largest size takes "
                f"at least 2x the slowest time at or below it ({slowest_ratio(size, times, knee):.1f}x here)")
    return (f"# fit: time = {t0 * 1e6:.1f} us + size / {bandwidth / 1e9:.3f} GB/s -> latency-bound below about "
            f"{boundary_text(knee)}, bandwidth-bound above")


def drawn_fit_us(size: np.ndarray, t0: float, bandwidth: float, has_bandwidth_bound: bool) -> np.ndarray:
    """The fitted line as drawn (us): t0 + size / B, or the flat t0 where the sweep is latency-bound, since
    there the slope is noise and the legend says so."""
    return 1e6 * (t0 + (size / bandwidth if has_bandwidth_bound else 0 * size))


def draw(rows: list[dict], t0: float, bandwidth: float, args: Settings, world_size: int,
         has_bandwidth_bound: bool = True) -> None:
    plt = plot.pyplot()
    size = np.array([r["size (B)"] for r in rows], dtype=float)
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    ax_t.loglog(size, [r["time (us)"] for r in rows], "o-", label="measured")
    label = (f"fit: {t0 * 1e6:.1f} us + size / {bandwidth / 1e9:.3f} GB/s" if has_bandwidth_bound else
             f"fit: {t0 * 1e6:.1f} us, drawn flat (latency-bound: its fitted slope is noise, no bandwidth)")
    if size.min() < size.max():  # one size: no line to fit
        ax_t.loglog(size, drawn_fit_us(size, t0, bandwidth, has_bandwidth_bound), "--", label=label)
    ax_b.loglog(size, [r["busbw (GB/s)"] for r in rows], "o-", color="C2")
    knee = t0 * bandwidth if has_bandwidth_bound else math.inf  # latency term == bandwidth term
    for ax in (ax_t, ax_b):  # each regime named once, in the right panel's legend, and only where it is shaded
        named = ax is ax_b
        if size.min() < size.max():  # one size has no regimes to shade
            if knee > size.min():
                ax.axvspan(size.min(), min(knee, size.max()), color="C1", alpha=0.12,
                           label="latency-bound" if named else None)
            if knee < size.max():
                ax.axvspan(max(knee, size.min()), size.max(), color="C0", alpha=0.08,
                           label="bandwidth-bound" if named else None)
        else:
            ax.set_xlim(size.min() / 2, size.max() * 2)
        ax.set_xlabel("message size (bytes)")
    ax_t.set_ylabel("time per call (us)")
    ax_b.set_ylabel("busbw (GB/s)")
    for ax in (ax_t, ax_b):  # under the axes, where no legend can hide a point or a tick label
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
    fig.suptitle(f"{args.collective}, {world_size} ranks, {args.backend}")
    print(f"figure: {plot.save(fig, args, f'{args.collective}_sweep')}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"max_bytes": 64 * 2**10, "max_iters": 6, "warmup": 1,
                                                                   "rounds": 3},
                     world_sizes=lambda w: w >= 1, world_sizes_text=">= 1")
    result = launch(worker, args)
    if result is None:
        return 0
    rows = result["rows"]
    print(f"# {args.collective}, {args.world_size} ranks, backend {args.backend}, float32, "
          f"busbw factor {busbw_factor(args.collective, args.world_size):.3f}, {load_average()}")
    print(f"# time: the best of {args.rounds} round(s) of the slowest rank's time per call; each round times "
          f"every size once ('iters' calls after one warm-up call), the sizes taking turns")
    print(report.table(rows, floatfmt=".3f"))
    avg = float(np.mean([r["busbw (GB/s)"] for r in rows]))
    print(f"# Avg bus bandwidth : {avg:.4f}")  # nccl-tests' closing line: the mean busbw over all sizes
    size = np.array([r["size (B)"] for r in rows], dtype=float)
    times = np.array([r["time (us)"] for r in rows]) * 1e-6
    t0, bandwidth = fit_latency_bandwidth(size, times)
    bound = bandwidth_bound_points(size, times, t0, bandwidth)  # does the sweep reach the bandwidth-bound regime
    print(busbw_line(rows, result["round_times_us"], bound))
    few_values_below = 2 * args.world_size if args.collective == "all_reduce" and args.backend == "gloo" else 0
    print(fit_line(size, times, t0, bandwidth))
    draw(rows, t0, bandwidth, args, args.world_size, bound)
    if args.json:
        report.write_json(args.json, {"collective": args.collective, "world_size": args.world_size,
                                      "backend": args.backend, "rows": rows, "avg_busbw_gbps": avg,
                                      "rounds": args.rounds, "round_times_us": result["round_times_us"],
                                      "median_time_us": result["median_time_us"],
                                      **reading(rows, few_values_below, result["round_times_us"], bound),
                                      "fit_t0_s": t0,
                                      "fit_bandwidth_Bps": bandwidth if math.isfinite(bandwidth) else None}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
