"""DDP written by hand in three steps, checked against one process on the global batch and against torch's DDP.

What it shows
    1. How BucketedDDP cuts the tiny GPT's gradients into flat buckets (reverse parameter order, --bucket-mb each).
    2. Trains the same model for --steps steps with each version of mlsys.ddp (naive: one all-reduce per parameter;
       bucketed: one per bucket after backward; overlapped: launched from gradient hooks during backward) and with
       torch.nn.parallel.DistributedDataParallel, every rank on its own seeded shard. Every rank also trains a
       single-process copy on the GLOBAL batch (all ranks' batches concatenated). The table gives, per version,
       the all-reduce calls and bytes per step and the largest parameter difference from both references.
    3. Gradient accumulation: --accum micro-batches per step, communicating only on the last one (no_sync()).
    4. One more overlapped step runs under torch.profiler (unless --no-profile), after a barrier that lines the
       ranks up: rank 0 writes it as a Chrome trace (ddp_overlap.trace.json, open it in https://ui.perfetto.dev) and
       draws it as ddp_overlap.png: the backward of each block on one row, the hooks' launch calls as pink boxes on
       it, and each bucket's all-reduce on the rows of gloo's worker threads. A launch call is the whole Python call
       a hook makes to dist.all_reduce, timed by the script's clock (perf_counter) and placed on the trace's axis;
       the trace's own c10d::allreduce_ event is only torch's C++ op inside it, and the call can last far longer
       (on 2 shared cores its thread sleeps or waits for a core in it). A table gives when each launch call began
       and returned, as a share of the backward. The line starting "step" splits the backward into the launch
       calls and the rest, the compute, and gives the share of all-reduce time that ran during that compute; the
       next lines split the wait at the end of the step and the launch calls' time (on a core, waiting for a core,
       asleep), and name the largest measured part of what kept the all-reduces from running beside the compute
       (waiting for another rank to launch the same bucket, from every rank's launch times gathered to rank 0;
       waiting for a core inside the launch calls; or the rest of those calls).
    4a. Before the profiled step (and only with it), a model of the ideal overlap, not a measurement, drawn as
       ideal_overlap_vs_bucketed_model.png: the tiny GPT's real bucket plan (mlsys.ddp.assign_buckets on its
       parameters in reverse registration order, at --bucket-mb), each tensor's backward lasting in proportion to
       its elements, each bucket's all-reduce in proportion to its bytes at an assumed bandwidth (all the
       gradients in 0.6 of a backward), one at a time; bucketed (all after the backward) above overlapped (each
       starting once its bucket is ready and the previous one is done).
    5. The all-reduce volume of one step from mlsys.collectives.comm_volume: 2(W-1)/W x gradient bytes per rank.

How to run (any world size from 1 to 8)
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/ddp_from_scratch.py -w 2
    torchrun --nproc-per-node 2 tutorial/part2-parallelism/chapter05-data-parallel/scripts/ddp_from_scratch.py
    ... --bucket-mb 0.01 --steps 10       # more, smaller buckets; more steps
    ... --no-profile                       # only the tables, bytes and self-check: no profiled step, no figures
    ... --no-tables                        # only the ideal-overlap model and the profiled step (no training runs)

The self-check fails (exit 1) if any version's parameters differ from the global-batch reference by more than
--atol, or from torch's DDP by more than --atol. Runtime on 2 cores: about 6 s at -w 2 on idle cores, two to five
times that on a busy machine (14 s at a load average of 6.5), 5 s with --smoke.

Try next
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/ddp_from_scratch.py -w 3
        -> with three ranks the summation order matters: "vs torch DDP" becomes rounding (about 1e-7), not 0
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/ddp_from_scratch.py --bucket-mb 1
        -> one bucket holds everything: one all-reduce per step, launched only when the last gradient is ready,
           at the very end of the backward: in the ideal-overlap figure both schedules end at the same time, and
           the profiled line's share of all-reduce time that ran while the backward computed counts only the
           little work autograd still did after that launch
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/ddp_from_scratch.py -w 3 --atol 1e-9
        -> demand near bit equality at three ranks: the self-check fails (exit 1); that is why it has a tolerance
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from _ddp_draw import ALL_REDUCE, LAUNCH, draw_ideal, draw_overlap, minus  # noqa: F401  LAUNCH: the tests' legend

from mlsys import cli, plot, report
from mlsys.collectives import comm_volume
from mlsys.data import load_splits
from mlsys.ddp import MB, BucketedDDP, OverlappedDDP, assign_buckets, rank_batches, wrap
from mlsys.launch import RankContext, launch
from mlsys.model import GPT, GPTConfig, num_params

KINDS = ("naive", "bucketed", "overlapped", "torch")


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    preset: str = "tiny"
    """Model preset from mlsys.model (tiny: 29k parameters, small: 832k)."""
    steps: int = 5
    """Optimizer steps each version trains for."""
    batch_size: int = 4
    """Sequences per rank per micro-batch (the global batch is W times this)."""
    bucket_mb: float = 0.03
    """Bucket size in MiB for the bucketed and overlapped versions and torch's bucket_cap_mb."""
    accum: int = 2
    """Micro-batches per step in the gradient-accumulation run (communicate on the last one only)."""
    lr: float = 0.5
    """SGD learning rate (momentum 0.9). SGD keeps the comparison tight; see the lesson for Adam."""
    atol: float = 1e-5
    """Largest allowed parameter difference from the references."""
    num_records: int = 2000
    """Records of the synthetic corpus to generate (the token stream the ranks shard)."""
    profile: bool = True
    """Profile one more overlapped step (trace, figure, launch table and timings); --no-profile prints only the
    bucket and comparison tables, the bytes per step and the self-check."""
    tables: bool = True
    """Train and compare the versions (bucket and comparison tables, bytes per step); --no-tables skips them and
    prints only the ideal-overlap model and the profiled step (the lesson shows the tables once, from --no-profile)."""

    def validate(self) -> None:
        from mlsys.model import PRESETS

        if self.preset not in PRESETS:
            raise cli.UsageError(f"--preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        for name in ("steps", "batch_size", "accum", "num_records"):
            if getattr(self, name) < 1:
                raise cli.UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not (self.tables or self.profile):
            raise cli.UsageError("--no-tables with --no-profile leaves nothing to run: drop one of them")
        if self.bucket_mb <= 0 or self.lr <= 0 or self.atol <= 0:
            raise cli.UsageError("--bucket-mb, --lr and --atol must be positive")
        block = PRESETS[self.preset]["block_size"]
        per_rank = len(load_splits(self.num_records, self.seed)[0]) // self.world_size
        if per_rank < block + 1:  # each rank draws windows of block + 1 tokens from its own shard
            raise cli.UsageError(f"--num-records {self.num_records} gives each of {self.world_size} ranks "
                                 f"{per_rank} tokens, fewer than one window of {block + 1}: use more records")


def fresh_model(args: Settings, rank: int) -> GPT:
    """Every rank starts from a DIFFERENT init: the wrapper's broadcast of rank 0's weights must fix that."""
    torch.manual_seed(args.seed + 1000 * rank)
    return GPT(GPTConfig.preset(args.preset))


def sgd(model: torch.nn.Module, args: Settings) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


def reference_params(args: Settings, tokens: torch.Tensor, world_size: int, accum: int) -> list[torch.Tensor]:
    """One process, no communication: train on the concatenation of every rank's micro-batches."""
    model = fresh_model(args, rank=0)  # the weights rank 0 broadcasts
    opt = sgd(model, args)
    T = model.config.block_size
    per_rank = [rank_batches(tokens, r, world_size, args.batch_size, T, args.seed, args.steps * accum)
                for r in range(world_size)]
    for step in range(args.steps):
        micro = [per_rank[r][step * accum + m] for r in range(world_size) for m in range(accum)]
        x = torch.cat([xy[0] for xy in micro])  # (W * accum * B, T): the global batch
        y = torch.cat([xy[1] for xy in micro])
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()  # mean loss over every token of the global batch
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def train_data_parallel(ctx: RankContext, args: Settings, tokens: torch.Tensor, kind: str, accum: int) -> dict:
    """--steps optimizer steps with one DDP version; this rank sees only its own micro-batches."""
    model = fresh_model(args, ctx.rank)
    ddp = wrap(kind, model, args.bucket_mb)  # broadcasts rank 0's parameters
    opt = sgd(model, args)
    batches = rank_batches(tokens, ctx.rank, ctx.world_size, args.batch_size, model.config.block_size,
                           args.seed, args.steps * accum)
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        for m in range(accum):
            x, y = batches[step * accum + m]  # (B, T) each
            last = m == accum - 1
            with contextlib.nullcontext() if last or kind in ("naive", "bucketed") else ddp.no_sync():
                _, loss = ddp(x, y)
                (loss / accum).backward()  # 1/accum: the step's gradient is the mean over its micro-batches
        ddp.finish_gradient_synchronization()  # hand-written: wait (or run) the all-reduces; torch: no-op
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "ddp": ddp}


