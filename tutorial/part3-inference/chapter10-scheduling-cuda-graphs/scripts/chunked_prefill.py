"""Chunked prefill: long prompts split across steps so that the requests already decoding are not starved.

What it shows
    A mixed workload on the real engine: --num-short requests with short prompts decode --short-tokens
    tokens each; every --long-every tokens of theirs a request with a --long-len token prompt arrives. The
    same workload runs under several token budgets (EngineConfig.max_num_batched_tokens). With a budget at
    least as big as a long prompt plus the decodes, the whole prompt is prefilled in one step and every
    decoding request waits for it: one long gap between two of its tokens. With a smaller budget the
    scheduler gives the decodes their token first and the prompt the rest, one chunk per step.
    Printed per budget: ITL (inter-token latency) p50 and p99 of the short requests, TTFT of the long ones,
    steps and throughput; the figure (chunked_prefill/itl.png) shows one short request's gaps over time (a ring
    marks a gap whose step carried a whole prompt, a square one whose step carried a chunk), and a line counts
    its gaps under the smallest budget that lie above twice the plateau (the median gap of a step carrying a
    prompt chunk).
    FIGURE flat_batch.png: what the scheduler put in each step's flat batch (its own SchedulerOutput, recorded
    per step) from just before the first long prompt's arrival to the end of its prefill (12 steps at least;
    the title names them), for the largest and the smallest budget: the decodes' one token each and the
    prompt's chunk, stacked against the budget.
    Time is each engine's own clock: the sum of its step times (Engine.last_step_timing), with the engines
    stepping in turn so that they share the machine's load. The workload runs --repeats times per budget and
    takes the same steps each time, so every step counts with its fastest repeat: on a shared machine one
    interrupted step would otherwise be the p99. Self-check: every request's tokens are identical under every
    budget (chunking changes when work is done, not what is computed).

How to run
    python tutorial/part3-inference/chapter10-scheduling-cuda-graphs/scripts/chunked_prefill.py
    python .../chunked_prefill.py --budgets 512 64 16 --long-len 240

Runtime on 2 idle cores: about 4 s, 4 s with --smoke; on a busy machine (a printed load average above the core
count) up to about load average / cores times that.

Try next
    python tutorial/part3-inference/chapter10-scheduling-cuda-graphs/scripts/chunked_prefill.py --budgets 512 16
        -> a very small budget: the long prompts' TTFT grows further; the decoders' ITL stays below budget 512's
           (whether it shrinks further than at the default smallest budget depends on the run)
    python tutorial/part3-inference/chapter10-scheduling-cuda-graphs/scripts/chunked_prefill.py --long-len 60
        -> short "long" prompts: a whole prefill costs little more than a decode step, and chunking has
           little left to smooth (on a quiet machine: under load one interrupted step can still set the p99)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mlsys import bench, cli, plot, report
from mlsys.data import Tokenizer, make_corpus
from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.weights import load_pretrained


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    budgets: list[int] = field(default_factory=lambda: [512, 128, 64, 32])
    """Token budgets per step (max_num_batched_tokens); the first should hold a whole long prompt (no chunking)."""
    num_short: int = 8
    """Requests with short prompts, decoding from the start."""
    short_tokens: int = 64
    """Tokens each short request generates."""
    num_long: int = 4
    """Requests with long prompts, arriving while the short ones decode."""
    long_len: int = 200
    """Prompt tokens of a long request."""
    long_every: int = 12
    """A long request arrives every this many tokens of the short requests."""
    repeats: int = 3
    """Runs of the workload per budget; each step counts with its fastest repeat (OS noise filtered out)."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu or cuda."""

    def validate(self) -> None:
        if not self.budgets or min(self.budgets) < self.num_short + 1:
            raise cli.UsageError(f"every budget must leave room beyond the {self.num_short} decodes")
        if not 1 <= self.num_short <= 32 or not 0 <= self.num_long <= 16:
            raise cli.UsageError("--num-short must be in 1..32 and --num-long in 0..16")
        if not 8 <= self.short_tokens <= 200 or not 16 <= self.long_len <= 240 or self.long_every < 1:
            raise cli.UsageError("--short-tokens in 8..200, --long-len in 16..240, --long-every >= 1")
        if not 1 <= self.repeats <= 10:
            raise cli.UsageError("--repeats must be in 1..10")
        if self.num_long * self.long_every >= self.short_tokens:
            raise cli.UsageError("the long requests must all arrive before the short ones finish: "
                                 "--num-long * --long-every < --short-tokens")
        if self.device not in ("auto", "cpu", "cuda"):
            raise cli.UsageError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise cli.UsageError("--device cuda: no GPU on this machine")


