"""Where a decode step's time goes: scheduling, batch preparation, forward, sampling, detokenization.

What it shows
    1. For each batch size B: B requests past their prefill, decoding one token each per step on the real
       engine (mlsys.engine, the trained `small` GPT). Every stage of every step is timed by the engine itself
       (Engine.last_step_timing); the script prints the mean milliseconds per stage over the faster half of
       the steps (on a shared machine the slower ones are those the OS interrupted), the share of the step
       that is NOT the model's forward, and draws them as stacked bars (step_breakdown/breakdown.png).
       Self-check: the stages add up to the step's total (what they leave out is a few counter updates).
       Then the largest batch once more with 200-token prompts (--compare-prompt-len): the line under the table
       compares the share outside the forward at the two prompt lengths (a longer context gives the forward more
       K and V to gather), its direction worded from the two rows.
    2. What a forward is made of, from the PyTorch profiler: how many aten ops one decode step's forward
       dispatches, how many of them are called from Python (each pays the full dispatch), which, and on a GPU
       how many kernels it launches. The count does not depend on B: a bigger batch makes each op bigger,
       not more numerous. That is why small batches are overhead-bound.

How to run
    python tutorial/part3-inference/chapter10-scheduling-cuda-graphs/scripts/step_breakdown.py
    python .../step_breakdown.py --batch-sizes 1 8 64 --steps 30 --device cuda

Runtime on 2 idle cores: about 8 s, 3 s with --smoke; on a busy machine (a printed load average above the core
count) up to about load average / cores times that. Timings move with the machine's load: compare shares, not
absolute milliseconds, across runs.

Try next
    python tutorial/part3-inference/chapter10-scheduling-cuda-graphs/scripts/step_breakdown.py --prompt-len 200
        -> longer contexts at every batch size: compare the `not forward %` column with the default run's, and
           read at which B ms/token was lowest (the summary line); both move with the machine's load
    python tutorial/part3-inference/chapter10-scheduling-cuda-graphs/scripts/step_breakdown.py --threads 2
        -> two torch threads: section 2's op counts stay the same; compare the `forward ms` column, B by B, with
           a default (one-thread) run made just before on the same machine (the summary line's "B 1 -> 64" ratio
           compares batch sizes within one run, not thread counts). With other work on the 2 cores, the second
           thread waits for a core and the load decides the result. The script sets OMP_WAIT_POLICY=PASSIVE
           (unless you set it) so that OpenMP's idle threads sleep instead of spinning on the 2 cores
"""

from __future__ import annotations

import json
import os

