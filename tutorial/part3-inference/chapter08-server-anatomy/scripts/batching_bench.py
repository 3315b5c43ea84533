"""Static vs continuous batching on the same seeded workload: throughput, TTFT, TPOT and ITL.

What it shows
    A workload of requests with mixed prompt and output lengths (most answers short, a few long, as in chat
    traffic), served twice by the same engine and weights. By default every request arrives at t = 0 (vLLM's
    benchmark default, --request-rate inf): throughput is a property of the server only while it is saturated;
    with --request-rate R they arrive over time as a Poisson process; at a rate a server keeps up with, its
    "throughput" mostly measures the arrival rate, while TTFT and ITL still tell the schedulers apart.
      static      a batch is formed when the engine is empty and runs until its LAST request finishes;
                  requests that arrive meanwhile wait, and finished requests leave empty seats behind;
      continuous  the batch is re-formed every step (Orca's iteration-level scheduling): a finished
                  request leaves at once and a waiting one takes its seat in the next step.
    Each scheduler serves the workload --repeats times (alternating static and continuous, the garbage
    collector held off while they run); the summary of each scheduler's fastest run (the least disturbed by
    other processes) is printed side by side: vLLM benchmark_serving's throughput, TTFT, TPOT and ITL numbers,
    the number of engine steps and how many sequences each held, with the better scheduler named in each row
    only where every run of one beat every run of the other ("within noise" where the runs overlap, "tie"
    where the two values print the same; --vllm-layout prints the full blocks in vLLM's layout). A
    figure shows how many sequences each step ran (static dashed, drawn over continuous), with a dotted line at
    the number of long answers in the workload.
    Every request must complete with exactly its max_tokens tokens, the greedy tokens must not depend on the
    scheduler, and every KV block must be free afterwards (self-checks, exit 1 otherwise).
    The loop is real: between arrivals with nothing to compute it waits for the next arrival; it never sleeps
    in place of work.

How to run
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/batching_bench.py
    python .../batching_bench.py --request-rate 40 --repeats 2   # Poisson arrivals: a latency view

Runtime on 2 idle cores: about 10 s (3 runs of each scheduler), 4 s with --smoke (two to five times that on a
busy machine).

Try next
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/batching_bench.py --long-fraction 0
        -> no long answers: static batches drain evenly, and the gap between the schedulers closes or reverses
           (static batching may now win rows: with answers of similar length, 4-24 tokens, it wastes few seats)
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/batching_bench.py --max-num-batched-tokens 2048
        -> a bigger token budget: the first step admits all 32 seats at once, not only those the default budget fits
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/batching_bench.py --request-rate 10 --repeats 1
        -> slow arrivals: both servers keep up, throughput just tracks the arrival rate, TTFT tells them apart
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from mlsys import bench, cli, plot, report
from mlsys.data import make_corpus
from mlsys.engine import Engine, EngineConfig, RequestOutput, SamplingParams
from mlsys.serving_metrics import format_summary, serving_summary
from mlsys.weights import load_pretrained


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    num_requests: int = 96
    """Requests in the workload."""
    request_rate: float = math.inf
    """Mean arrivals per second (Poisson process); inf (the default) sends everything at t = 0."""
    prompt_min: int = 8
    """Shortest prompt, in characters of a JSON record (+1 for <bos>)."""
    prompt_max: int = 56
    """Longest prompt, in characters."""
    short_max: int = 24
    """Short answers: max_tokens drawn uniformly from 4..short_max."""
    long_min: int = 120
    """Long answers: max_tokens drawn uniformly from long_min..long_max."""
    long_max: int = 190
    """Upper end of the long answers (prompt_max + 1 + long_max must fit the model's 256 positions)."""
    long_fraction: float = 0.15
    """Fraction of requests with a long answer."""
    max_num_seqs: int = 32
    """Seats in the batch (EngineConfig.max_num_seqs), the same for both schedulers."""
    max_num_batched_tokens: int = 512
    """Token budget of one step (EngineConfig.max_num_batched_tokens): prefill chunks plus decode tokens."""
    repeats: int = 3
    """Runs of each scheduler; the fastest one is reported."""
    vllm_layout: bool = False
    """Also print each scheduler's summary in the layout of vLLM's benchmark_serving."""
    threads: int = 1
    """torch intra-op threads. 1: the tiny model's matrices are too small to split, extra threads only wait."""

    def validate(self) -> None:
        if min(self.num_requests, self.max_num_seqs, self.max_num_batched_tokens, self.repeats, self.threads) < 1:
            raise cli.UsageError("--num-requests, --max-num-seqs, --max-num-batched-tokens, --repeats and --threads "
                                 "must be at least 1")
        if not self.request_rate > 0:
            raise cli.UsageError(f"--request-rate must be positive (or inf), got {self.request_rate}")
        if not 1 <= self.prompt_min <= self.prompt_max:
            raise cli.UsageError("need 1 <= --prompt-min <= --prompt-max")
        if self.short_max < 4 or not 1 <= self.long_min <= self.long_max:
            raise cli.UsageError("need --short-max >= 4 and 1 <= --long-min <= --long-max")
        if self.prompt_max + 1 + max(self.long_max, self.short_max) > 256:
            raise cli.UsageError("prompt_max + 1 + the longest answer exceeds the model's 256 positions")
        if not 0 <= self.long_fraction <= 1:
            raise cli.UsageError(f"--long-fraction must lie in [0, 1], got {self.long_fraction}")


@dataclass
class WorkItem:
    request_id: str
    arrival: float  # seconds after the start of the run
    prompt: str
    max_tokens: int


# --8<-- [start:workload]
def make_workload(args: Settings) -> list[WorkItem]:
    """Seeded: prompts are record prefixes, answers mostly short with a long tail, Poisson arrivals."""
    rng = random.Random(args.seed)
    records = make_corpus(args.num_requests, seed=args.seed).splitlines()
    t, items = 0.0, []
    for i, record in enumerate(records):
        if math.isfinite(args.request_rate):
            t += rng.expovariate(args.request_rate)  # exponential gaps = a Poisson process
        prompt = record[: rng.randint(args.prompt_min, args.prompt_max)]
        long = rng.random() < args.long_fraction
        n = rng.randint(args.long_min, args.long_max) if long else rng.randint(4, args.short_max)
        items.append(WorkItem(f"req-{i}", t, prompt, n))
    return items
# --8<-- [end:workload]


# --8<-- [start:loop]
def serve_workload(engine: Engine, workload: list[WorkItem]) -> dict:
    """Feed requests at their arrival times and step the engine; returns outputs and a per-step trace."""
    pending = deque(sorted(workload, key=lambda w: w.arrival))
    finals: dict[str, RequestOutput] = {}
    steps = []  # (seconds since start, sequences in the step, tokens in the step)
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0].arrival <= now:  # everything that has arrived joins the queue
            w = pending.popleft()
            params = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True)  # fixed lengths, like the benchmark
            engine.add_request(w.prompt, params, request_id=w.request_id, arrival_time=start + w.arrival)
        if not engine.has_unfinished():
            time.sleep(pending[0].arrival - now)  # idle: no work exists until the next request arrives
            continue
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        timing = engine.last_step_timing
        steps.append((time.perf_counter() - start, timing["num_seqs"], timing["num_batched_tokens"]))
    return {"finals": finals, "steps": steps, "duration": time.perf_counter() - start}
