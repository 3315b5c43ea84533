"""Overlap scheduling: schedule and prepare step N+1 while step N's forward runs, with the same output.

What it shows
    1. Correctness: the same requests (greedy, mixed prompt lengths, some stopping early on a stop token,
       a tight token budget so prompts are chunked) served by the plain Engine and by OverlapEngine
       (mlsys/engine/overlap.py). Every request's tokens must be identical (exit 1 otherwise); the script
       prints how many steps had to be re-prepared because a sequence stopped while the next step was
       already scheduled. Below it, a placeholder trace: one overlapped decode step of 2 sequences, step n+1's
       input ids as prepared while forward n ran (-1 where the token was not known yet) and after step n's
       tokens were written in.
    2. The effect, per batch size: B sequences decoding, each engine timed over the same number of steps,
       the two engines alternating in rounds so that both see the same machine load. Printed: ms per step
       for each, the time saved per step, and the CPU work (schedule + prepare) each engine does: in line in
       the plain one, while the forward runs in the overlapped one. A row that saved more than the plain
       sched+prep, or saved with the two forwards (each timed in the thread that ran it) 10% apart or more, the
       plain one slower, or lost more than a whole plain step, is marked noise.
       On a CPU the forward runs in a worker thread and the scheduler's Python can run only while that
       thread is inside a kernel (PyTorch releases the GIL there), not while the forward's own Python
       dispatches ops. On a GPU the forward is an asynchronous launch, so the CPU work hides behind the GPU's
       execution, if there is any left once the launches are done: the GPU rows add the same pair of
       engines with CUDA graphs (EngineConfig.cuda_graph_sizes), where the launch is one replay.
    3. FIGURE timeline.png (into --plot-dir): 4 consecutive real decode steps of each engine at --timeline-batch
       sequences (of 24 recorded, the 4 consecutive steps whose slowest step is the fastest, so that an
       interrupted step stays out of the picture whenever the run has 4 uninterrupted steps in a row; the output
       says whether the drawn window is clean: no drawn step over 2x the median of its own window, nor over 2x its
       engine's median recorded step, and no drawn box over 3x its engine's median box of that kind over all
       recorded steps, so a recording slowed evenly throughout passes; it names a step or box that fails) on two
       lanes, the main thread (from the engines' own stage timings) and the
       forward (when the runner's forward really ran, timed in the thread that ran it); printed: each engine's
       median step and forward, how long after the launch the worker started the forward (its start delay), and
       in how many drawn steps forward n started only after step n+1's schedule +
       prepare had ended (the two did not overlap at all; when none did, it says what to run to see overlap).
       The line's wording follows that count: only a forward that overlapped its box n+1 ran with the main
       thread beside it, so only there can a slower overlapped forward come from the two threads competing for
       the GIL and the cores. It says which forward ran slower (the overlapped forward's median over the plain
       one's, 10% apart or more): a plain forward slower than the overlapped one is a slow plain recording,
       not a gain from overlap. A last line gives this recording's own verdict (it is not Table 2's recording,
       so the two can disagree): which engine's median step was quicker, 10% apart or more, with a gain flagged
       as a slow plain recording when it exceeds the plain step's schedule + prepare or the plain forward ran
       slower.
    4. FIGURE schematic.png: overlap working, as a schematic (not measured): the same engines' stages in the same
       drawing, timed by a model of an asynchronous device (a GPU with graphs), where box n+1 fits inside forward n.

How to run
    python tutorial/part3-inference/chapter10-scheduling-cuda-graphs/scripts/overlap_scheduling.py
    python .../overlap_scheduling.py --batch-sizes 1 16 64 --steps 40 --device cuda

Runtime on 2 idle cores: about 4 s, 4 s with --smoke; on a busy machine (a printed load average above the core
count) up to about load average / cores times that, and the timings move with the load. Needs two free cores to
show any gain on a CPU.

Try next
    python tutorial/part3-inference/chapter10-scheduling-cuda-graphs/scripts/overlap_scheduling.py --rounds 5
        -> more alternating rounds: the medians move less from run to run; how far from 1 they sit depends on
           the machine's load, which the table's load average shows
    python .../overlap_scheduling.py --threads 2 --plot-dir /tmp/threads2
        -> the forward's two torch threads and the scheduler's thread now compete for the 2 cores (--plot-dir
           keeps the default run's timeline.png): line 1 still matches token for token and line 2 says torch
           threads: 2; the times have no fixed answer on 2 shared cores. Compare plain ms with a default run made
           just before; line 3 says which forward ran slower, and a slower plain 2-thread forward is load on the
           cores (its second thread waiting for one), not a gain from overlap.
           The main thread and the worker thread each have their own OpenMP pool, and two pools spinning while
           idle would fill the 2 cores, so the script sets OMP_WAIT_POLICY=PASSIVE (unless you set it): idle
           OpenMP threads sleep instead
"""

