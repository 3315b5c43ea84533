"""PPO with a critic vs GRPO's group baseline, on the same task, prompts and sampling seeds, measured side by side.

What it shows
    PPO (rlhf_loop.py) learns a critic V(s_t) and turns KL-shaped per-token rewards into advantages with GAE.
    GRPO ("DeepSeekMath", arXiv:2402.03300) drops the critic: each prompt gets --group-size responses, and each
    response's advantage is its score minus the group mean, over the group std, the same for all its tokens; the
    KL to the reference moves from the reward into the loss (k3 per token). Both use the adaptive beta controller
    by default, so that they are compared at the same KL target; DeepSeekMath keeps beta fixed at 0.04
    (--beta 0.04 --kl-target 0 runs that).
    Both runs start from the same models, see the same prompts and sampling seeds, and their iterations are
    interleaved (PPO i, GRPO i, PPO i+1, ...) so that both meet the same machine load. Printed: reward, rule score,
    share of well-formed records and KL averaged over the last iterations (and whose KL ended nearer the
    target); median seconds per iteration by phase (generate, score, train); the models each one keeps in
    memory; GRPO's first group of iteration 1 worked through (scores -> mean and std -> the advantage on every
    token of each response). A figure of reward and KL
    per iteration (into --plot-dir, or .cache/figures/grpo_vs_ppo/).

How to run
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/grpo_vs_ppo.py
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/grpo_vs_ppo.py --iterations 40 --group-size 8
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/grpo_vs_ppo.py --beta 0.04 --kl-target 0   # fixed beta

Runtime on 2 cores: about 15-30 s, the upper end at a load average of 5 (a tqdm bar on a terminal; other jobs on
the cores multiply it), about 7 s with --smoke. Times on a
shared machine are noisy; the interleaving keeps the comparison fair, not the absolute numbers.

Try next
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/grpo_vs_ppo.py --beta 0.04 --kl-target 0
        -> DeepSeekMath's fixed beta instead of the controller: compare the kl column and the largest KL
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/grpo_vs_ppo.py --group-size 8
        -> 4 prompts x 8 responses per iteration: GRPO's baseline is a bigger group, PPO sees fewer prompts;
           compare reward and kl with the default run's; the beta line says whether the final betas are equal
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/grpo_vs_ppo.py --iterations 40
        -> twice as long: do the KL spikes settle as beta grows? the extremes lines say
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from mlsys import cli, plot, report
from mlsys.rlhf import PPOConfig, rlhf_iteration, setup_rlhf


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    iterations: int = 20
    """RLHF iterations per algorithm."""
    num_rollouts: int = 32
    """Responses per iteration: num_rollouts / group_size prompts, group_size responses each."""
    group_size: int = 4
    """GRPO's group: responses per prompt (PPO gets the same prompts)."""
    max_tokens: int = 72
    """Longest response."""
    actor_lr: float = 3e-4
    """Adam learning rate of both actors."""
    beta: float = 0.1
    """Initial KL coefficient (both)."""
    kl_target: float = 1.0
    """Target KL per response for the adaptive controller (both); 0 keeps beta fixed."""

    def validate(self) -> None:
        if self.iterations < 1 or not 8 <= self.max_tokens <= 200:
            raise cli.UsageError("--iterations must be >= 1 and --max-tokens in 8..200")
        if self.group_size < 2 or self.num_rollouts < self.group_size or self.num_rollouts % self.group_size:
            raise cli.UsageError(f"--num-rollouts must be a multiple of --group-size >= 2, got "
                                 f"{self.num_rollouts} and {self.group_size}")
        if not (0 < self.actor_lr < 1 and 0 <= self.beta < 10 and 0 <= self.kl_target < 1e3):
            raise cli.UsageError("--actor-lr must be in (0, 1), --beta in [0, 10), --kl-target in [0, 1000)")


def plot_runs(histories: dict[str, list[dict]], args: Settings) -> None:
    plt = plot.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    for algo, history in histories.items():
        it = range(1, len(history) + 1)
        axes[0].plot(it, [h["reward"] for h in history], label=algo)
        axes[1].plot(it, [h["rule_score"] for h in history], label=algo)
        axes[2].plot(it, [h["kl"] for h in history], label=algo)
    axes[0].set(xlabel="iteration", ylabel="mean reward-model score", title="reward")
    axes[1].set(xlabel="iteration", ylabel="mean rule score", title="rule score (the 'human')")
    if args.kl_target:
        axes[2].axhline(args.kl_target, color="gray", ls="--", lw=1, label="target")
    axes[2].set(xlabel="iteration", ylabel="nats per response", title="KL(pi || pi_ref)")
    handles, labels = axes[2].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), bbox_to_anchor=(0.5, 0.0))  # off the curves
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    print(f"figure: {plot.save(fig, args, 'comparison')}")