# --8<-- [end:loop]


def run_mode(model, scheduling: str, workload: list[WorkItem], args: Settings) -> dict:
    """Serve the workload once with a fresh engine (warmed up on a slice of the workload first)."""
    engine = Engine(model, config=EngineConfig(scheduling=scheduling, max_num_seqs=args.max_num_seqs,
                                               max_num_batched_tokens=args.max_num_batched_tokens))
    warm = workload[: args.max_num_seqs]  # first calls of each shape are slow: not part of the measurement
    engine.generate([w.prompt for w in warm], SamplingParams(max_tokens=4, ignore_eos=True))
    result = serve_workload(engine, workload)
    check_run(engine, workload, result["finals"], scheduling)
    records = [{"arrival": f.metrics.arrival_time, "token_times": f.metrics.token_times,
                "prompt_len": len(f.prompt_token_ids)} for f in result["finals"].values()]
    result["summary"] = serving_summary(records, result["duration"])
    result["num_steps"] = len(result["steps"])
    result["mean_seqs_per_step"] = float(np.mean([s[1] for s in result["steps"]]))
    result["first_step_seqs"] = result["steps"][0][1]
    return result


def fastest_runs(model, workload: list[WorkItem], args: Settings) -> tuple[dict, dict]:
    """Each scheduler `repeats` times, alternating so that a slow spell of the machine hits both; returns the
    fastest run of each, and per scheduler every run's duration and scored metrics (the spread of the runs)."""
    runs: dict[str, list[dict]] = {"static": [], "continuous": []}
    with bench.steady_timing():  # no garbage-collector pause inside a run
        for _ in range(args.repeats):
            for mode in runs:
                runs[mode].append(run_mode(model, mode, workload, args))
    best = {mode: min(rs, key=lambda r: r["duration"]) for mode, rs in runs.items()}
    every = {mode: [{"duration_s": r["duration"], **{key: r["summary"][key] for key, _, better in ROWS if better}}
                    for r in rs] for mode, rs in runs.items()}
    return best, every