def make_workload(args: Settings) -> tuple[list[list[int]], list[list[int]]]:
    """Short prompts: <bos> + a record's first 8 characters. Long: long_len ids of the training stream
    (<bos> record <eos> <bos> record ...), each starting at a different record."""
    tok = Tokenizer()
    lines = make_corpus(args.num_short + 6 * args.num_long, seed=args.seed).splitlines()
    short = [[tok.bos_id] + tok.encode(line[:8]) for line in lines[: args.num_short]]
    long = []
    for i in range(args.num_long):
        stream = tok.encode_corpus("\n".join(lines[args.num_short + i :])).tolist()
        long.append(stream[: args.long_len])
    return short, long


# --8<-- [start:itl]
def itl_percentiles(token_times: list[list[float]]) -> dict:
    """Inter-token latency: every gap between consecutive tokens of every request, pooled (ms)."""
    gaps = np.concatenate([np.diff(t) for t in token_times if len(t) > 1]) * 1e3
    return {"itl_p50_ms": float(np.percentile(gaps, 50)), "itl_p99_ms": float(np.percentile(gaps, 99)),
            "itl_max_ms": float(gaps.max())}
# --8<-- [end:itl]


# --8<-- [start:driver]
class Run:
    """One pass of the workload through a fresh engine: what each step emitted, and how long it took."""

    def __init__(self, model, budget: int, args: Settings, device: str):
        cfg = EngineConfig(max_num_seqs=args.num_short + args.num_long, max_num_batched_tokens=budget,
                           device=device)
        self.engine, self.args, self.budget = Engine(model, config=cfg), args, budget
        self.durations: list[float] = []  # seconds of each step (Engine.last_step_timing["total"])
        self.emitted: list[list[tuple[str, int]]] = []  # per step: (request id, new tokens)
        self.arrival_step: dict[str, int] = {}  # request id -> the step it arrived before
        self.tokens: dict[str, list[int]] = {}
        self.next_long = 0
        # per step: what the scheduler put in the flat batch, (request id, tokens, "prefill" or "decode")
        self.schedule: list[list[tuple[str, int, str]]] = []
        self._record_schedule()

    def _record_schedule(self) -> None:
        """Keep a copy of each step's SchedulerOutput (the scheduler itself is unchanged)."""
        scheduler = self.engine.scheduler
        schedule = scheduler.schedule

        def recorded():
            out = schedule()
            self._last = [(seq.request_id, n, "decode" if seq.output_token_ids and n == 1 else "prefill")
                          for seq, n in out.scheduled]
            return out
        scheduler.schedule = recorded

    def add(self, prompt: list[int], max_tokens: int, rid: str) -> None:
        self.engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=rid)
        self.arrival_step[rid] = len(self.durations)

    def step(self, long_prompts: list[list[int]]) -> None:
        progress = len(self.tokens.get("short-0", []))  # tokens of the first short request so far
        while self.next_long < len(long_prompts) and progress >= (self.next_long + 1) * self.args.long_every:
            self.add(long_prompts[self.next_long], 4, f"long-{self.next_long}")  # arrives now
            self.next_long += 1
        outputs = self.engine.step()
        self.schedule.append(self._last)
        self.durations.append(self.engine.last_step_timing["total"])
        self.emitted.append([(out.request_id, len(out.new_token_ids)) for out in outputs])
        for out in outputs:
            self.tokens[out.request_id] = out.token_ids
# --8<-- [end:driver]


# --8<-- [start:clock]
def token_times(run: Run, durations: np.ndarray) -> tuple[dict, dict]:
    """Each request's token times and arrival time on a clock that advances by `durations` per step."""
    clock = np.cumsum(durations)  # time at the end of each step
    times: dict[str, list[float]] = {rid: [] for rid in run.arrival_step}
    for k, emitted in enumerate(run.emitted):
        for rid, n in emitted:
            times[rid] += [float(clock[k])] * n
    arrival = {rid: float(clock[k - 1]) if k else 0.0 for rid, k in run.arrival_step.items()}
    return times, arrival


def summary(runs: list[Run]) -> dict:
    """Repeats of one budget take the same steps (the workload is deterministic), so each step's duration
    is the fastest of its repeats: a step the OS interrupted in one repeat does not count as a stall."""
    first = runs[0]
    assert all(r.emitted == first.emitted for r in runs), "repeats scheduled different steps"
    durations = np.min([r.durations for r in runs], axis=0)  # (steps,)
    times, arrival = token_times(first, durations)
    ttft = [(times[r][0] - arrival[r]) * 1e3 for r in times if r.startswith("long")]
    return {"budget": first.budget, **itl_percentiles([t for r, t in times.items() if r.startswith("short")]),
            "long_ttft_ms": float(np.mean(ttft)) if ttft else 0.0, "steps": len(durations),
            "tok_per_s": sum(len(t) for t in times.values()) / float(durations.sum()), "times": times}
# --8<-- [end:clock]