# --8<-- [start:interleave]
def run_both(args: Settings) -> tuple[dict[str, list[dict]], dict[str, dict], dict]:
    """Both algorithms from identical starting models, iterations interleaved; returns histories, models and
    GRPO's first group of iteration 1 (see `first_group`)."""
    from tqdm import tqdm

    runs = {}
    for algo in ("ppo", "grpo"):
        torch.manual_seed(args.seed)  # identical initial critic heads, identical minibatch order
        cfg = PPOConfig(beta=args.beta, kl_target=args.kl_target or None, actor_lr=args.actor_lr,
                        group_size=args.group_size)
        # (models, opts, kl_ctl, engine, cfg)
        runs[algo] = (*setup_rlhf(cfg, max_num_seqs=args.num_rollouts, algo=algo), cfg)
    histories: dict[str, list[dict]] = {"ppo": [], "grpo": []}
    for i in tqdm(range(args.iterations), desc="ppo + grpo", unit="it", leave=False, disable=None):  # on a tty
        for algo, (models, opts, kl_ctl, engine, cfg) in runs.items():
            stats, batch = rlhf_iteration(engine, models, opts, kl_ctl, cfg, args.num_rollouts, args.max_tokens,
                                          seed=args.seed * 10_000 + i, algo=algo)  # same prompts and seeds
            histories[algo].append(stats)
            if algo == "grpo" and i == 0:
                group = first_group(batch, args.group_size)
    return histories, {algo: run[0] for algo, run in runs.items()}, group
# --8<-- [end:interleave]


def final_beta_verdict(ppo: float, grpo: float, step: float) -> str:
    """How PPO's and GRPO's final betas compare: "equal" (to 1e-9 relative: the same numbers of steps up and down,
    every one at the controller's clip), "close" (apart by less than one step at the clip, a factor 1 + step) or
    "different"."""
    low, high = sorted((ppo, grpo))
    if high <= low * (1 + 1e-9):
        return "equal"
    return "close" if high < low * (1 + step) else "different"


def kl_verdict(ppo: float, grpo: float, target: float) -> str:
    """Which algorithm's KL, averaged over the last iterations, ended nearer the controller's target (with no
    target, --kl-target 0: which is lower), read from the two KLs as printed, so the lesson's sentence holds."""
    a, b = f"{ppo:.2f}", f"{grpo:.2f}"
    off = [round(abs(float(x) - target), 6) for x in (a, b)]  # distance from the target (0: the KL itself)
    near = "lower" if not target else "nearer"
    word = f"{'PPO' if off[0] < off[1] else 'GRPO'}'s is {near}"
    if off[0] == off[1]:
        word = "both equally near it" if target else "equal"
    return f"PPO {a}, GRPO {b} nats, " + (f"target {target:g}: {word}" if target else f"no target: {word}")