# (key, label, which is better): the rows of the side-by-side table
ROWS = [("request_throughput", "request throughput (req/s)", "higher"),
        ("output_throughput", "output throughput (tok/s)", "higher"),
        ("median_ttft_ms", "median TTFT (ms)", "lower"), ("p99_ttft_ms", "p99 TTFT (ms)", "lower"),
        ("mean_tpot_ms", "mean TPOT (ms)", "lower"), ("median_itl_ms", "median ITL (ms)", "lower"),
        ("p99_itl_ms", "p99 ITL (ms)", "lower"), ("num_steps", "engine steps", None),
        ("mean_seqs_per_step", "mean sequences per step", None)]


DECIMALS = 2  # the table prints every value with this many decimals, and judges the rows at that precision


NOISE = "within noise"


def comparison(results: dict, runs: dict | None = None) -> list[dict]:
    """One row per metric, the values of each scheduler's fastest run; "better" names the scheduler that did
    better, "tie" when the two values print the same, NOISE when the runs of the two overlap (the lowest value
    of one lies at or below the highest of the other: every run of a winner must beat every run of the other),
    "-" for the rows that are listed but not scored. runs: {mode: [{metric: value} per run]}."""
    rows = []
    for key, label, better in ROWS:
        s, c = (results[m]["summary"].get(key, results[m].get(key)) for m in ("static", "continuous"))
        if better is None:
            winner = "-"
        elif f"{s:.{DECIMALS}f}" == f"{c:.{DECIMALS}f}":  # equal as printed: naming a winner would be noise
            winner = "tie"
        else:
            sv, cv = ([r[key] for r in runs[m]] if runs else [v] for m, v in (("static", s), ("continuous", c)))
            if min(sv) <= max(cv) and min(cv) <= max(sv):  # the two ranges of runs overlap
                winner = NOISE
            else:
                winner = "continuous" if (c > s) == (better == "higher") else "static"
        rows.append({"metric": key, "label": label, "static": s, "continuous": c, "better": winner})
    return rows


def throughput_sentence(rows: list[dict], runs: dict) -> tuple[str, str]:
    """The lesson's clause on continuous batching's output throughput, from the output throughput row and the
    runs' range -> (the sentence, a short form for the Recap)."""
    row = next(r for r in rows if r["metric"] == "output_throughput")
    ratio = row["continuous"] / row["static"]
    values = {m: [r["output_throughput"] for r in rs] for m, rs in runs.items()}
    span = ", ".join(f"{m} {min(v):.0f} to {max(v):.0f}" for m, v in values.items()) + " tokens per second"
    head = f"continuous batching's output throughput was {ratio:.2f}× the static one"
    if row["better"] == "continuous":
        return (f"{head} and higher in every run ({span})", "higher throughput in every run")
    if row["better"] == "static":
        return (f"{head} and lower in every run ({span})", "lower throughput in every run")
    if row["better"] == "tie":
        return f"{head}: a tie", "the same throughput"
    return (f"{head} by the fastest runs, but that is {NOISE}: the runs of the two overlapped ({span})",
            f"throughput {NOISE}")


def win_counts(rows: list[dict]) -> dict:
    """The scored rows each scheduler won, and the ties; static_won_sentence is the lesson's sentence on the
    rows static batching won (a tie or a row within noise counts for neither)."""
    def names(who: str) -> str:
        return ", ".join(r["label"] for r in rows if r["better"] == who) or "none"
    won = [r["label"].split(" (")[0] for r in rows if r["better"] == "static"]  # "mean TPOT (ms)" -> "mean TPOT"
    scored = sum(r["better"] in ("static", "continuous", "tie", NOISE) for r in rows)
    if not won:
        sentence = f"static batching won none of the {scored} rows the script scores"
    else:
        listed = won[0] if len(won) == 1 else f"{', '.join(won[:-1])} and {won[-1]}"
        sentence = (f"static batching won {len(won)} of the {scored} rows the script scores: the {listed} "
                    f"row{'s' if len(won) > 1 else ''}")
    return {"continuous_wins": sum(r["better"] == "continuous" for r in rows),
            "static_wins": len(won), "static_won": names("static"), "ties": names("tie"), "noise": names(NOISE),
            "static_won_sentence": sentence}