from __future__ import annotations

import os

# Before `import torch` loads OpenMP, which reads this once: with --threads > 1 each thread that runs torch ops
# (the main thread, and here the forward's worker thread) has its own OpenMP pool, and idle pool threads that
# spin instead of sleeping keep 2 cores busy and starve the thread with work. A user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from mlsys import bench, cli, plot, report
from mlsys.data import Tokenizer, make_corpus
from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.engine.overlap import PLACEHOLDER, OverlapEngine
from mlsys.engine.step_profile import decode_engine
from mlsys.weights import load_pretrained


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    num_requests: int = 12
    """Requests in the correctness run."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    """Sequences decoding together in the timing runs."""
    prompt_len: int = 32
    """Prompt tokens per sequence in the timing runs."""
    steps: int = 16
    """Decode steps per engine per round."""
    rounds: int = 3
    """Alternating rounds per batch size (plain, overlap, plain, overlap, ...); the median round is reported."""
    threads: int = 1
    """torch intra-op threads (the worker thread's forward uses these)."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu or cuda."""
    timeline_batch: int = 8
    """Sequences decoding in the timeline figure's steps."""

    def validate(self) -> None:
        if not 1 <= self.num_requests <= 64:
            raise cli.UsageError("--num-requests must be in 1..64")
        if not self.batch_sizes or min(self.batch_sizes) < 1 or max(self.batch_sizes) > 128:
            raise cli.UsageError("--batch-sizes must be in 1..128")
        if not 2 <= self.prompt_len <= 150 or not 2 <= self.steps <= 60 or not 1 <= self.rounds <= 20:
            raise cli.UsageError("--prompt-len must be in 2..150, --steps in 2..60, --rounds in 1..20")
        if not 1 <= self.timeline_batch <= 128:
            raise cli.UsageError("--timeline-batch must be in 1..128")
        if self.threads < 1:
            raise cli.UsageError("--threads must be >= 1")
        if self.device not in ("auto", "cpu", "cuda"):
            raise cli.UsageError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise cli.UsageError("--device cuda: no GPU on this machine")


# --8<-- [start:same_output]
def same_output(model, args: Settings, device: str) -> dict:
    """Plain vs overlapped engine on a workload with chunked prompts and early stops: tokens must match."""
    tok = Tokenizer()
    lines = make_corpus(args.num_requests, seed=args.seed).splitlines()
    prompts = [line[: 5 + (7 * i) % 60] for i, line in enumerate(lines)]  # 5..64 characters
    stop = (tok.encode(",")[0],)  # many requests stop at their first comma after the prompt
    params = [SamplingParams(max_tokens=40, stop_token_ids=stop if i % 2 else ()) for i in range(len(prompts))]
    config = EngineConfig(max_num_seqs=6, max_num_batched_tokens=32, device=device)
    plain = Engine(model, config=config).generate(prompts, params)
    overlap = OverlapEngine(model, config=config)
    over = overlap.generate(prompts, params)
    overlap.close()
    for i, (a, b) in enumerate(zip(plain, over)):
        report.expect_equal(f"request {i}: overlapped vs plain tokens", b.token_ids, a.token_ids)
    overlap.check_invariants()
    return {"requests": len(prompts), "tokens": sum(len(o.token_ids) for o in plain),
            "stopped": sum(o.finish_reason == "stop" for o in plain), **overlap.overlap_stats}
# --8<-- [end:same_output]


# --8<-- [start:placeholders]
def placeholder_trace(model, device: str, batch: int = 2) -> dict:
    """One overlapped decode step of `batch` sequences, caught when step n's tokens arrive: step n+1's input ids as
    prepared while forward n ran (PLACEHOLDER where a token was not known yet), the tokens step n sampled, and the
    input ids after they were written in."""
    engine = decode_engine(model, batch, 14, 4, device, engine_cls=OverlapEngine)  # prefilled: decoding now
    seen, fix_next = {}, engine._fix_next

    def noting(tokens):  # the engine's own write-back, with step n+1's prepared batch read before and after it
        nxt = engine._next[1]
        seen.update(positions=nxt.positions.tolist(), before=nxt.input_ids.tolist(), sampled=list(tokens.values()))
        fix_next(tokens)
        seen["after"] = engine._next[1].input_ids.tolist()
    engine._fix_next = noting
    engine.step()
    engine.close()
    return seen
# --8<-- [end:placeholders]


# --8<-- [start:timing]
def time_forwards(engine: Engine) -> list[float]:
    """Wrap the engine's runner so that every forward's seconds, timed in the thread that ran it, go into the list
    returned (the overlapped engine's stage "forward" is only the main thread's wait for it)."""
    took, execute = [], engine.runner.execute

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return execute(*a, **kw)
        finally:
            took.append(time.perf_counter() - t)
    engine.runner.execute = timed
    return took


def run_steps(engine: Engine, steps: int, took: list[float]) -> dict:
    """Step `steps` times; mean seconds per step, of its stages and of its forward as really run (from `took`)."""
    rows, n0 = [], len(took)
    for _ in range(steps):
        engine.step()
        rows.append(dict(engine.last_step_timing))
    keys = ("total", "schedule", "prepare", "forward", "overlapped")
    return {"ran": statistics.fmean(took[n0:]), **{k: statistics.fmean(r.get(k, 0.0) for r in rows) for k in keys}}


def compare(model, B: int, args: Settings, device: str) -> dict:
    """Plain and overlapped engines (on a GPU also both with CUDA graphs), B sequences each, alternating
    rounds of `steps` decode steps; the median round of each."""
    variants = {"plain": (Engine, None), "overlap": (OverlapEngine, None)}
    if device == "cuda":  # graphs make the forward's CPU side short, so the GPU's own time is what hides it
        graphs = [s for s in (1, 2, 4, 8, 16, 32, 64, 128) if s < B] + [B]
        variants |= {"graphs": (Engine, graphs), "graphs+overlap": (OverlapEngine, graphs)}
    max_tokens = args.rounds * args.steps + 4
    engines = {name: decode_engine(model, B, args.prompt_len, max_tokens, device, engine_cls=cls,
                                   cuda_graph_sizes=sizes) for name, (cls, sizes) in variants.items()}
    per_round = {name: [] for name in engines}
    took = {name: time_forwards(engine) for name, engine in engines.items()}
    for engine in engines.values():
        engine.step()  # warm-up; for an OverlapEngine it also fills the pipeline
    with bench.steady_timing():  # no garbage-collector pass inside a timed step
        for _ in range(args.rounds):
            for name, engine in engines.items():
                per_round[name].append(run_steps(engine, args.steps, took[name]))
    for engine in engines.values():
        if isinstance(engine, OverlapEngine):
            engine.close()
    med = {name: sorted(rounds, key=lambda r: r["total"])[args.rounds // 2] for name, rounds in per_round.items()}
    p, o = med["plain"], med["overlap"]
    row = {"B": B, "plain ms": p["total"] * 1e3, "overlap ms": o["total"] * 1e3,
           "speed-up": p["total"] / o["total"], "saved ms": (p["total"] - o["total"]) * 1e3,
           "plain sched+prep ms": (p["schedule"] + p["prepare"]) * 1e3,
           "overlap sched+prep ms": o["overlapped"] * 1e3, "plain fwd ms": p["ran"] * 1e3,
           "overlap fwd ms": o["ran"] * 1e3}
    if device == "cuda":
        g, go = med["graphs"], med["graphs+overlap"]
        row |= {"graphs ms": g["total"] * 1e3, "graphs+overlap ms": go["total"] * 1e3,
                "speed-up w/ graphs": g["total"] / go["total"]}
    row["note"] = noise_note(row)
    return row


FORWARD_SAME = 1.1  # forwards within 10% of each other's time read as "about as long"
# Table 2's note: a row gets the first note all of whose conditions hold; (a, op, k, b) reads row[a] op k * row[b]
# (op k alone when b is None). The printed legend is written from this table, so it states the rule applied.
NOISE_RULES = (
    ("noise: saved > sched+prep", "only the plain sched+prep can hide behind the forward",
     [("saved ms", ">", 1, "plain sched+prep ms")]),
    ("noise: slow plain fwd", "both engines run the same forward, so a slower plain one is load",
     [("saved ms", ">", 0, None), ("plain fwd ms", ">=", FORWARD_SAME, "overlap fwd ms")]),
    ("noise: lost > plain step", "at worst the plain step's work runs one thread after the other, plus two waits",
     [("overlap ms", ">", 2, "plain ms")]),
)


def holds(row: dict, a: str, op: str, k: float, b: str | None) -> bool:
    rhs = k if b is None else k * row[b]
    return row[a] > rhs if op == ">" else row[a] >= rhs


def noise_note(row: dict) -> str:
    """Table 2's note: the first rule of NOISE_RULES whose conditions all hold, or "" (overlap can explain the row)."""
    return next((note for note, _, conds in NOISE_RULES if all(holds(row, *c) for c in conds)), "")


def noise_legend() -> str:
    """The printed legend of the note column, written from NOISE_RULES."""

    def cond(a: str, op: str, k: float, b: str | None) -> str:
        return f"{a} {op} " + (f"{k:g}" if b is None else b if k == 1 else f"{k:g} x {b}")
    rules = "; ".join(f"'{note}' if {' and '.join(cond(*c) for c in conds)} ({why})"
                      for note, why, conds in NOISE_RULES)
    return f"note, the first rule that holds (the machine's load, not the overlap): {rules}"


# --8<-- [end:timing]


TIMELINE_TRIES = 6  # windows of recorded steps per drawn window: 4 drawn steps of 24 recorded
WINDOW_CLEAN_RATIO = 2.0  # a drawn step slower than this many times its engine's median step was interrupted
BOX_CLEAN_RATIO = 3.0  # a drawn box this many times its engine's median box of that kind was interrupted, if it
BOX_VISIBLE = 0.25  # also outlasts that median by this share of the engine's median step (tiny boxes jitter)


def box_ms(name: str, row: dict) -> dict[str, float]:
    """One recorded step's drawn boxes by kind, in ms: its schedule + prepare (for the overlapped engine, step
    n+1's, run beside forward n), its forward as really run, and its sample + detokenize."""
    st = row["stages"]
    sp = st.get("overlapped", 0.0) if name == "overlap" else st.get("schedule", 0.0) + st.get("prepare", 0.0)
    return {"schedule + prepare": sp * 1e3, "forward": row["forward"][1] - row["forward"][0],
            "sample + detokenize": (st.get("sample", 0.0) + st.get("detokenize", 0.0)) * 1e3}


def record_timeline(model, args: Settings, device: str, steps: int = 4,
                    tries: int = TIMELINE_TRIES) -> dict[str, list[dict]]:
    """`steps` consecutive decode steps of each engine, in ms from the first drawn step's start: when each step
    started, its stage timings, and when its forward really ran (the runner's execute, timed in whichever thread
    called it). Of `steps * tries` recorded steps it keeps the `steps` consecutive ones whose slowest step is the
    fastest, ties broken by their total (on a busy machine the slow steps are the ones the OS interrupted)."""
    out = {}
    for name, cls in (("plain", Engine), ("overlap", OverlapEngine)):
        recorded = steps * tries
        engine = decode_engine(model, args.timeline_batch, args.prompt_len, recorded + 4, device, engine_cls=cls)
        engine.step()  # warm-up; an OverlapEngine's pipeline is full afterwards
        runs: list[tuple[float, float]] = []  # (start, end) of every forward, perf_counter seconds
        execute = engine.runner.execute

        def timed(*a, execute=execute, runs=runs, **kw):
            t = time.perf_counter()
            try:
                return execute(*a, **kw)
            finally:
                runs.append((t, time.perf_counter()))
        engine.runner.execute = timed  # the engine is unchanged; its runner's calls are now timed
        rows, t_first = [], None
        with bench.steady_timing():
            for _ in range(recorded):
                t = time.perf_counter()
                t_first = t if t_first is None else t_first
                engine.step()
                rows.append({"start": (t - t_first) * 1e3, "stages": dict(engine.last_step_timing)})
        for row, (a, b) in zip(rows, runs[-recorded:]):
            row["forward"] = [(a - t_first) * 1e3, (b - t_first) * 1e3]
        if isinstance(engine, OverlapEngine):
            engine.close()
        # the window of `steps` consecutive steps with the fastest slowest step (an interrupted step is the slowest
        # of its window, so this keeps it out when any window can), then the least total; rebased to its first step
        totals = [r["stages"]["total"] for r in rows]
        k = min(range(recorded - steps + 1),
                key=lambda i: (max(totals[i : i + steps]), sum(totals[i : i + steps])))
        t0 = rows[k]["start"]
        median_ms = statistics.median(totals) * 1e3  # of all recorded steps: what an uninterrupted step takes
        boxes = [box_ms(name, r) for r in rows]  # per kind: a few steps slowed in different boxes lift no median
        box_median = {kind: statistics.median(b[kind] for b in boxes) for kind in boxes[0]}
        out[name] = [{"start": r["start"] - t0, "stages": r["stages"], "forward": [r["forward"][0] - t0,
                                                                                   r["forward"][1] - t0],
                      "recorded_median_ms": median_ms, "recorded": recorded, "box_median_ms": box_median}
                     for r in rows[k : k + steps]]
    return out


def timeline_spans(tl: dict[str, list[dict]]) -> list[plot.Span]:
    """Two lanes per engine, main thread and forward. Plain: step n is scheduled and prepared, then computed,
    in line. Overlap: step n's forward is launched first, then the main thread schedules and prepares step n+1
    while it runs, then waits for it."""
    spans = []
    for name, rows in tl.items():
        main, fwd = f"{name}: main thread", f"{name}: forward"
        for n, row in enumerate(rows):
            ms = {k: v * 1e3 for k, v in row["stages"].items() if isinstance(v, float)}
            t, (f0, f1) = row["start"], row["forward"]
            spans.append(plot.Span(fwd, f0, f1, f"{n}", "forward"))
            if name == "plain":
                spans.append(plot.Span(main, t, t + ms["schedule"] + ms["prepare"], f"{n}", "schedule + prepare"))
                after = f1  # sampling starts when the forward returns
            else:  # launch, then step n+1's CPU work while n's forward runs, then the wait
                t1 = t + ms["launch"]
                spans.append(plot.Span(main, t, t1, "", "launch"))
                spans.append(plot.Span(main, t1, t1 + ms["overlapped"], f"{n + 1}", "schedule + prepare"))
                spans.append(plot.Span(main, t1 + ms["overlapped"], t1 + ms["overlapped"] + ms["forward"], "",
                                       "waiting for the forward"))
                after = t1 + ms["overlapped"] + ms["forward"]
            spans.append(plot.Span(main, after, after + ms["sample"] + ms["detokenize"], "", "sample + detokenize"))
    return spans


# the schematic's stage times, in model units, not measured: a GPU forward with CUDA graphs (one short launch,
# then the device computes for longer than the host takes to schedule and prepare the next step)
SCHEMATIC = {"schedule": 0.4, "prepare": 0.6, "launch": 0.05, "forward": 1.6, "sample": 0.2, "detokenize": 0.15}


def schematic_timeline(tl: dict[str, list[dict]], u: dict = SCHEMATIC, steps: int = 3) -> dict[str, list[dict]]:
    """Overlap working, as a schematic: rows shaped like `record_timeline`'s (the engines' own stage names, drawn
    by `timeline_spans` in the engines' order), timed by a model of an asynchronous device: every stage takes its
    `u` time, forward n runs on the device from its launch (plain: once its batch is prepared), and nothing
    waits for a core or a lock. Per step: plain = sched+prep + forward + sample; overlap = launch +
    max(sched+prep, forward) + sample."""
    sp = u["schedule"] + u["prepare"]
    out = {}
    for name, rows in tl.items():
        t, new = 0.0, []
        for _ in range(steps):
            if name == "plain":
                st, f0 = {"schedule": u["schedule"], "prepare": u["prepare"], "forward": u["forward"]}, t + sp
            else:  # launch n; step n+1's schedule + prepare while the device runs n; wait for what is left of n
                st = {"launch": u["launch"], "overlapped": sp, "forward": max(0.0, u["forward"] - sp)}
                f0 = t + u["launch"]
            st.update(sample=u["sample"], detokenize=u["detokenize"])
            if not set(st) <= set(rows[0]["stages"]):
                raise cli.SelfCheckFailed(f"the schematic's stages {sorted(st)} are not all the {name} engine's")
            total = sum(st.values())
            new.append({"start": t, "stages": {**{k: v / 1e3 for k, v in st.items()}, "total": total / 1e3},
                        "forward": [f0, f0 + u["forward"]]})
            t += total
        out[name] = new
    return out


def forward_ratio_words(ratio: float) -> str:
    """What the overlapped forward's time over the plain forward's time says, and which way."""
    if ratio >= FORWARD_SAME:
        return f"the overlapped forward took {ratio:.2f}x the plain forward's time: it ran slower"
    if ratio <= 1 / FORWARD_SAME:
        return (f"the overlapped forward took {ratio:.2f}x the plain forward's time: the plain forward ran slower. "
                "Both engines run the same forward with the same torch threads, so this is no speed-up from "
                "overlap but a slow plain recording (the machine's load at that moment, or with --threads above 1 "
                "its threads waiting for a core)")
    return f"the two forwards took about as long ({ratio:.2f}x, overlapped over plain)"


NO_OVERLAP_HINT = ("timeline.png shows no overlap this time (schematic.png draws the idea working); whether box n+1 "
                   "meets forward n depends on when the worker thread gets the GIL and a core, so a rerun may differ")


def overlap_text(serial: int, drawn: int, slowdown: float) -> str:
    """What line 3 may say about the overlapped forward, given how many of the `drawn` steps were serial (forward n
    started only after step n+1's schedule + prepare had ended): only a forward that overlapped its box n+1 ran with
    the main thread beside it. The ratio (overlapped forward over plain forward) is worded by its direction."""
    after = "forward n started only after step n+1's schedule + prepare had ended"
    ratio = forward_ratio_words(slowdown)
    if serial >= drawn:
        return (f"in all {drawn} drawn overlapped steps {after}, so nothing ran beside these forwards: "
                f"{NO_OVERLAP_HINT}. These forwards each ran alone, at different moments of the machine's load: "
                f"{ratio}")
    if serial == 0:
        why = ("; the two threads competing for the GIL and the cores can explain that" if slowdown >= FORWARD_SAME
               else "")
        return (f"in all {drawn} drawn overlapped steps forward n started before step n+1's schedule + prepare had "
                f"ended, so the main thread scheduled the next step beside it. With that thread beside it, "
                f"{ratio}{why}")
    return (f"in {serial} of {drawn} drawn overlapped steps {after}, so nothing ran beside those forwards; in the "
            f"other {drawn - serial} the main thread scheduled the next step beside the forward. Over both kinds of "
            f"step (medians), {ratio}")


def speedup_words(rows: list[dict]) -> str:
    """Table 2's speed-up range over the rows not marked noise, and how many marked rows it leaves out."""
    kept = [r for r in rows if not r["note"]]
    left = len(rows) - len(kept)
    out = f" ({left} row{'s' * (left > 1)} marked noise left out)" if left and kept else ""
    if not kept:
        return "every row is marked noise, so no row measured the overlap"
    lo, hi = (f(kept, key=lambda r: r["speed-up"]) for f in (min, max))
    if len(kept) == 1:
        return f"only the B = {lo['B']} row is not marked noise: {lo['speed-up']:.2f}x"
    return (f"the rows not marked noise range from {lo['speed-up']:.2f}x (B = {lo['B']}) to {hi['speed-up']:.2f}x "
            f"(B = {hi['B']}){out}")


def step_verdict(summ: dict) -> str:
    """This recording's own verdict on overlap, from its drawn steps' medians (Table 2 times other steps, so the two
    can disagree): which engine's step was quicker, 10% apart or more. A gain is a slow plain recording when it
    exceeds the plain step's schedule + prepare (all that overlap can hide), or when the plain forward, the same
    forward as the overlapped one, ran slower."""
    p, o, sp = summ["plain_step_ms"], summ["overlap_step_ms"], summ["plain_sched_prep_ms"]
    head = f"the overlapped step took {o / p:.2f}x the plain step's time ({o:.2f} against {p:.2f} ms)"
    if o >= FORWARD_SAME * p:
        return head + ": overlap lost in this recording"
    if p < FORWARD_SAME * o:
        return head + ": about as long, no gain from overlap in this recording"
    why = [f"it saved {p - o:.2f} ms, more than the plain step's whole schedule + prepare ({sp:.2f} ms)"] * (p - o > sp)
    if summ["forward_slowdown"] <= 1 / FORWARD_SAME:
        why.append(f"the plain forward ran {1 / summ['forward_slowdown']:.2f}x as long as the overlapped one")
    if why:
        return (head + ": quicker, but " + " and ".join(why) + ", so this is a slow plain recording, not a gain "
                "from overlap")
    return head + ": overlap gained in this recording"


def timeline_line(summ: dict, batch: int, drawn: int, recorded: int) -> str:
    """Line 3 of the output: the drawn timeline's medians, its waits and how many of its steps overlapped."""
    text = summ["overlap_text"]
    return (f"3. The timeline's {drawn} steps at B={batch} ({drawn} consecutive of {recorded} recorded, those with "
            f"the fastest slowest step; medians): plain step {summ['plain_step_ms']:.2f} ms, its forward "
            f"{summ['plain_forward_ms']:.2f} ms; overlapped step {summ['overlap_step_ms']:.2f} ms, its forward "
            f"{summ['overlap_forward_ms']:.2f} ms; the worker "
            f"started its forward {summ['overlap_start_delay_ms']:.2f} ms after the launch, and after the forward "
            f"returned, the main thread waited a further {summ['overlap_handback_ms']:.2f} ms for its result. "
            f"{text[0].upper()}{text[1:]}.")


def timeline_summary(tl: dict[str, list[dict]]) -> dict:
    """Per engine, over the drawn steps: the median ms per step and the median ms its forward really took; for the
    overlapped engine, the median ms its main thread went on waiting after the forward had returned (the hand-back:
    the worker thread passing the result, the main thread waking up and getting the GIL and a core)."""
    out = {}
    for name, rows in tl.items():
        out[f"{name}_step_ms"] = statistics.median(r["stages"]["total"] * 1e3 for r in rows)
        out[f"{name}_forward_ms"] = statistics.median(r["forward"][1] - r["forward"][0] for r in rows)
    out["plain_sched_prep_ms"] = statistics.median(1e3 * (r["stages"].get("schedule", 0.0)
                                                          + r["stages"].get("prepare", 0.0)) for r in tl["plain"])
    out["forward_slowdown"] = out["overlap_forward_ms"] / out["plain_forward_ms"]
    # the overlapped main thread's wait ends when it has the forward's result: how long after the forward returned
    late = [r["start"] + 1e3 * (r["stages"]["launch"] + r["stages"]["overlapped"] + r["stages"]["forward"])
            - r["forward"][1] for r in tl["overlap"]]
    out["overlap_handback_ms"] = statistics.median(late)
    # the worker's start delay: from the end of the main thread's launch to the forward really starting (the worker
    # thread waiting for the GIL or a core)
    out["overlap_start_delay_ms"] = statistics.median(
        r["forward"][0] - (r["start"] + 1e3 * r["stages"]["launch"]) for r in tl["overlap"])
    # forward n started only once the main thread had finished scheduling and preparing step n+1: no overlap at all
    out["serial_steps"] = sum(r["forward"][0] >= r["start"] + 1e3 * (r["stages"]["launch"] + r["stages"]["overlapped"])
                              for r in tl["overlap"])
    out["drawn_steps"] = len(tl["overlap"])
    out["overlap_text"] = overlap_text(out["serial_steps"], out["drawn_steps"], out["forward_slowdown"])
    out["step_verdict"] = step_verdict(out)
    met = out["drawn_steps"] - out["serial_steps"]  # steps whose box n+1 and forward n shared some time
    out["overlap_short"] = (f"{'none' if met == 0 else met} of the {out['drawn_steps']} drawn overlapped steps "
                            f"ran box n+1 while forward n ran")
    # is the drawn window clean? Two tests. (a) Each drawn step against the median of the drawn window's own
    # steps: a step over WINDOW_CLEAN_RATIO times the others was interrupted, even when the whole recording was
    # slow. (b) The window's slowest step against the median of all the engine's recorded steps: above
    # WINDOW_CLEAN_RATIO, no `steps` consecutive steps were free of an interruption
    slow, outlier = {}, {}
    for name, rows in tl.items():
        totals = [r["stages"]["total"] * 1e3 for r in rows]
        slow[name] = max(totals) / rows[0].get("recorded_median_ms", float("nan"))
        out[f"{name}_window_slowest_ratio"] = slow[name]
        own = statistics.median(totals)
        n_max = max(range(len(totals)), key=totals.__getitem__)
        others = statistics.median(t for i, t in enumerate(totals) if i != n_max) if len(totals) > 1 else own
        if totals[n_max] > WINDOW_CLEAN_RATIO * own:
            outlier[name] = (n_max, totals[n_max] / others)
    # (c) each drawn box against its engine's median box of that kind over all recorded steps: two slow steps of
    # four lift the window's own median; slowed in different boxes, they leave each box's recorded median low
    boxes = []
    for name, rows in tl.items():
        med, floor = rows[0].get("box_median_ms", {}), BOX_VISIBLE * rows[0].get("recorded_median_ms", 0.0)
        boxes += [(name, n, kind, ms, med[kind]) for n, r in enumerate(rows) for kind, ms in box_ms(name, r).items()
                  if kind in med and ms > BOX_CLEAN_RATIO * med[kind] and ms - med[kind] > floor]
    dirty = [n for n in slow if not slow[n] <= WINDOW_CLEAN_RATIO]
    recorded = tl["plain"][0].get("recorded", len(tl["plain"]))
    out["window_clean"] = not dirty and not outlier and not boxes
    label = {"plain": "plain", "overlap": "overlapped"}
    parts = [f"{label[n]} step {k} took {r:.1f}x the others in its window" for n, (k, r) in outlier.items()]
    if dirty:
        parts.append(" and ".join(f"the {label[n]} engine's window" for n in dirty)
                     + f" holds a step that took {max(slow[n] for n in dirty):.1f}x the median of its engine's "
                     f"{recorded} recorded steps: no four steps in a row were free of such a slow step")
    parts += [f"{label[n]} step {k}'s {kind} box took {ms:.2f} ms against a median of {m:.2f} ms for that box "
              f"over the engine's {recorded} recorded steps" for n, k, kind, ms, m in boxes[:3]]
    if len(boxes) > 3:
        parts.append(f"{len(boxes) - 3} more such box{'es' * (len(boxes) > 4)}")
    out["window_short"] = ("clean: no drawn step or box is an interruption" if out["window_clean"] else
                           f"not clean: a drawn step took over {WINDOW_CLEAN_RATIO:g}x the median of its window "
                           f"or of its engine, or a drawn box over {BOX_CLEAN_RATIO:g}x its engine's median box of "
                           "that kind")
    out["window_text"] = (
        f"both drawn windows are clean: no drawn step took more than {WINDOW_CLEAN_RATIO:g}x the median of its "
        f"window or of its engine's {recorded} recorded steps, and no drawn box more than {BOX_CLEAN_RATIO:g}x its "
        f"engine's median box of that kind (slowest step against the recording: plain "
        f"{slow['plain']:.2f}x, overlapped {slow['overlap']:.2f}x); a recording slowed evenly throughout by the "
        "machine's load would pass this test too"
        if out["window_clean"] else
        "not clean: " + "; ".join(parts) + ". Such a long box is an interruption (the machine's load, or the two "
        "threads competing), not the engine's usual step")
    return out



def draw_timeline(tl: dict, args: Settings, fname: str = "timeline") -> list[plot.Span]:
    """The two engines' steps on a shared time axis, drawn from `timeline_spans`; returns the spans drawn.
    fname "schematic": the rows of `schematic_timeline`, in model units."""
    from matplotlib.patches import Patch

    plt = plot.pyplot()
    spans = timeline_spans(tl)
    palette = plot.colours(["schedule + prepare", "forward", "sample + detokenize", "launch",
                            "waiting for the forward"])
    palette["waiting for the forward"], palette["launch"] = "0.85", "#CC78BC"
    fig, axes = plt.subplots(2, 1, figsize=(11, 3.8), sharex=True)
    for ax, name in zip(axes, tl):
        plot.timeline(ax, [s for s in spans if s.lane.startswith(name)], [f"{name}: main thread", f"{name}: forward"],
                      palette=palette, legend=False)
        what = ("schematic, stage times from a model of an asynchronous device, not measured" if fname == "schematic"
                else f"{args.timeline_batch} sequences decoding")
        ax.set_title(f"{name} engine, {what} (numbers: the step each box works for)", fontsize=9)
    # a launch takes a tiny fraction of a step: draw each one at least 0.6% of the axis wide, over its own box
    x0, x1 = axes[1].get_xlim()
    for ax, name in zip(axes, tl):
        for s in spans:
            if s.kind == "launch" and s.lane == f"{name}: main thread":
                ax.barh(1, max(s.end - s.start, 0.006 * (x1 - x0)), left=s.start, height=0.8,
                        color=palette["launch"], edgecolor="black", linewidth=0.5, zorder=3)
    axes[1].set_xlabel("model time units (a schematic)" if fname == "schematic" else
                       "time (ms) from the first drawn step's start")
    fig.tight_layout()
    # one legend for both engines, naming the boxes too thin to carry a label
    thin = {"launch"} if fname == "schematic" else {"launch", "sample + detokenize"}
    fig.legend(handles=[Patch(facecolor=c, edgecolor="black", label=f"{k} (thin box)" if k in thin else k)
                        for k, c in palette.items()], loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
               frameon=False)
    print(f"figure: {plot.save(fig, args, fname)}")
    return spans


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"num_requests": 6, "batch_sizes": [1, 16], "steps": 6, "rounds": 1})
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model = load_pretrained("small")
    same = same_output(model, args, device)
    print(f"1. {same['requests']} requests ({same['tokens']} tokens, {same['stopped']} stopped on a stop token; "
          f"prompts chunked by a 32-token budget): overlapped == plain, token for token. "
          f"{same['num_reprepared']} of {same['num_steps']} overlapped steps were re-prepared after a stop.")
    ph = placeholder_trace(model, device)
    print(f"   Placeholders, one overlapped decode step of {len(ph['before'])} sequences: while forward n ran, step "
          f"n+1 was prepared with input ids {ph['before']} at positions {ph['positions']} ({PLACEHOLDER}: a token "
          f"not sampled yet); step n sampled {ph['sampled']}, written in before n+1's launch: {ph['after']}.\n")
    rows = [compare(model, B, args, device) for B in args.batch_sizes]
    where = "forward in a worker thread, GIL released inside kernels" if device == "cpu" else "asynchronous launch"
    print(f"2. Decode steps on {device} ({where}; torch threads: {torch.get_num_threads()}); median of "
          f"{args.rounds} alternating rounds of {args.steps} steps; Python's GIL switch interval: "
          f"{sys.getswitchinterval() * 1e3:g} ms")
    print(report.table(rows, floatfmt=".2f"))
    print(f"   {bench.load_average()}")
    print(f"   saved: plain - overlap per step; fwd: the forward as run, in its thread.\n   {noise_legend()}")
    tl = record_timeline(model, args, device)
    schematic = draw_timeline(schematic_timeline(tl), args, "schematic")  # overlap working, modelled: no timing
    spans, summ = draw_timeline(tl, args), timeline_summary(tl)
    print(f"{timeline_line(summ, args.timeline_batch, len(tl['plain']), TIMELINE_TRIES * len(tl['plain']))} "
          f"{bench.load_average()}\n   The drawn window: {summ['window_text']}.\n   This recording's verdict "
          f"(Table 2 timed other steps): {summ['step_verdict']}.")
    if args.json:
        lo, hi = (f(rows, key=lambda r: r["speed-up"]) for f in (min, max))
        speedup_range = {"min": lo["speed-up"], "min_b": lo["B"], "max": hi["speed-up"], "max_b": hi["B"],
                         "text": speedup_words(rows)}
        report.write_json(args.json, {"device": device, "switch_interval_ms": sys.getswitchinterval() * 1e3,
                                      "same_output": same, "placeholders": ph, "timing": rows,
                                      "speedup_range": speedup_range,
                                      "timeline": {**summ, "spans": [vars(s) for s in spans]},
                                      "schematic": {"units": SCHEMATIC, "spans": [vars(s) for s in schematic]},
                                      "load_average": bench.load_average()}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