def _run_queue_ns() -> int | None:
    """Nanoseconds this thread has spent runnable but waiting for a core (Linux schedstat), None elsewhere."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None


@contextlib.contextmanager
def clocked_launches(ddp: OverlappedDDP, clock: list[dict] | None):
    """Time each all-reduce launch of `ddp` from the calling thread: wall clock, the thread's CPU time, and how
    long it was runnable but waiting for a core. Appends one dict per launch to `clock` (nothing if None)."""
    if clock is None:
        yield
        return
    launch_one = ddp._all_reduce

    def clocked(tensor, async_op=False):
        w0, c0, q0 = time.perf_counter(), time.thread_time(), _run_queue_ns()  # the wall clock outermost:
        handle = launch_one(tensor, async_op=async_op)                        # CPU and queue time fall inside it
        q1, c1, w1 = _run_queue_ns(), time.thread_time(), time.perf_counter()
        clock.append({"began_s": w0, "wall_ms": 1e3 * (w1 - w0), "cpu_ms": 1e3 * (c1 - c0),
                      "run_queue_ms": None if q0 is None or q1 is None else (q1 - q0) / 1e6})
        return handle
    ddp._all_reduce = clocked
    try:
        yield
    finally:
        del ddp._all_reduce  # back to the class's method


# --8<-- [start:profile]
@contextlib.contextmanager
def labelled_block_backward(model: GPT):
    """Name each block's backward in the profile: a record_function opened when autograd reaches the block's
    output gradient and closed when its input gradient is done (module backward hooks; removed on exit)."""
    open_ranges, handles = {}, []
    for i, block in enumerate(model.h):
        def pre(module, grad_output, i=i):
            open_ranges[i] = torch.profiler.record_function(f"backward block {i}")
            open_ranges[i].__enter__()

        def post(module, grad_input, grad_output, i=i):
            open_ranges.pop(i).__exit__(None, None, None)
        handles += [block.register_full_backward_pre_hook(pre), block.register_full_backward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def profile_overlap(ctx: RankContext, args: Settings, tokens: torch.Tensor, trace_path,
                    clock: list[dict] | None = None) -> list[list[str]]:
    """One OverlappedDDP step under torch.profiler (after one unprofiled warm-up step, and a barrier once every
    rank's profiler has started), on every rank; rank 0 writes the Chrome trace. Returns the parameter names of
    each bucket, in launch order; `clock` receives the profiled step's launch timings (clocked_launches)."""
    model = fresh_model(args, ctx.rank)
    ddp = OverlappedDDP(model, args.bucket_mb)
    x, y = rank_batches(tokens, ctx.rank, ctx.world_size, args.batch_size, model.config.block_size, args.seed, 1)[0]
    ddp(x, y)[1].backward()  # warm-up: the first backward allocates what later ones reuse
    ddp.finish_gradient_synchronization()
    model.zero_grad(set_to_none=True)
    with labelled_block_backward(model), clocked_launches(ddp, clock), plot.quiet_stderr(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        if ctx.world_size > 1:  # line the ranks up once every profiler is running: a profiler is slow to start,
            dist.barrier()      # and a rank starting late would leave the others' all-reduces waiting for it
        with torch.profiler.record_function("forward"):
            _, loss = ddp(x, y)
        with torch.profiler.record_function("backward"):
            loss.backward()  # the hooks launch each bucket's all-reduce from in here
        with torch.profiler.record_function("wait for all-reduces"):
            ddp.finish_gradient_synchronization()
    if ctx.is_main:
        prof.export_chrome_trace(str(trace_path))
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in bucket] for bucket in ddp.buckets]
# --8<-- [end:profile]