WAITED = 2.0  # a static median TTFT this many times the continuous one or more: half the arrivals waited


def median_verdict(results: dict) -> str:
    """The lesson's sentence on the static median TTFT. The continuous median is the yardstick of an arrival that
    did not wait for a batch to drain (the same prefill, admitted at the next step): a static median at least
    WAITED times it says that at least half the arrivals waited behind a running batch; one below says that at
    least half got their first token within that factor of the continuous median. The p99 alone says nothing
    about the median arrival (a median far below its p99 can still be many steps long)."""
    s, c = (results[m]["summary"] for m in ("static", "continuous"))
    med, cmed, p99 = s["median_ttft_ms"], c["median_ttft_ms"], s["p99_ttft_ms"]
    if med >= WAITED * cmed:
        return (f"static batching's median TTFT ({med:.1f} ms) is {med / cmed:.1f}× the continuous one "
                f"({cmed:.1f} ms), so at least half the arrivals waited behind a running batch (static p99: "
                f"{p99:.1f} ms)")
    return (f"static batching's median TTFT ({med:.1f} ms) is under {WAITED:g}× the continuous one "
            f"({cmed:.1f} ms), so at least half the arrivals got their first token within {WAITED:g}× the "
            f"continuous median; the long waits behind a running batch are in the slower half "
            f"(p99 {p99:.1f} ms)")


def wait_verdict(results: dict, better: str | None = None) -> str:
    """The lesson's sentence on the Poisson run, from the p99 TTFT row (better: its `better` column) and the two
    runs' durations: did static batching make arrivals wait, and did it fall behind the arrivals (a run that
    lasts longer)?"""
    s, c = results["static"], results["continuous"]
    ts, tc = s["summary"]["p99_ttft_ms"], c["summary"]["p99_ttft_ms"]
    if f"{ts:.{DECIMALS}f}" == f"{tc:.{DECIMALS}f}":
        ttft = "the p99 TTFT row is a tie"
    elif better == NOISE:
        ttft = f"the p99 TTFT row is {NOISE}: the runs of the two schedulers overlapped"
    elif ts > tc:
        ttft = (f"the p99 TTFT row shows static batching making arrivals wait ({ts / tc:.1f}× the continuous "
                "p99): a request that arrives while a static batch runs waits for it to drain")
    else:
        ttft = "the p99 TTFT row is lower under static batching, for once"
    ds, dc = s["duration"], c["duration"]
    if abs(ds / dc - 1) < 0.1:
        run = (f"Yet the two runs lasted within about {abs(ds / dc - 1):.0%} of each other, so "
               "neither server fell far behind the arrivals: the wait comes from requests caught behind a "
               "running batch, not from a growing queue")
    elif ds > dc:
        run = (f"The static run lasted {ds / dc:.2f}× as long as the continuous one: it fell behind the "
               "arrivals and had a backlog to work off")
    else:
        run = f"The continuous run lasted {dc / ds:.2f}× as long as the static one"
    return f"{ttft}. {run}"


def check_run(engine: Engine, workload: list[WorkItem], finals: dict, scheduling: str) -> None:
    report.expect_equal(f"{scheduling}: requests completed", len(finals), len(workload))
    for w in workload:
        out = finals[w.request_id]
        if len(out.token_ids) != w.max_tokens or out.finish_reason != "length":
            raise cli.SelfCheckFailed(f"{scheduling}: {w.request_id} produced {len(out.token_ids)} tokens "
                                      f"({out.finish_reason}), expected {w.max_tokens}")
    stats = engine.stats()
    report.expect_equal(f"{scheduling}: KV blocks in use after the run", stats["num_used_blocks"], 0)
    engine.check_invariants()