def first_group(batch, group_size: int) -> dict:
    """The first prompt's group of GRPO's iteration 1, as its update used it: the G reward-model scores, their
    mean and std (torch's default, n - 1 in the denominator), and the advantage on each response's tokens."""
    scores = batch.extra["scores"][:group_size].tolist()
    adv, mask = batch.extra["advantages"][:group_size], batch.mask[:group_size].bool()
    per_token = [adv[j][mask[j]] for j in range(group_size)]
    for j, a in enumerate(per_token):  # one number per response: every token carries the same advantage
        report.expect_equal(f"response {j + 1} of the group has one advantage on all its tokens",
                            a.unique().numel(), 1)
    return {"scores": scores, "mean": statistics.mean(scores), "std": statistics.stdev(scores),
            "advantages": [float(a[0]) for a in per_token], "tokens": [len(a) for a in per_token]}


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"iterations": 2, "num_rollouts": 8, "max_tokens": 48})
    torch.set_num_threads(1)
    histories, models, group = run_both(args)
    keys = ["reward", "rule_score", "valid", "kl", "response_len"]
    rows, results = [], {}
    for algo, history in histories.items():
        tail = history[-min(5, len(history)) :]
        held = [row["model"] for row in models[algo].table()]
        row = {"algo": algo, **{k: statistics.mean(h[k] for h in tail) for k in keys},
               **{f"{p} s": statistics.median(h[f"{p}_s"] for h in history) for p in ("generate", "score", "train")},
               "s/iter": statistics.median(sum(h[f"{p}_s"] for p in ("generate", "score", "train", "sync"))
                                           for h in history),
               "models": len(held)}
        rows.append(row)
        rule, kl = [h["rule_score"] for h in history], [h["kl"] for h in history]
        extremes = {"rule_start": rule[0], "rule_min": min(rule), "rule_min_iteration": rule.index(min(rule)) + 1,
                    "valid_min": min(h["valid"] for h in history), "kl_max": max(kl),
                    "kl_max_iteration": kl.index(max(kl)) + 1, "beta_final": history[-1]["beta"],
                    # how often beta went up and down between iterations (the controller's steps)
                    "beta_up": sum(b["beta"] > a["beta"] * (1 + 1e-9) for a, b in zip(history, history[1:])),
                    "beta_down": sum(b["beta"] < a["beta"] * (1 - 1e-9) for a, b in zip(history, history[1:])),
                    # iterations whose KL was 20% or more from the target: the controller's error sat at its clip
                    "at_clip": sum(abs(k / args.kl_target - 1) >= 0.2 for k in kl) if args.kl_target else 0}
        results[algo] = {"summary": row, "extremes": extremes, "history": history, "models_held": held}
    print(f"{args.iterations} iterations x {args.num_rollouts} rollouts ({args.num_rollouts // args.group_size} "
          f"prompts x {args.group_size}), interleaved; quality averaged over the last {len(tail)} iterations, "
          f"time per iteration as medians:")
    print(report.table(rows, floatfmt=".3f"))
    results["kl_text"] = kl_verdict(rows[0]["kl"], rows[1]["kl"], args.kl_target)
    print(f"KL, mean of the last {len(tail)} iterations: {results['kl_text']}")
    def fmt(values: list[float]) -> str:
        return " ".join(f"{v:+.2f}" for v in values)

    print(f"\nGRPO's first group (iteration 1, first prompt, {args.group_size} responses): scores R_i "
          f"{fmt(group['scores'])} -> mean {group['mean']:+.2f}, std {group['std']:.2f} -> advantages "
          f"A_i = (R_i - mean) / (std + 1e-6) {fmt(group['advantages'])}, on all {'/'.join(map(str, group['tokens']))} "
          f"tokens of each response")
    results["grpo_group"] = group
    print(f"\nat the start (iteration 1, same for both): reward {histories['ppo'][0]['reward']:+.3f}, rule score "
          f"{histories['ppo'][0]['rule_score']:.2f}")
    for algo in histories:
        e = results[algo]["extremes"]
        print(f"{algo}: lowest rule score {e['rule_min']:.2f} (iteration {e['rule_min_iteration']}), largest KL "
              f"{e['kl_max']:.2f} nats (iteration {e['kl_max_iteration']}), lowest share of well-formed records "
              f"{e['valid_min']:.0%}, beta {args.beta:g} -> {e['beta_final']:.3f} ({e['beta_up']} steps up, "
              f"{e['beta_down']} down)")
    differ = [i + 1 for i, (a, b) in enumerate(zip(histories["ppo"], histories["grpo"]))
              if abs(a["beta"] - b["beta"]) >= 1e-9]
    results["beta_paths"] = "different" if differ else "identical"
    results["beta_differ_iterations"] = len(differ)
    results["beta_first_differ"] = differ[0] if differ else None
    ends = results["ppo"]["extremes"]["beta_final"], results["grpo"]["extremes"]["beta_final"]
    step = PPOConfig.k_beta * 0.2  # the controller's largest step: its error clipped to +-0.2
    verdict = results["beta_final_verdict"] = final_beta_verdict(*ends, step)
    results["beta_end_text"] = {
        "equal": f"both end at the same β ({ends[0]:.3f})",
        "close": f"they end at close βs, less than one {step:.0%} step apart ({ends[0]:.3f} for PPO, "
                 f"{ends[1]:.3f} for GRPO)",
        "different": f"they end at different βs, more than one {step:.0%} step apart ({ends[0]:.3f} for PPO, "
                     f"{ends[1]:.3f} for GRPO)"}[verdict]
    clip = (f"; the KL was 20% or more from the target (the controller's step at its clip) in "
            f"{results['ppo']['extremes']['at_clip']} of PPO's and {results['grpo']['extremes']['at_clip']} of GRPO's "
            f"{args.iterations} iterations") if args.kl_target else " (--kl-target 0: no controller, beta stays fixed)"
    where = f" in {len(differ)} of {args.iterations} iterations (first: iteration {differ[0]})" if differ else ""
    print(f"beta per iteration: {results['beta_paths']} for the two{where}{clip}; final beta: "
          f"{results['beta_end_text'].replace('β', 'beta')}")
    results["cheaper"] = min(rows, key=lambda r: r["s/iter"])["algo"]  # noise decides it on a shared machine
    results["higher_reward"] = max(rows, key=lambda r: r["reward"])["algo"]
    report.expect_equal("iteration 1 sees identical rollouts", histories["ppo"][0]["reward"],
                        histories["grpo"][0]["reward"])
    critic = sum(p.numel() for p in models["ppo"].critic.parameters())
    print(f"GRPO holds no critic: {critic:,} fewer parameters, and no critic forward or backward in its iteration.")
    plot_runs(histories, args)
    if args.json:
        report.write_json(args.json, results, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