# ---- the ideal overlap: a model of the schedule, drawn from the run's real bucket plan ------------------------
COMM_SHARE = 0.6
"""The assumed bandwidth of the ideal timeline: all-reducing ALL the gradients takes 0.6 of the backward's time."""


def ideal_schedule(numels: list[int], element_size: int, bucket_bytes: int, comm_share: float = COMM_SHARE) -> dict:
    """A model, not a measurement: one step's backward and all-reduces if everything ran as designed.

    `numels` are the parameter tensors' sizes in the order their gradients become ready (reverse registration
    order, as BucketedDDP fills its buckets); the buckets are mlsys.ddp.assign_buckets' plan for them. Time is in
    units of the whole backward (= 1): each tensor's backward lasts its share of all the elements; a bucket's
    all-reduce lasts `comm_share` x its share of the gradient bytes, and the communication stream runs one
    all-reduce at a time. Bucketed: every all-reduce waits for the end of the backward. Overlapped: bucket i starts
    at max(ready_i, end of bucket i-1), ready_i being the moment its last gradient is done."""
    total = sum(numels)
    ends = [sum(numels[:i + 1]) / total for i in range(len(numels))]  # when each tensor's gradient is ready
    backward = [(e - n / total, e) for n, e in zip(numels, ends)]
    buckets = assign_buckets(numels, element_size, bucket_bytes)
    ready = [ends[b[-1]] for b in buckets]
    length = [comm_share * sum(numels[i] for i in b) / total for b in buckets]
    out = {"comm_share": comm_share, "buckets": buckets, "backward": backward, "ready": ready,
           "bucket_bytes": [element_size * sum(numels[i] for i in b) for b in buckets]}
    for name, earliest in (("bucketed", [1.0] * len(buckets)), ("overlapped", ready)):
        comm, free = [], 0.0  # free: when the communication stream is done with the previous bucket
        for t, d in zip(earliest, length):
            comm.append((max(t, free), max(t, free) + d))
            free = comm[-1][1]
        out[name] = comm
        out[f"{name}_end"] = max(1.0, free)
    out["saved_share"] = 1 - out["overlapped_end"] / out["bucketed_end"]
    return out