def draw(results: dict, args: Settings, n_long: int) -> None:
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for mode, res in results.items():
        t = [s[0] for s in res["steps"]]
        # static dashed and on top: where the two lines coincide (the first steps), both stay visible
        style = {"ls": "--", "lw": 1.4, "zorder": 3} if mode == "static" else {"lw": 1.2, "zorder": 2}
        ax.step(t, [s[1] for s in res["steps"]], where="post", label=f"{mode} ({res['duration']:.1f} s)", **style)
    if n_long:  # once the queue is empty and the short answers are done, only the long answers are left
        ax.axhline(n_long, color="0.5", ls=":", lw=1, label=f"the workload's {n_long} long answers")
    ax.set_xlabel("time since the first arrival (s)")
    ax.set_ylabel("sequences in the step")
    arrivals = f"{args.request_rate:g} req/s Poisson" if math.isfinite(args.request_rate) else "all at t = 0"
    ax.set_title(f"{args.num_requests} requests, {arrivals}, {args.max_num_seqs} seats")
    # outside the axes, to the right: inside, it would cover the continuous line's plateau at the top left
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    print(f"figure: {plot.save(fig, args, 'batch_occupancy')}")


# the tiny run of the seats animation: (prompt characters, max_tokens) per request
SEAT_DEMO = [(8, 3), (10, 8), (5, 2), (7, 4), (9, 3), (6, 5), (4, 2)]
SEAT_DEMO_SEATS, SEAT_DEMO_BUDGET = 4, 12


def seat_demo(model, scheduling: str) -> tuple[list[list[tuple[str, int]]], list[list[str]]]:
    """Serve SEAT_DEMO (all at t = 0) -> per step, the scheduler's own (request id, tokens computed) list, and
    the requests holding a seat in that step (its running list: static batching seats a whole batch at once,
    also the members the step's token budget cannot serve yet)."""
    engine = Engine(model, config=EngineConfig(scheduling=scheduling, max_num_seqs=SEAT_DEMO_SEATS,
                                               max_num_batched_tokens=SEAT_DEMO_BUDGET))
    records = make_corpus(len(SEAT_DEMO), seed=0).splitlines()
    for i, (chars, n) in enumerate(SEAT_DEMO):
        engine.add_request(records[i][:chars], SamplingParams(max_tokens=n, ignore_eos=True), request_id=f"r{i}")
    steps, seated, schedule = [], [], engine.scheduler.schedule

    def recorded():
        out = schedule()
        steps.append([(s.request_id, n) for s, n in out.scheduled])
        seated.append([s.request_id for s in engine.scheduler.running])
        return out

    engine.scheduler.schedule = recorded
    while engine.has_unfinished():
        engine.step()
    return steps, seated


def seat_cells(steps: list[list[tuple[str, int]]], seats: int, prompt_len: dict[str, int],
               seated: list[list[str]] | None = None) -> list[dict]:
    """Give every request a seat (the lowest free one when it is first seated, or else first scheduled; it keeps
    it until it is last scheduled): one cell per (step, seat) that computed tokens, a prefill chunk while the
    request's computed tokens are still short of its prompt, a decode after; and a "wait" cell (0 tokens) for a
    request that holds its seat in a step that computes nothing for it."""
    last = {rid: i for i, step in enumerate(steps) for rid, _ in step}
    seat_of, done, cells = {}, dict.fromkeys(last, 0), []
    for i, step in enumerate(steps):
        computed = dict(step)
        for rid in [*(seated[i] if seated else []), *computed]:
            if rid not in seat_of:
                taken = {s for r, s in seat_of.items() if last[r] >= i}
                seat_of[rid] = min(set(range(seats)) - taken)
        for rid in seated[i] if seated else []:
            if rid not in computed:
                cells.append({"step": i, "seat": seat_of[rid], "request_id": rid, "tokens": 0, "kind": "wait"})
        for rid, n in step:
            kind = "prefill" if done[rid] < prompt_len[rid] else "decode"
            cells.append({"step": i, "seat": seat_of[rid], "request_id": rid, "tokens": n, "kind": kind})
            done[rid] += n
    return cells