# Before `import torch` loads OpenMP, which reads this once: with --threads > 1 OpenMP's idle threads spin
# between ops by default, and on 2 shared cores the spinning takes the core that the thread with work needs
# (the forward then runs many times slower). A user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from mlsys import bench, cli, plot, report
from mlsys.engine.step_profile import (
    STAGES,
    count_ops,
    decode_engine,
    decode_step_inputs,
    mean_breakdown,
    time_decode_steps,
)
from mlsys.weights import load_pretrained


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    """Sequences decoding together in each measured step."""
    prompt_len: int = 32
    """Prompt tokens of every request (its KV cache length when the timed steps start)."""
    steps: int = 20
    """Timed decode steps per batch size (after one warm-up step)."""
    compare_prompt_len: int = 200
    """A second prompt length, timed at the largest batch size only, to compare the share outside the forward
    (0 or equal to --prompt-len: no comparison)."""
    threads: int = 1
    """torch intra-op threads (1: the tiny model's ops are too small to split)."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu or cuda."""

    def validate(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1 or max(self.batch_sizes) > 256:
            raise cli.UsageError("--batch-sizes must be in 1..256")
        if not 2 <= self.prompt_len <= 200 or not 1 <= self.steps <= 50:
            raise cli.UsageError("--prompt-len must be in 2..200 and --steps in 1..50")
        if self.compare_prompt_len and not 2 <= self.compare_prompt_len <= 200:
            raise cli.UsageError("--compare-prompt-len must be 0 or in 2..200")
        if self.threads < 1:
            raise cli.UsageError("--threads must be >= 1")
        if self.device not in ("auto", "cpu", "cuda"):
            raise cli.UsageError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise cli.UsageError("--device cuda: no GPU on this machine")


# --8<-- [start:breakdown]
def breakdown(model, batch_size: int, args: Settings, device: str) -> dict:
    """Mean seconds per stage of `args.steps` pure decode steps with batch_size sequences."""
    engine = decode_engine(model, batch_size, args.prompt_len, max_tokens=args.steps + 2, device=device)
    engine.step()  # warm-up: the first decode step
    with bench.steady_timing():  # no garbage-collector pass inside a timed step
        rows = time_decode_steps(engine, args.steps)
    assert all(r["num_seqs"] == batch_size and r["num_batched_tokens"] == batch_size for r in rows)
    out = mean_breakdown(rows, fastest=0.5)  # the faster half: steps the busy machine did not interrupt
    out["non_forward_share"] = 1 - out["forward"] / out["total"]
    return out
# --8<-- [end:breakdown]


# --8<-- [start:profile]
def forward_ops(model, batch_size: int, args: Settings, device: str) -> dict:
    """Profile the forward of one decode step (the batch prepared beforehand, so only the model is seen)."""
    engine = decode_engine(model, batch_size, args.prompt_len, max_tokens=4, device=device)
    batch = engine.runner.prepare(*decode_step_inputs(engine))
    engine.runner.execute(batch)  # warm-up
    ops = count_ops(lambda: engine.runner.execute(batch))
    out = {"batch_size": batch_size, "aten_ops": ops["aten_ops"], "python_ops": ops["python_ops"]}
    if ops["kernels"] is not None:
        out["cuda_kernels"] = ops["kernels"]
    return {**out, "top": ops["by_name"][:8]}
# --8<-- [end:profile]


def growth_words(a: dict, b: dict) -> str:
    """How the forward changed from row a to row b (b the larger batch), verb and comparison from the values."""
    batch_ratio, forward_ratio = b["batch_size"] / a["batch_size"], b["forward"] / a["forward"]
    span = f"from B = {a['batch_size']} to B = {b['batch_size']} ({batch_ratio:g}x the batch)"
    if forward_ratio < 1:  # more sequences, less time: the smaller batch's row was slowed by the machine, not its work
        return (f"shrank to {forward_ratio:.2f}x {span}, although the batch grew: a larger batch does no less work, "
                f"so the B = {a['batch_size']} row's forward was slowed by the machine's load (an interrupted row)")
    if forward_ratio > 1.1 * batch_ratio:
        how = "faster than the batch"
    elif forward_ratio >= 0.9 * batch_ratio:
        how = "about in proportion to the batch"
    else:
        how = "more slowly than the batch"
    return f"grew {forward_ratio:.2f}x {span}, {how}"


def top_growth(rows: list[dict]) -> dict:
    """How the forward changed between the two largest batch sizes (and, if it shrank there, from the row before),
    and where a token was cheapest, in words derived from this run (the direction at large B changes from run to
    run)."""
    a, b = rows[-2] if len(rows) > 1 else rows[-1], rows[-1]
    text = growth_words(a, b)
    if b["forward"] < a["forward"] and len(rows) > 2:
        text += f"; over two rows, it {growth_words(rows[-3], b)}"
    return {"from": a["batch_size"], "to": b["batch_size"], "batch_ratio": b["batch_size"] / a["batch_size"],
            "forward_ratio": b["forward"] / a["forward"], "text": text, "token_cost_text": token_cost_words(rows)}


def token_cost_words(rows: list[dict]) -> str:
    """Where ms/token was lowest, and whether it fell at every step up to there, in words from this run."""
    per_token = [r["total"] / r["batch_size"] for r in rows]
    sizes = [r["batch_size"] for r in rows]
    best = min(range(len(rows)), key=per_token.__getitem__)
    later = ", and every larger batch paid more per token than that" if best < len(rows) - 1 else ""
    rises, i = [], 0  # stretches of rows before the lowest one where ms/token went up
    while i < best:
        j = i
        while j < best and per_token[j + 1] > per_token[j]:
            j += 1
        if j > i:
            rises.append(f"from B = {sizes[i]} to {sizes[j]}")
        i = max(j, i + 1)
    text = f"was lowest at B = {sizes[best]}"
    if best > 0 and rises:
        text += ", but it did not fall steadily: it rose " + " and ".join(rises) + " in this run"
    elif best > 0:
        text += f", falling from each batch size to the next from B = {sizes[0]} up to it"
    return text + later


def stages_add_up(r: dict) -> dict:
    """Self-check: the stages tile the step; in the median step they leave out only a few counter updates."""
    if not 0 <= r["median_other"] <= 0.02 * r["total"] + 20e-6:
        raise cli.SelfCheckFailed(f"B={r['batch_size']}: stages do not add up to the step: "
                                  f"{r['median_other'] * 1e3:.3f} ms of {r['total'] * 1e3:.3f} ms uncovered")
    return r


def context_words(short: dict, long: dict, short_len: int, long_len: int) -> str:
    """The share outside the forward at one batch size, for two prompt lengths, and which way it went: derived from
    the two rows, since a loaded machine could reverse it."""
    a, b = short["non_forward_share"], long["non_forward_share"]
    if abs(a - b) < 0.02:
        return (f"the share outside the forward stayed about the same, {a:.0%} with {short_len}-token prompts and "
                f"{b:.0%} with {long_len}-token prompts")
    return (f"the share outside the forward {'fell' if b < a else 'rose'} from {a:.0%} with {short_len}-token prompts "
            f"to {b:.0%} with {long_len}-token prompts")


H200_RUN = Path(__file__).resolve().parent.parent / "results" / "h200" / "step_breakdown.json"


def h200_words(here: dict, h200: dict) -> str:
    """This run's B = 1 step and forward against the recorded H200 run's eager ones; the direction from the values."""
    parts = [f"{name} {h200[k] * 1e3:.3f} ms there against {here[k] * 1e3:.3f} ms here, "
             f"{'slower' if h200[k] > here[k] else 'not slower'} on the H200"
             for k, name in (("total", "step"), ("forward", "forward"))]
    return "at B = 1 the recorded eager H200 run's " + "; its ".join(parts)


def draw(rows: list[dict], args: Settings) -> None:
    plt = plot.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    labels = [str(r["batch_size"]) for r in rows]
    bottom = [0.0] * len(rows)
    for stage in STAGES:
        ms = [r[stage] * 1e3 for r in rows]
        axes[0].bar(labels, ms, bottom=bottom, label=stage)
        bottom = [b + m for b, m in zip(bottom, ms)]
    axes[0].set(xlabel="batch size (sequences decoding)", ylabel="ms per decode step", title="one decode step")
    axes[0].legend(fontsize=8)
    axes[1].plot(labels, [100 * r["non_forward_share"] for r in rows], "o-")
    axes[1].set(xlabel="batch size", ylabel="% of the step", ylim=(0, 100),
                title="time outside the model's forward")
    print(f"figure: {plot.save(fig, args, 'breakdown')}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"batch_sizes": [1, 4], "steps": 3})
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model = load_pretrained("small")
    print(f"device {device}, {args.threads} thread(s); every request has a {args.prompt_len}-token prompt; "
          f"mean of the faster half of {args.steps} decode steps per batch size\n")
    rows = [stages_add_up({"batch_size": B, **breakdown(model, B, args, device)}) for B in args.batch_sizes]
    table = [{"B": r["batch_size"], **{f"{s} ms": r[s] * 1e3 for s in STAGES}, "total ms": r["total"] * 1e3,
              "other ms": r["other"] * 1e3, "ms/token": r["total"] * 1e3 / r["batch_size"],
              "not forward %": 100 * r["non_forward_share"]}
             for r in rows]
    print("1. Mean time per stage of one decode step (Engine.last_step_timing)")
    print(report.table(table, floatfmt=".3f"))
    step_growth = rows[-1]["total"] / rows[0]["total"]
    b0, b1 = rows[0]["batch_size"], rows[-1]["batch_size"]
    token_cost_ratio = step_growth / (b1 / b0)  # ms per token at the largest B over ms per token at the smallest
    print(f"   B {b0} -> {b1}: {b1 / b0:g}x the tokens, {step_growth:.2f}x the step time, so a token costs "
          f"{token_cost_ratio:.2f}x as much; {bench.load_average()}")
    top = top_growth(rows)
    print(f"   The forward {top['text']}; ms/token {top['token_cost_text']}")
    compare = None
    if args.compare_prompt_len not in (0, args.prompt_len):  # the stable signal of a longer context: one row more
        other = stages_add_up({"batch_size": b1,
                               **breakdown(model, b1, replace(args, prompt_len=args.compare_prompt_len), device)})
        pair = sorted([(args.prompt_len, rows[-1]), (args.compare_prompt_len, other)], key=lambda p: p[0])
        compare = {"batch_size": b1, "prompt_lens": [pair[0][0], pair[1][0]],
                   "non_forward_shares": [pair[0][1]["non_forward_share"], pair[1][1]["non_forward_share"]],
                   "text": context_words(pair[0][1], pair[1][1], pair[0][0], pair[1][0])}
        print(f"   At B = {b1}, {compare['text']}")
    h200 = None  # the recorded GPU run beside this one: an eager H200 step is not automatically quicker
    recorded = json.loads(H200_RUN.read_text()) if H200_RUN.exists() else None
    same = recorded and all(recorded["settings"][k] == getattr(args, k) for k in ("prompt_len", "threads"))
    if device == "cpu" and rows[0]["batch_size"] == 1 and same:  # only like against like
        h200 = {"text": h200_words(rows[0], recorded["results"]["breakdown"][0])}
        print(f"   Against the GPU: {h200['text']}")
    print("   other = total - the five stages (counter updates, and the OS's interruptions on a busy machine), a "
          "mean like every column so that a row adds up; the self-check holds other's MEDIAN over the same steps "
          "under 2% of the row's total ms plus 20 us instead, since one interrupted step moves a mean, not a median\n")
    draw(rows, args)

    profiles = [forward_ops(model, B, args, device) for B in sorted({min(args.batch_sizes), max(args.batch_sizes)})]
    print("2. One decode step's forward under the PyTorch profiler")
    print(report.table([{k: v for k, v in p.items() if k != "top"} for p in profiles]))
    frequent = ", ".join(f"{name.removeprefix('aten::')} x{n}" for name, n in profiles[0]["top"])
    print(f"   ops called from Python, most frequent: {frequent}")
    p0, p1 = profiles[0], profiles[-1]
    print(f"   B={p0['batch_size']}: {p0['python_ops']} ops called from Python per step; B={p1['batch_size']}: "
          f"{p1['python_ops']}. The count of ops called from Python is set by the model's depth, not by "
          "the batch.")
    if args.json:
        report.write_json(args.json, {"device": device, "breakdown": rows, "forward_ops": profiles,
                                      "step_growth": step_growth, "token_cost_ratio": token_cost_ratio,
                                      "top_growth": top, "context": compare, "h200": h200,
                                      "load_average": bench.load_average()}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