COMPUTE_NAMES = ("forward", "backward", "wait for all-reduces")


def overlap_spans(trace_path) -> list[plot.Span]:
    """The trace's spans to draw: forward, the backward split by block, the wait, on a "compute" row; every
    gloo all-reduce on the row of the gloo thread that ran it, labelled with its bucket (launch order)."""
    def lane_of(e: dict) -> str | None:
        name = e.get("name", "")
        if name in COMPUTE_NAMES or name.startswith("backward block"):
            return "compute"
        if name == "c10d::allreduce_":  # the hook's launch call, on the training thread
            return "launch"
        if name == "aten::copy_":  # kept below only inside the wait: a bucket's sums copied back into .grad
            return "copy"
        return "all-reduce" if name == "gloo:all_reduce" else None

    raw = plot.trace_spans(trace_path, lane_of=lambda e: lane_of(e) and f"{lane_of(e)} {e.get('tid')}")
    compute = sorted((s for s in raw if s.lane.startswith("compute")), key=lambda s: s.start)
    comm = sorted((s for s in raw if s.lane.startswith("all-reduce")), key=lambda s: s.start)
    launches = sorted((s for s in raw if s.lane.startswith("launch")), key=lambda s: s.start)
    wait = next(s for s in compute if s.label == "wait for all-reduces")
    copies = [s for s in raw if s.lane == f"copy {wait.lane.split()[-1]}" and wait.start <= s.start < wait.end]
    t0 = min(s.start for s in compute)  # time 0: the profiled step's forward starts
    for s in raw:
        s.start, s.end = s.start - t0, s.end - t0
    backward = next(s for s in compute if s.label == "backward")
    blocks = [s for s in compute if s.label.startswith("backward block")]  # last block first, as autograd runs
    spans = [plot.Span("compute", s.start, s.end, s.label, s.label) for s in compute
             if s.label in ("forward", "wait for all-reduces")]
    # the backward, cut at the block boundaries: head (lm_head, ln_f) first, then the blocks, embeddings last
    spans.append(plot.Span("compute", backward.start, blocks[0].start, "head", "backward"))
    spans += [plot.Span("compute", b.start, b.end, b.label.removeprefix("backward "), "backward") for b in blocks]
    spans.append(plot.Span("compute", blocks[-1].end, backward.end, "emb.", "backward"))
    threads = list(dict.fromkeys(s.lane for s in comm))
    for k, s in enumerate(comm):
        spans.append(plot.Span(f"gloo thread {threads.index(s.lane) + 1}", s.start, s.end, str(k), ALL_REDUCE))
    spans += [plot.Span("launch", s.start, s.end, f"bucket {k}", "launch") for k, s in enumerate(launches)]
    return spans + [plot.Span("copy back", s.start, s.end, "", "copy back") for s in copies]