def draw_seats(runs: dict[str, list], seated: dict[str, list], args: Settings) -> dict[str, list[dict]]:
    """Animation, one frame per engine step: the seats of both schedulers filled up to that step, one colour per
    request, each prefill chunk labelled with its size, a seat held by a request that computes nothing in that
    step pale and labelled "wait". One image per panel, recoloured per frame (cheap)."""
    plt = plot.pyplot()
    from matplotlib.collections import PolyCollection

    prompt_len = {f"r{i}": chars + 1 for i, (chars, _) in enumerate(SEAT_DEMO)}  # + <bos>
    cells = {mode: seat_cells(steps, SEAT_DEMO_SEATS, prompt_len, seated[mode]) for mode, steps in runs.items()}
    frames = min(16, max(map(len, runs.values())))
    colour = {f"r{i}": np.array(plt.cm.tab10(i)[:3]) for i in range(len(SEAT_DEMO))}
    fig, axes = plt.subplots(2, 1, figsize=(9.0, 5.0))
    images, labels, titles = {}, {}, {}
    for ax, (mode, cs) in zip(axes, cells.items()):
        images[mode] = ax.add_collection(PolyCollection(
            [[(x, y), (x + 1, y), (x + 1, y + 1), (x, y + 1)] for y in range(SEAT_DEMO_SEATS) for x in range(frames)],
            facecolors="white", edgecolors="white", linewidths=1))
        labels[mode] = [(c, ax.text(c["step"] + 0.5, c["seat"] + 0.5,
                                    f"P{c['tokens']}" if c["kind"] == "prefill" else "wait", ha="center",
                                    va="center", fontsize=11 if c["kind"] == "prefill" else 9,
                                    color="white" if c["kind"] == "prefill" else "0.3", weight="bold"))
                        for c in cs if c["kind"] in ("prefill", "wait") and c["step"] < frames]
        ax.set(yticks=[k + 0.5 for k in range(SEAT_DEMO_SEATS)], xticks=range(frames + 1),
               yticklabels=[f"seat {k}" for k in range(SEAT_DEMO_SEATS)])
        ax.set(xlim=(0, frames), ylim=(SEAT_DEMO_SEATS, 0))
        ax.grid(False)
        ax.tick_params(labelsize=11)
        # a placeholder as long as the real titles, so that tight_layout leaves room for them
        titles[mode] = ax.set_title(f"{mode}: step {frames}, {SEAT_DEMO_BUDGET} of {SEAT_DEMO_BUDGET} tokens in the "
                                    "flat batch", fontsize=12)
    axes[0].tick_params(labelbottom=False)
    axes[1].set_xlabel("engine step  (Pn: n prompt tokens prefilled;  plain: one decode token;  "
                       "wait: seated, computes nothing)", fontsize=10)
    from matplotlib.patches import Patch
    fig.legend(handles=[Patch(color=colour[r], label=f"request {r}") for r in colour], loc="center right",
               fontsize=11, frameon=False)
    fig.tight_layout(rect=(0, 0, 0.84, 1))

    def draw(f: int) -> None:
        for mode, cs in cells.items():
            img = np.ones((SEAT_DEMO_SEATS, frames, 3))
            for c in cs:
                if c["step"] <= f and c["step"] < frames:
                    faded = 1.0 if c["step"] == f else 0.45  # the current step in full colour
                    faded *= 0.3 if c["kind"] == "wait" else 1.0  # a seat held, nothing computed: pale
                    img[c["seat"], c["step"]] = 1 - faded * (1 - colour[c["request_id"]])
            images[mode].set_facecolors(img.reshape(-1, 3))
            for c, text in labels[mode]:
                text.set_visible(c["step"] <= f)
            used = sum(c["tokens"] for c in cs if c["step"] == f)  # a wait cell adds 0
            titles[mode].set_text(f"{mode}: step {f}, {used} of {SEAT_DEMO_BUDGET} tokens in the flat batch"
                                  if f < len(runs[mode]) else f"{mode}: finished after {len(runs[mode])} steps")

    gif, strip = plot.animate(fig, draw, frames, args, "seats", fps=1.0, strip_columns=3, dpi=100)
    print(f"figure: {gif}\nfigure: {strip}")
    return cells