def drawn_gaps(runs: list[Run]) -> tuple[np.ndarray, np.ndarray]:
    """The drawn request's (short-0's) gaps under one budget, on the same clock as summary(), and for each gap
    whether the step that ended it carried (a chunk of) a long prompt's prefill."""
    first = runs[0]
    clock = np.cumsum(np.min([r.durations for r in runs], axis=0)) * 1e3
    steps = [k for k, emitted in enumerate(first.emitted) for rid, n in emitted if rid == "short-0" for _ in range(n)]
    chunk = {k for k, sched in enumerate(first.schedule)
             if any(rid.startswith("long") and kind == "prefill" for rid, _, kind in sched)}
    return np.diff(clock[steps]), np.array([k in chunk for k in steps[1:]], dtype=bool)


def figure_points(runs: list[Run], factor: float = 2.0) -> dict:
    """The plateau is the median of the drawn request's gaps whose step carried a long prompt's chunk; count the
    gaps above `factor` times it."""
    first = runs[0]
    gaps, on = drawn_gaps(runs)
    on_chunk = gaps[on]
    plateau = float(np.median(on_chunk)) if len(on_chunk) else float(np.median(gaps))
    above = int((gaps > factor * plateau).sum())
    text = ("no point lies" if above == 0 else "1 point lies" if above == 1 else f"{above} points lie")
    return {"budget": first.budget, "gaps": len(gaps), "plateau_ms": plateau, "factor": factor, "above": above,
            "above_text": text, "max_ms": float(gaps.max())}


def serve_all(model, args: Settings, device: str) -> dict[int, list[Run]]:
    """Every budget `repeats` times, all engines stepping in turn: the same machine load for everyone."""
    short, long = make_workload(args)
    runs = [Run(model, b, args, device) for b in args.budgets for _ in range(args.repeats)]
    for run in runs:  # warm-up, not timed: the first prefill and decode of a new engine pay one-off costs
        warm = [long[0][: args.long_len // 2]] if long else []  # a long prefill too, when there are long prompts
        run.engine.generate([*warm, short[0]], SamplingParams(max_tokens=3, ignore_eos=True))
        for i, p in enumerate(short):
            run.add(p, args.short_tokens, f"short-{i}")
    with bench.steady_timing():  # no garbage-collector pass inside a timed step
        while any(r.engine.has_unfinished() for r in runs):
            for run in runs:
                if run.engine.has_unfinished():
                    run.step(long)
    return {b: [r for r in runs if r.budget == b] for b in args.budgets}


def draw(rows: list[dict], whole: list[Run], chunked: list[Run], args: Settings) -> None:
    """The drawn request's gaps under the largest and the smallest budget; under the largest (`whole`'s), a ring
    around each gap whose step carried a whole long prompt, under the smallest (`chunked`'s) a square around each
    gap whose step carried a chunk of one."""
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for row in (rows[0], rows[-1]):
        t = np.array(row["times"]["short-0"])
        # one marker per token, no joining lines: a line would draw a single long gap as a wide triangle
        ax.plot(t[1:] * 1e3, np.diff(t) * 1e3, "o", markersize=3.5, alpha=0.8,
                label=f"budget {row['budget']} tokens/step")
    for row, runs, mark, what in ((rows[0], whole, "o", "a whole prompt"), (rows[-1], chunked, "s", "a prompt chunk")):
        t, ring = np.array(row["times"]["short-0"]), drawn_gaps(runs)[1]
        ax.plot(t[1:][ring] * 1e3, np.diff(t)[ring] * 1e3, mark, markersize=9, markerfacecolor="none", color="black",
                label=f"budget {row['budget']}: a step carrying {what}")
    ax.set(xlabel="engine time (ms)", ylabel="gap before this token (ms)",
           title="inter-token gaps of one short request while long prompts arrive")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)  # outside: it hid points
    print(f"figure: {plot.save(fig, args, 'itl')}")


def batch_window(run: Run, width: int) -> dict:
    """The steps of `run` from the one before the first long prompt arrives, `width` of them: what each step's
    flat batch held, as the scheduler returned it."""
    first = max(0, run.arrival_step.get("long-0", 0) - 1)
    steps = [[list(entry) for entry in step] for step in run.schedule[first : first + width]]
    return {"budget": run.budget, "first_step": first, "steps": steps}


def draw_flat_batches(runs: list[Run], args: Settings, width: int = 12) -> list[dict]:
    """One panel per run: a bar per step, stacked from the scheduler's own output (decodes first, then the
    prompt chunks), against the token budget. Returns what it drew."""
    plt = plot.pyplot()
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    # widen the window to the end of the first long prompt's prefill in every run, one step more
    last = [max((k for k, step in enumerate(r.schedule) for rid, _, kind in step
                 if rid == "long-0" and kind == "prefill"), default=0) for r in runs]
    width = max(width, *(k + 2 - batch_window(r, 0)["first_step"] for k, r in zip(last, runs)))
    drawn = [batch_window(run, width) for run in runs]
    fig, axes = plt.subplots(1, len(drawn), figsize=(5.2 * len(drawn), 3.6), squeeze=False)
    colour, used = {"decode": "C0", "short prefill": "0.75"}, {}
    for ax, d, run in zip(axes[0], drawn, runs):
        for k, step in enumerate(d["steps"]):
            x, bottom = d["first_step"] + k, 0
            for rid, n, kind in step:
                name = "decode" if kind == "decode" else ("short prefill" if rid.startswith("short") else rid)
                c = colour.setdefault(name, f"C{len(colour)}")
                used[name] = c
                ax.bar(x, n, bottom=bottom, color=c, edgecolor="white", linewidth=0.5 if n >= 0.05 * d["budget"] else 0)
                if kind == "prefill" and n >= 0.12 * d["budget"]:
                    ax.text(x, bottom + n / 2, str(n), ha="center", va="center", fontsize=7,
                            bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none",
                                  "alpha": 0.85})
                bottom += n
        ax.axhline(d["budget"], color="black", linestyle="--", linewidth=1)
        a, total = d["first_step"], len(run.schedule)
        ax.set(xlabel="engine step", ylabel="tokens in the step's flat batch",
               title=f"budget {d['budget']} (dashed): steps {a}-{a + len(d['steps']) - 1} of {total}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and tokens are whole numbers
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0][-1].legend(handles=[Patch(color=c, label=f"{n} (prompt chunk)" if n.startswith("long") else n)
                                for n, c in used.items()], fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'flat_batch')}")
    return drawn


