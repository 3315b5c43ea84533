"""Speculative decoding's wall-clock speed-up against k, with the draft's cost charged per drafted token.

What it shows
    1. The cost model, measured: one target forward over 1 token (a plain decode step), over k+1 tokens (a
       verification), and one draft forward over 1 token. On this CPU these tiny models are dominated by
       per-operator overhead, so the draft's forward costs far more than its 1/7 share of the parameters, and
       a k+1-token verification costs a fraction of k+1 separate 1-token decodes (the run prints each ratio).
    2. For each k: greedy speculative decoding of the same prompts, timed side by side with the target's plain
       greedy decoding (repeats interleaved, the fastest kept, so machine load hits both alike). Reported: acceptance
       rate alpha, tokens per step observed vs (1 - alpha^(k+1)) / (1 - alpha), the speed-up measured, and the
       speed-up the cost model predicts:

           speed-up(k) = E[tokens per step] * c_target(1) / (k * c_draft(1) + c_target(k+1))

       Every run's tokens equal the target's greedy tokens (checked).
    3. A figure: tokens per step and speed-up against k.

How to run
    python tutorial/part3-inference/chapter11-speculative-constrained/scripts/spec_vs_k.py
    python tutorial/part3-inference/chapter11-speculative-constrained/scripts/spec_vs_k.py --ks 1 2 4 8 --repeats 5

Runtime on 2 cores: about 6 s, 5 s with --smoke. Timings are only as good as the machine is idle.

Try next
    python tutorial/part3-inference/chapter11-speculative-constrained/scripts/spec_vs_k.py --ks 1 2 4 8 12 16
        -> larger k: tokens per target forward can grow at most toward 1/(1 - alpha) (with alpha near 1 they
           are still rising at k = 16), while the draft's cost grows in step with k: compare the speed-up column
           with the tokens-per-step column. The timings are noisy on a shared machine: check the load average
           printed under the table, and if it is high, rerun (load during the timed decoding can push every
           measured speed-up below the prediction, even below 1x)
    python tutorial/part3-inference/chapter11-speculative-constrained/scripts/spec_vs_k.py --max-new-tokens 40
        -> shorter answers: fewer steps per run, so the timings are noisier; compare with the cost model
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from mlsys import bench, cli, plot, report
from mlsys.data import Tokenizer, format_record, sample_record
from mlsys.model import generate, num_params
from mlsys.speculative import CachedModel, expected_tokens_per_step, speculative_generate
from mlsys.weights import load_pretrained


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    ks: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8])
    """Draft lengths to time."""
    num_prompts: int = 3
    """Prompts: <bos> and the start of a record; decoding runs on through several records (no <eos> stop)."""
    max_new_tokens: int = 160
    """Tokens generated per prompt."""
    repeats: int = 3
    """Timed repeats per configuration (the fastest is kept)."""

    def validate(self) -> None:
        if not self.ks or not all(1 <= k <= 16 for k in self.ks):
            raise cli.UsageError("--ks must be values in 1..16")
        if self.num_prompts < 1 or self.repeats < 1 or not 8 <= self.max_new_tokens <= 200:
            raise cli.UsageError("--num-prompts, --repeats must be >= 1 and --max-new-tokens in 8..200")


def make_prompts(n: int, seed: int) -> list[list[int]]:
    rng, tok = random.Random(seed + 7), Tokenizer()
    return [tok.encode(format_record(sample_record(rng))[: rng.randint(2, 12)], bos=True) for _ in range(n)]


# --8<-- [start:cost_model]
@torch.no_grad()
def forward_costs(target, draft, ks, context: int = 64, repeats: int = 30) -> dict[str, float]:
    """Seconds of one cached forward after `context` cached tokens: target over 1 and over k+1 new tokens, draft
    over 1. The configurations take turns (round robin) and the fastest repeat is kept: on a shared machine
    load only ever adds time, so the minimum is the least disturbed measurement."""
    configs = {"target 1": (target, 1), "draft 1": (draft, 1), **{f"target {k + 1}": (target, k + 1) for k in ks}}
    cached = {name: CachedModel(model, context + n) for name, (model, n) in configs.items()}
    for c in cached.values():
        c.feed([3] * context)  # any ids: the cost does not depend on them
    best = {name: float("inf") for name in configs}
    with bench.steady_timing():  # no garbage-collector pass inside a timed forward
        for _ in range(repeats):
            for name, (_, n) in configs.items():
                cached[name].rollback(context)
                t0 = time.perf_counter()
                cached[name].feed([3] * n)
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def predicted_speedup(alpha: float, k: int, c_target_1: float, c_target_k1: float, c_draft_1: float) -> float:
    """Tokens per step * the plain cost per token, over the cost of one step (k drafts + one verification)."""
    return expected_tokens_per_step(alpha, k) * c_target_1 / (k * c_draft_1 + c_target_k1)
# --8<-- [end:cost_model]


def time_it(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


# --8<-- [start:side_by_side]
def side_by_side(target, draft, prompts, ks, max_new: int, repeats: int) -> dict:
    """Wall time of plain greedy and of speculative greedy per k: repeats interleaved, the fastest kept."""
    plain_t, spec_t, stats = [], {k: [] for k in ks}, {}
    for _ in range(repeats):
        dt, plain = time_it(lambda: [generate(target, torch.tensor([p]), max_new)[0, len(p):].tolist()
                                     for p in prompts])
        plain_t.append(dt)
        for k in ks:
            dt, outs = time_it(lambda: [speculative_generate(target, draft, p, max_new, k=k) for p in prompts])  # noqa: B023
            spec_t[k].append(dt)
            for o, ref in zip(outs, plain):
                report.expect_equal(f"k={k} tokens", o.token_ids, ref)
            stats[k] = [o.stats for o in outs]
    return {"plain": min(plain_t), "spec": {k: min(v) for k, v in spec_t.items()},
            "stats": stats}
# --8<-- [end:side_by_side]


def draw(rows: list[dict], args: Settings) -> None:
    plt = plot.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ks = [r["k"] for r in rows]
    ax1.plot(ks, [r["tokens/step"] for r in rows], "o-", label="observed")
    ax1.plot(ks, [r["formula"] for r in rows], "x--", label="(1 - a^(k+1)) / (1 - a), measured a")
    ax1.plot(ks, [k + 1 for k in ks], ":", color="gray", label="k + 1 (every draft accepted)")
    ax1.set(xlabel="k (draft tokens per step)", ylabel="tokens per target forward", title="Tokens per step")
    ax1.legend(fontsize=8)
    ax2.plot(ks, [r["speed-up"] for r in rows], "o-", label="measured")
    ax2.plot(ks, [r["predicted"] for r in rows], "x--", label="cost model")
    ax2.axhline(1.0, color="gray", lw=1)
    ax2.set(xlabel="k (draft tokens per step)", ylabel="speed-up over plain greedy", title="Wall-clock speed-up")
    for ax in (ax1, ax2):
        ax.set_xticks(ks)  # k is an integer: one tick per k timed
    ax2.legend(fontsize=8)
    print(f"figure: {plot.save(fig, args, 'spec_vs_k')}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"ks": [1, 4], "num_prompts": 1, "max_new_tokens": 40, "repeats": 1})
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # tiny models: one thread avoids two threads fighting over small matmuls
    target, draft = load_pretrained("small"), load_pretrained("draft")
    prompts = make_prompts(args.num_prompts, args.seed)

    # 1. the cost model
    costs = forward_costs(target, draft, args.ks, repeats=10 if args.smoke else 40)
    c_t1, c_d1 = costs["target 1"], costs["draft 1"]
    c_tk = {k: costs[f"target {k + 1}"] for k in args.ks}
    share = num_params(draft) / num_params(target)
    print(f"1. cost per forward (fastest of the repeats, 64 cached tokens): target 1 token {1e3 * c_t1:.3f} ms, "
          f"draft 1 token {1e3 * c_d1:.3f} ms -> the draft costs {c_d1 / c_t1:.2f} of a target decode step "
          f"(its share of the parameters is {share:.2f})")
    print("   target verification over k+1 tokens: "
          + ", ".join(f"k={k}: {c_tk[k] / c_t1:.2f}x" for k in args.ks) + " of a 1-token step\n")

    # 2. side by side (one untimed warm-up pass of each decoder first)
    side_by_side(target, draft, prompts[:1], args.ks[:1], 8, 1)
    with bench.steady_timing():
        timed = side_by_side(target, draft, prompts, args.ks, args.max_new_tokens, args.repeats)
    num_tokens = len(prompts) * args.max_new_tokens
    rows = []
    for k in args.ks:
        st = timed["stats"][k]
        alpha = sum(s.accepted for s in st) / sum(s.checked for s in st)
        rows.append({"k": k, "alpha": alpha, "tokens/step": sum(s.emitted for s in st) / sum(s.steps for s in st),
                     "formula": expected_tokens_per_step(alpha, k), "tok/s": num_tokens / timed["spec"][k],
                     "speed-up": timed["plain"] / timed["spec"][k],
                     "predicted": predicted_speedup(alpha, k, c_t1, c_tk[k], c_d1)})
    print(f"2. plain greedy: {num_tokens / timed['plain']:.0f} tok/s; speculative greedy (same tokens: checked), "
          f"fastest of {args.repeats}:")
    print("   " + report.table(rows, floatfmt=".3g").replace("\n", "\n   "))
    best = max(rows, key=lambda r: r["speed-up"])
    top = max(rows, key=lambda r: r["predicted"])  # the best k by the prediction, each k at its own measured alpha
    above = sum(r["speed-up"] > r["predicted"] for r in rows)
    print(f"   best measured: k={best['k']}, {best['speed-up']:.2f}x ({best['predicted']:.2f}x predicted); best "
          f"predicted: k={top['k']}, {top['predicted']:.2f}x; measured "
          f"above predicted for {above} of {len(rows)} k; {torch.get_num_threads()} thread, {torch.__version__}, "
          f"{bench.load_average()}")
    slower = [f"k = {r['k']} ({r['speed-up']:.2f}\u00d7)" for r in rows if r["speed-up"] < 1]
    lost = (f"speculation lost time in this run: it was slower than plain decoding at "
            f"{', '.join(slower[:-1]) + ' and ' + slower[-1] if len(slower) > 1 else slower[0]}" if slower else
            "speculation lost no time in this run: every k timed was at least as fast as plain decoding")
    print(f"   {lost}")

    draw(rows, args)
    if args.json:
        results = {"c_target_1": c_t1, "c_draft_1": c_d1, "c_target_k1": c_tk, "rows": rows,
                   "plain_s": timed["plain"], "best_k": best["k"], "best_speedup": best["speed-up"],
                   "best_predicted": best["predicted"], "predicted_best_k": top["k"],
                   "predicted_best": top["predicted"], "draft_cost_ratio": c_d1 / c_t1, "param_share": share,
                   "params_ratio": 1 / share, "measured_above_predicted": above, "num_k": len(rows),
                   "load_average": bench.load_average(), "num_slower": len(slower),
                   "lost": lost[0].upper() + lost[1:], "smallest_k": min(args.ks), "largest_k": max(args.ks),
                   "verify_ratio": {k: c_tk[k] / c_t1 for k in args.ks},
                   "verify_ratio_smallest_k": c_tk[min(args.ks)] / c_t1,
                   "verify_ratio_largest_k": c_tk[max(args.ks)] / c_t1}
        report.write_json(args.json, results, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