def backward_compute(spans: list[plot.Span]) -> list[tuple[float, float]]:
    """When the training thread really computed the backward: its segments minus the hooks' launch calls (the
    "launch" spans: whole calls once whole_launch_calls has widened them, during which the thread is not computing)."""
    launches = [(s.start, s.end) for s in spans if s.lane == "launch"]
    backward = [s for s in spans if s.kind == "backward"]
    return minus([(min(s.start for s in backward), max(s.end for s in backward))], launches)


def overlap_summary(spans: list[plot.Span]) -> dict:
    """What the lesson reads off the trace: how long the backward and the final wait took, how long the launch calls
    held the training thread inside the backward ("held") and how long it computed (the rest of the backward), how
    much of the all-reduce time ran during that computing, and how late gloo started a launched bucket."""
    backward = [s for s in spans if s.kind == "backward"]
    start, end = min(s.start for s in backward), max(s.end for s in backward)
    comm = [s for s in spans if s.kind == ALL_REDUCE]
    launches = [s for s in spans if s.lane == "launch"]
    busy = sum(s.end - s.start for s in comm)  # each all-reduce's own duration, added up over the buckets
    merged: list[list[float]] = []  # the same boxes merged where they overlap: when at least one was running
    for s in sorted(comm, key=lambda s: s.start):
        if merged and s.start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], s.end)
        else:
            merged.append([s.start, s.end])
    computing = backward_compute(spans)
    hidden = sum(max(0.0, min(s.end, b) - max(s.start, a)) for s in comm for a, b in computing)
    share, held = hidden / busy if busy else 0.0, end - start - sum(b - a for a, b in computing)
    step = max(s.end for s in spans) - min(s.start for s in spans)
    waits = [(s.start, s.end) for s in spans if s.label == "wait for all-reduces"]
    wait = sum(b - a for a, b in waits)
    # the final wait split three ways: an all-reduce box still open; else a copy back into .grad; else neither
    no_comm = minus(waits, [(a, b) for a, b in merged])
    neither = sum(b - a for a, b in minus(no_comm, [(s.start, s.end) for s in spans if s.lane == "copy back"]))
    copying = sum(b - a for a, b in no_comm) - neither
    return {"buckets": len(comm), "backward_ms": end - start, "allreduce_ms": busy, "wait_ms": wait,
            "wait_running_ms": wait - copying - neither, "wait_copy_ms": copying, "wait_neither_ms": neither,
            "wait_text": f"{wait:.1f} ms: an all-reduce still running for {wait - copying - neither:.1f} ms of it, "
                         f"copying sums back into the gradients for {copying:.1f} ms, and neither for {neither:.1f} ms "
                         "(the training thread inside handle.wait() or in Python between the copies, with no "
                         "all-reduce box open)",
            "allreduce_any_ms": sum(b - a for a, b in merged), "gloo_threads": len({s.lane for s in comm}),
            "step_ms": step,
            "hidden_share": share, "launch_ms": held, "computing_ms": end - start - held,
            "step_text": f"{step:.1f} ms, backward {end - start:.1f} ms = the hooks' launch calls {held:.1f} ms + "
                         f"computing {end - start - held:.1f} ms; {share:.0%} of the {len(comm)} all-reduces' time "
                         "ran during that computing",
            "longest_launch_ms": max((s.end - s.start for s in launches), default=0.0),
            "max_start_delay_ms": max((c.start - ln.start for c, ln in zip(comm, launches)), default=0.0)}


def _trace_offset(launches: list[plot.Span], began_s: list[float]) -> float:
    """trace ms = 1e3 * perf_counter + offset; each launch event begins after its clock reading: the least gap."""
    return min(ln.start - 1e3 * t for ln, t in zip(launches, began_s))