def throughput_words(rows: list[dict]) -> str:
    """Where throughput was highest and lowest across the budgets, and how far apart, in words from this run."""
    hi, lo = max(rows, key=lambda r: r["tok_per_s"]), min(rows, key=lambda r: r["tok_per_s"])
    spread = hi["tok_per_s"] / lo["tok_per_s"] - 1
    text = f"was highest with budget {hi['budget']} and lowest with budget {lo['budget']}"
    if spread < 0.1:
        return f"{text}, only {spread:.0%} apart, a gap the machine's load alone can make"
    return f"{text}, {spread:.0%} apart"


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"budgets": [256, 32], "num_short": 4, "short_tokens": 24,
                                                "num_long": 2, "long_len": 96, "long_every": 8, "repeats": 1})
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model = load_pretrained("small")
    by_budget = serve_all(model, args, device)
    ref = by_budget[args.budgets[0]][0]
    for runs in by_budget.values():
        for run in runs:
            for rid, ids in ref.tokens.items():
                report.expect_equal(f"{rid}: tokens with budget {run.budget} vs {ref.budget}", run.tokens[rid], ids)
    rows = [summary(runs) for runs in by_budget.values()]
    print(f"{args.num_short} short requests decoding {args.short_tokens} tokens; {args.num_long} prompts of "
          f"{args.long_len} tokens arriving every {args.long_every} tokens; device {device}; each step timed as "
          f"the fastest of {args.repeats} repeats\n")
    print(report.table([{k: v for k, v in r.items() if k != "times"} for r in rows], floatfmt=".2f"))
    first, last = rows[0], rows[-1]
    print(f"\nITL p99 of the decoding requests: {first['itl_p99_ms']:.1f} ms with budget {first['budget']} "
          f"(whole prompts in one step), {last['itl_p99_ms']:.1f} ms with budget {last['budget']} "
          f"(ratio {first['itl_p99_ms'] / last['itl_p99_ms']:.1f}); the long prompts' TTFT goes from "
          f"{first['long_ttft_ms']:.1f} to {last['long_ttft_ms']:.1f} ms.")
    throughput = throughput_words(rows)
    print(f"Throughput (tok_per_s) {throughput}.")
    print(f"Every request's tokens are identical under every budget. {bench.load_average()}")
    points = figure_points(by_budget[args.budgets[-1]])
    print(f"Figure, budget {points['budget']}: {points['above']} of the drawn request's {points['gaps']} gaps lie "
          f"above {points['factor']:g}x the plateau ({points['plateau_ms']:.2f} ms, the median gap of a step "
          f"carrying a prompt chunk); the longest is {points['max_ms']:.2f} ms.")
    drawn = draw_flat_batches([by_budget[args.budgets[0]][0], by_budget[args.budgets[-1]][0]], args)
    draw(rows, by_budget[args.budgets[0]], by_budget[args.budgets[-1]], args)
    if args.json:
        for r in rows:
            del r["times"]
        report.write_json(args.json, {"device": device, "runs": rows, "flat_batch": drawn, "itl_figure": points,
                                      "throughput_text": throughput, "load_average": bench.load_average()}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