def main() -> None:
    args = cli.parse(Settings, __doc__, smoke={"num_requests": 16, "request_rate": 200.0, "prompt_max": 24,
                                               "short_max": 8, "long_min": 24, "long_max": 32,
                                               "long_fraction": 0.25, "max_num_seqs": 8, "repeats": 1})
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model = load_pretrained("small")
    seats, seat_cells_drawn = {}, {}
    if not math.isfinite(args.request_rate):  # the seats picture is drawn once, with the default (saturated) run
        demo = {mode: seat_demo(model, mode) for mode in ("static", "continuous")}
        seats = {mode: steps for mode, (steps, _) in demo.items()}
        seat_cells_drawn = draw_seats(seats, {mode: held for mode, (_, held) in demo.items()}, args)
        print(f"seats demo: {len(SEAT_DEMO)} requests, {SEAT_DEMO_SEATS} seats, {SEAT_DEMO_BUDGET} tokens per step: "
              f"static {len(seats['static'])} steps, continuous {len(seats['continuous'])} steps\n")
    workload = make_workload(args)
    n_long = sum(w.max_tokens >= args.long_min for w in workload)
    arrivals = f"over {workload[-1].arrival:.2f} s (Poisson, {args.request_rate:g}/s)" if math.isfinite(
        args.request_rate) else "all at t = 0"
    answers = f"answers 4-{args.short_max} tokens" + (
        f" ({len(workload) - n_long}) or {args.long_min}-{args.long_max} ({n_long})" if n_long else "")
    print(f"workload: {len(workload)} requests {arrivals}, "
          f"prompts {args.prompt_min}-{args.prompt_max} chars, {answers}; {args.max_num_seqs} seats\n")
    results, every = fastest_runs(model, workload, args)
    durations = {mode: [r["duration_s"] for r in rs] for mode, rs in every.items()}
    rows = comparison(results, every)
    if args.vllm_layout:
        for mode, r in results.items():
            print(format_summary(r["summary"], title=f"{mode} batching") + "\n")
    print(f"fastest of {args.repeats} runs per scheduler (durations: "
          + "; ".join(f"{m} " + ", ".join(f"{d:.2f}" for d in ds) + " s" for m, ds in durations.items())
          + f"), {bench.load_average()}")
    print(report.table([{"": r["label"], "static": r["static"], "continuous": r["continuous"], "better": r["better"]}
                        for r in rows], floatfmt=f".{DECIMALS}f"))
    print(f"better: the scheduler whose every run beat every run of the other; {NOISE}: their runs overlapped; "
          "tie: the values print the same")
    same = sum(results["static"]["finals"][w.request_id].token_ids == results["continuous"]["finals"][
        w.request_id].token_ids for w in workload)
    report.expect_equal("greedy outputs identical under both schedulers", same, len(workload))
    s, c = results["static"], results["continuous"]
    ratio = c["summary"]["output_throughput"] / s["summary"]["output_throughput"]
    steps_ratio = s["num_steps"] / c["num_steps"]
    print(f"\ngreedy outputs identical under both schedulers: {same}/{len(workload)}")
    gain, gain_short = throughput_sentence(rows, every)
    print(f"engine steps for the same work: static {s['num_steps']}, continuous {c['num_steps']} "
          f"(static took {steps_ratio:.2f}x as many); {gain}")
    first = s["first_step_seqs"]
    print(f"first step: static ran {first} sequence{'s' * (first != 1)}, continuous {c['first_step_seqs']} "
          f"(token budget {args.max_num_batched_tokens} per step, {args.max_num_seqs} seats)")
    draw(results, args, n_long)
    if args.json:
        out = {mode: {**r["summary"], "num_steps": r["num_steps"], "mean_seqs_per_step": r["mean_seqs_per_step"],
                      "first_step_seqs": r["first_step_seqs"], "durations_s": durations[mode], "runs": every[mode]}
               for mode, r in results.items()}
        span = workload[-1].arrival
        out.update(rows=rows, better={r["metric"]: r["better"] for r in rows}, **win_counts(rows),
                   wait_verdict=wait_verdict(results, next(r["better"] for r in rows if r["metric"] == "p99_ttft_ms")),
                   median_verdict=median_verdict(results), throughput_sentence=gain, throughput_short=gain_short,
                   compared_rows=sum(better is not None for *_, better in ROWS),
                   throughput_ratio=ratio, steps_ratio=steps_ratio,
                   fewer_steps="continuous" if c["num_steps"] < s["num_steps"] else "static",
                   identical_outputs=same, num_requests=len(workload), num_long=n_long, arrival_span_s=span,
                   offered_rate=len(workload) / span if span > 0 else None,
                   max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                   seat_demo={"requests": SEAT_DEMO, "seats": SEAT_DEMO_SEATS, "budget": SEAT_DEMO_BUDGET,
                              "static_steps": len(seats.get("static", [])),
                              "continuous_steps": len(seats.get("continuous", [])),
                              "steps": seats, "cells": seat_cells_drawn},
                   load_average=bench.load_average())
        report.write_json(args.json, out, args)

if __name__ == "__main__":
    cli.run(main)