def whole_launch_calls(spans: list[plot.Span], clock: list[dict]) -> list[plot.Span]:
    """`spans` with each launch span ("launch": the trace's c10d::allreduce_, torch's C++ op) replaced by the whole
    Python call around it as clocked_launches timed it, placed on the trace's axis by _trace_offset."""
    launches = sorted((s for s in spans if s.lane == "launch"), key=lambda s: s.start)
    if not clock or len(clock) != len(launches):
        return spans
    offset = _trace_offset(launches, [c["began_s"] for c in clock])
    return [s for s in spans if s.lane != "launch"] + [
        plot.Span("launch", 1e3 * c["began_s"] + offset, 1e3 * c["began_s"] + offset + c["wall_ms"], ln.label, ln.kind)
        for ln, c in zip(launches, clock)]


def peer_wait_ms(spans: list[plot.Span], own_began_s: list[float], peers_began_s: list[list[float]]) -> float:
    """How long rank 0's all-reduces waited for another rank, outside the backward's compute: the part of each
    bucket's all-reduce before the last other rank had begun launching that bucket, minus the time the training
    thread computed the backward. `own_began_s` and `peers_began_s` are perf_counter readings at the start of each
    launch call (one machine: one monotonic clock); rank 0's own readings place the trace on that clock."""
    launches = sorted((s for s in spans if s.lane == "launch"), key=lambda s: s.start)
    comm = sorted((s for s in spans if s.kind == ALL_REDUCE), key=lambda s: s.start)
    if not peers_began_s or not launches or len(own_began_s) != len(launches):
        return 0.0
    offset = _trace_offset(launches, own_began_s)
    waiting = []
    for k, c in enumerate(comm):
        peer_ready = max(1e3 * began[k] + offset for began in peers_began_s if k < len(began))
        if peer_ready > c.start:
            waiting.append((c.start, min(c.end, peer_ready)))
    return sum(b - a for piece in waiting for a, b in minus([piece], backward_compute(spans)))


def overlap_cause(peer_ms: float, core_ms: float | None, launch_ms: float) -> str:
    """The sentence the lesson quotes: which measured part kept the most all-reduce time from running beside the
    backward's compute: waiting for another rank, the training thread waiting for a core inside its launch calls,
    or the rest of those launch calls."""
    parts = {"peer": peer_ms, "core": core_ms if core_ms is not None else -1.0, "launch": launch_ms}
    largest = max(parts, key=parts.get)
    core = "not measured here" if core_ms is None else f"{core_ms:.1f} ms"
    head = {
        "peer": f"waiting for another rank: {peer_ms:.1f} ms of rank 0's all-reduce time, outside the backward's "
                "compute, passed before the other rank had launched the same bucket",
        "core": f"queued for a core: inside its launch calls the training thread was runnable but off its core "
                f"{core}, so the all-reduce ran instead of the backward, not beside it",
        "launch": f"the launch calls themselves: they held the training thread {launch_ms:.1f} ms on a core or "
                  "asleep, not computing the backward"}[largest]
    rest = {"peer": f"waiting for another rank {peer_ms:.1f} ms", "core": f"queued for a core {core}",
            "launch": f"the rest of the launch calls {launch_ms:.1f} ms"}
    return f"{head} (the others: {', '.join(rest[k] for k in parts if k != largest)})"


def launch_timeline(spans: list[plot.Span]) -> list[dict]:
    """When, in the profiled step, each bucket's launch call (c10d::allreduce_ on the training thread) began and
    returned, in percent of that step's backward (the "backward" range): the figure's dotted lines and the ends of
    its pink boxes, read from the same trace."""
    backward = [s for s in spans if s.kind == "backward"]
    start, end = min(s.start for s in backward), max(s.end for s in backward)
    launches = sorted((s for s in spans if s.lane == "launch"), key=lambda s: s.start)
    return [{"bucket": k, "launch began (% of backward)": 100 * (s.start - start) / (end - start),
             "returned (%)": 100 * (s.end - start) / (end - start)} for k, s in enumerate(launches)]


def bucket_table(model: GPT, bucket_mb: float) -> list[dict]:
    names = {id(p): n for n, p in model.named_parameters()}
    ddp = BucketedDDP(model, bucket_mb)  # collective: every rank builds it (broadcast of the weights)
    rows = []
    for i, bucket in enumerate(ddp.buckets):
        first, last = names[id(bucket[0])], names[id(bucket[-1])]
        numel = sum(p.numel() for p in bucket)
        rows.append({"bucket": i, "params": len(bucket), "from": first, "to": last, "numel": numel,
                     "KiB": numel * 4 / 1024})
    return rows


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def worker(ctx: RankContext, args: Settings) -> dict:
    tokens, _ = load_splits(args.num_records, args.seed)
    model = fresh_model(args, ctx.rank)
    grad_bytes = num_params(model) * 4
    buckets = bucket_table(model, args.bucket_mb)
    if args.tables:
        ctx.print(f"{args.preset} GPT: {num_params(model):,} parameters = {grad_bytes / 1024:.1f} KiB of float32 "
                  f"gradients; buckets of {args.bucket_mb} MiB, filled in reverse parameter order:")
        ctx.print(report.table(buckets, ".1f"))

    rows, results = [], {}
    for accum in sorted({1, args.accum}) if args.tables else []:
        ref = reference_params(args, tokens, ctx.world_size, accum)
        kinds = KINDS if accum == 1 else ("overlapped", "torch")
        runs = {kind: train_data_parallel(ctx, args, tokens, kind, accum) for kind in kinds}
        for kind, run in runs.items():
            ddp = run["ddp"]
            calls = getattr(ddp, "allreduce_calls", None)
            row = {"version": kind, "accum": accum,
                   "allreduce/step": "(inside torch)" if calls is None else str(calls // args.steps),
                   "MiB/step": "" if calls is None else f"{ddp.allreduce_bytes / args.steps / 2**20:.3f}",
                   "vs global batch": max_diff(run["params"], ref),
                   "vs torch DDP": max_diff(run["params"], runs["torch"]["params"])}
            rows.append(row)
            report.expect_close(f"{kind} (accum {accum}) vs single process on the global batch, rank {ctx.rank}",
                                torch.cat([p.flatten() for p in run["params"]]),
                                torch.cat([p.flatten() for p in ref]), rtol=0, atol=args.atol)
            report.expect_close(f"{kind} (accum {accum}) vs torch DDP, rank {ctx.rank}",
                                torch.cat([p.flatten() for p in run["params"]]),
                                torch.cat([p.flatten() for p in runs["torch"]["params"]]), rtol=0, atol=args.atol)
        results[accum] = runs
    if args.tables:
        ctx.print(f"\nafter {args.steps} SGD steps, max |parameter difference| on rank 0 (W={ctx.world_size}):")
        ctx.print(report.table(rows, ".2g"))

    ideal = {}
    if ctx.is_main and args.profile:  # the ideal overlap of this run's buckets: a model, drawn before the trace
        params = [p for p in model.parameters() if p.requires_grad][::-1]  # the order gradients get ready
        numels = [p.numel() for p in params]
        ideal = ideal_schedule(numels, params[0].element_size(), int(args.bucket_mb * MB))
        if [sum(numels[i] for i in b) for b in ideal["buckets"]] != [r["numel"] for r in buckets]:
            raise cli.SelfCheckFailed("the ideal-overlap model's buckets differ from the bucket table above")
        plural, gap = "s" * (len(buckets) != 1), "\n" * args.tables  # a blank line after the tables, if shown
        ctx.print(f"{gap}ideal overlap of these {len(buckets)} bucket{plural} (a model, not measured; time in "
                  f"backwards, all-reducing every gradient assumed to take {ideal['comm_share']:g} of one): bucketed "
                  f"ends at {ideal['bucketed_end']:.2f}, overlapped at {ideal['overlapped_end']:.2f} "
                  f"({ideal['saved_share']:.0%} shorter); figure: {draw_ideal(args, ideal)}")

    trace_path = plot.figure_dir(args) / "ddp_overlap.trace.json" if ctx.is_main and args.profile else None
    clock: list[dict] = []
    bucket_names = profile_overlap(ctx, args, tokens, trace_path, clock) if args.profile else []
    began = [[c["began_s"] for c in clock]] * ctx.world_size
    if args.profile and ctx.world_size > 1:  # every rank's launch times, to tell rank 0 when the others launched
        dist.all_gather_object(began, began[0])
    spans, clocked, timeline = [], {}, []
    if ctx.is_main and args.profile:
        spans = overlap_spans(trace_path)
        c10d_ms = sum(s.end - s.start for s in spans if s.lane == "launch")  # torch's C++ op: part of each call
        spans = whole_launch_calls(spans, clock)  # from here on a launch call is the whole Python call
        queued = [c["run_queue_ms"] for c in clock]
        clocked = {"launch_wall_ms": sum(c["wall_ms"] for c in clock), "launch_cpu_ms": sum(c["cpu_ms"] for c in clock),
                   "launch_run_queue_ms": None if None in queued else sum(queued), "launch_c10d_ms": c10d_ms}
        held = overlap_summary(spans)["launch_ms"]  # the whole calls, inside the backward
        clocked["launch_asleep_ms"] = (None if clocked["launch_run_queue_ms"] is None else max(  # whole calls
            0.0, clocked["launch_wall_ms"] - clocked["launch_cpu_ms"] - clocked["launch_run_queue_ms"]))
        clocked["peer_wait_ms"] = peer_wait_ms(spans, began[0], began[1:])
        rest = held - (clocked["launch_run_queue_ms"] or 0.0)  # on a core or asleep
        clocked["overlap_cause"] = overlap_cause(clocked["peer_wait_ms"], clocked["launch_run_queue_ms"], rest)
        o = overlap_summary(spans) | clocked
        timeline = launch_timeline(spans)
        ctx.print(f"\nprofiled one more overlapped step on rank 0 (the measured figure): trace {trace_path}")
        ctx.print("bucket launches in that step, when the hook's launch call (its whole call to dist.all_reduce) began "
                  "and returned (the figure's dotted line and the end of its pink box), as a share of the backward:")
        ctx.print(report.table(timeline, ".0f"))
        # the plain line; the other totals (summed and merged all-reduce time, gloo's start delay) are in --json
        ctx.print(f"step {o['step_text']}")
        ctx.print(f"final wait {o['wait_text']}")
        ctx.print(f"inside the launch calls the training thread ran {o['launch_cpu_ms']:.2f} ms on a core"
                  + ("" if o["launch_run_queue_ms"] is None else
                     f", was runnable but waiting for a core {o['launch_run_queue_ms']:.1f} ms and was asleep "
                     f"(neither) {o['launch_asleep_ms']:.1f} ms")
                  + f"; torch's own c10d::allreduce_ events, the C++ op inside the calls, took {c10d_ms:.1f} ms")
        ctx.print(f"what most kept the all-reduces from running beside the backward: {o['overlap_cause']}")
        ctx.print(f"figure: {draw_overlap(args, spans)}")

    volume = comm_volume("all_reduce", grad_bytes, ctx.world_size)
    same = torch.tensor([float("nan")])
    if args.tables:
        ctx.print(f"\nper step, each rank all-reduces {grad_bytes / 1024:.1f} KiB of gradients; a ring sends "
                  f"2(W-1)/W x that = {volume['sent'] / 1024:.1f} KiB per rank (mlsys.collectives.comm_volume)")
        same = torch.tensor([max_diff(results[1]["overlapped"]["params"], results[1]["torch"]["params"])])
        dist.all_reduce(same, op=dist.ReduceOp.MAX)
        ctx.print("self-check passed: every version matches the global-batch reference and torch's DDP on every "
                  "rank")
    else:
        ctx.print("self-check passed: the model's buckets are BucketedDDP's (no training runs with --no-tables)")
    return {"num_params": num_params(model), "grad_bytes": grad_bytes, "buckets": buckets, "comparison": rows,
            "overlap_timeline": timeline, "ideal_overlap": ideal, "allreduce_sent_bytes_per_rank": volume["sent"],
            "max_diff_overlapped_vs_torch_all_ranks": same.item(),
            "overlap_trace": {} if not args.profile else (
                {"path": str(trace_path), "bucket_params": bucket_names, "spans": [vars(s) for s in spans]}
                | (overlap_summary(spans) if spans else {}) | clocked)}


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"steps": 2, "num_records": 300},
                     world_sizes=range(1, 9), world_sizes_text="1 to 8")
    results = launch(worker, args)
    if results is not None and args.json:
        report.write_json(args.json, results, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
