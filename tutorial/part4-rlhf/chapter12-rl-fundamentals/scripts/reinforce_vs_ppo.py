"""REINFORCE with a baseline against PPO on CartPole-v1: the same network, environments and batch, measured
side by side -- return curves for the same env-step budget, and the variance of their gradient estimates.

What it shows
    1. REINFORCE with a learned baseline (Williams 1992, "Simple statistical gradient-following algorithms for
       connectionist reinforcement learning", https://doi.org/10.1007/BF00992696): one gradient step per batch
       on -mean(log pi(a|s) * (G_t - V(s_t))), G_t the discounted Monte-Carlo return (GAE with lambda = 1; a
       rollout cut mid-episode is bootstrapped by V). PPO (_ppo.py): the same batch reused for
       10 epochs x 4 minibatches, safe because the clipped ratio keeps the new policy near the old one.
       Both runs: training-episode returns for --total-steps env steps, same seed; each its own learning rate.
    2. Gradient variance at one fixed policy (PPO after --snapshot-steps steps): --num-batches independent
       batches of rollouts, and for each the actor's policy-gradient estimate with three advantages:
       G_t (no baseline), G_t - V(s_t) (REINFORCE's baseline), GAE lambda = 0.95 (PPO's advantage; at ratio 1,
       before any clipping, PPO's gradient is this one up to the per-minibatch advantage normalization).
       Printed: total variance (sum over parameters of the per-coordinate variance across batches) and
       relative variance (that divided by |mean gradient|^2).

How to run
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/reinforce_vs_ppo.py
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/reinforce_vs_ppo.py --total-steps 100000

What it prints
    A table per method (mean return of the last 20 training episodes, the largest fall of the mean of 20
    consecutive episodes, env steps to first reach a running mean of 195 and 475, or `never` if it did not within
    the budget) and the gradient-variance table.
    Figures: return_curves.png, grad_variance.png.

Runtime on 2 cores: about 11 s (two training runs, a tqdm bar on a terminal, then 16 batches); --smoke 4 s.

Try next
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/reinforce_vs_ppo.py --reinforce-lr 0.003
        -> a smaller REINFORCE step: on seed 0 it barely moves within the budget (the reason 1e-2 is the default)
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/reinforce_vs_ppo.py --total-steps 100000
        -> twice the budget, with PPO's learning rate annealed over all of it: the table's last columns say whether
           each method wins back its falls and reaches 475 in this run. Either can end higher: one seed is one
           sample, not a ranking of the methods (repeat with --seed 1 and --seed 2 before reading much into it)
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/reinforce_vs_ppo.py \\
        --snapshot-steps 20480 --num-batches 32
        -> the variance measured at a better policy, over more batches: compare the three rows' total and relative
           variances with the default run's; the order of the rows by total variance and their order by relative
           variance need not agree, and either can change with the policy and the batches
"""

from __future__ import annotations

from dataclasses import dataclass

import _ppo as ppo  # the chapter's PPO machinery (_ppo.py), shared with ppo_cartpole.py
import numpy as np
import torch
from torch import nn

from mlsys import cli, plot, report, rl


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    total_steps: int = 49_152
    """Env-step budget of each training run."""
    lr: float = 1e-3
    """PPO's Adam learning rate (annealed linearly, as in ppo_cartpole.py)."""
    reinforce_lr: float = 1e-2
    """REINFORCE's learning rate: it takes one step per batch where PPO takes 40, so it gets a larger one
    (1e-2 of 3e-3, 1e-2, 3e-2 tried on seed 0: 3e-3 barely moves, 3e-2 jumps further per update)."""
    snapshot_steps: int = 8192
    """PPO steps to train the fixed policy at which gradient variance is measured."""
    num_batches: int = 16
    """Independent rollout batches (8 envs x 128 steps each) for the gradient-variance measurement."""

    def validate(self) -> None:
        if self.total_steps < 1024 or self.snapshot_steps < 1024:
            raise cli.UsageError("--total-steps and --snapshot-steps must be >= 1024 (one batch of 8 x 128)")
        if self.num_batches < 2 or self.lr <= 0 or self.reinforce_lr <= 0:
            raise cli.UsageError("--num-batches must be >= 2 and --lr, --reinforce-lr > 0")


# --8<-- [start:reinforce]
def reinforce_update(agent: ppo.ActorCritic, opt: torch.optim.Optimizer, buf: dict, args: ppo.Settings) -> dict:
    """One gradient step on the whole batch: policy gradient with baseline, plus the baseline's own regression."""
    # GAE with lambda = 1 is the plain Monte-Carlo return G_t (next section); we only keep the returns
    _, returns = rl.compute_gae(buf["rewards"], buf["values"], buf["dones"], buf["last_value"], args.gamma, 1.0)
    obs, actions, logp_old = buf["obs"].flatten(0, 1), buf["actions"].flatten(), buf["logp"].flatten()
    returns = returns.flatten()                                   # (T*N,) G_t
    dist = agent.dist(obs)
    logp = dist.log_prob(actions)
    # whiten = shift to mean 0, scale to std 1 (PPO section); it only rescales the step
    adv = rl.masked_whiten(returns - buf["values"].flatten())     # G_t - V(s_t), the baseline subtracted
    pg_loss = -(logp * adv).mean()                                # the one-line loss
    v_loss = rl.ppo_value_loss(agent.value(obs), None, returns)   # the critic: 0.5 * (V(s) - G_t)^2, no clipping
    opt.zero_grad()
    (pg_loss + args.vf_coef * v_loss).backward()
    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
    opt.step()
    with torch.no_grad():  # diagnostics only: how far did this step move the policy? (PPO's loss reports approx-KL)
        _, stats = rl.ppo_policy_loss(agent.dist(obs).log_prob(actions), logp_old, adv, args.clip_eps)
    return {**stats, "pg_loss": pg_loss.item(), "v_loss": v_loss.item()}
# --8<-- [end:reinforce]


# --8<-- [start:grad_variance]
def actor_gradient(agent: ppo.ActorCritic, buf: dict, adv: torch.Tensor) -> torch.Tensor:
    """The policy-gradient estimate -grad mean(log pi(a|s) * A) over one batch, flattened: (num_actor_params,)."""
    agent.zero_grad()
    logp = agent.dist(buf["obs"].flatten(0, 1)).log_prob(buf["actions"].flatten())
    (-(logp * adv.flatten()).mean()).backward()
    return torch.cat([p.grad.flatten() for p in agent.actor.parameters()])


def gradient_variance(agent: ppo.ActorCritic, num_batches: int, seed: int, gamma: float = 0.99) -> list[dict]:
    """Gradient estimates from num_batches independent batches, for three choices of the advantage."""
    envs = ppo.make_envs(8, seed)
    obs, _ = envs.reset(seed=seed)
    grads: dict[str, list[torch.Tensor]] = {"G_t (no baseline)": [], "G_t - V(s_t)": [], "GAE lambda=0.95": []}
    for _ in range(num_batches):
        buf, obs = ppo.collect_rollout(envs, agent, obs, 128, gamma, [], np.zeros(8))
        args = (buf["rewards"], buf["values"], buf["dones"], buf["last_value"], gamma)
        mc_adv, mc_ret = rl.compute_gae(*args, 1.0)
        gae_adv, _ = rl.compute_gae(*args, 0.95)
        for name, adv in zip(grads, (mc_ret, mc_adv, gae_adv)):  # raw, not normalized: compare like with like
            grads[name].append(actor_gradient(agent, buf, adv))
    rows = []
    for name, g in grads.items():
        g = torch.stack(g)                                        # (num_batches, num_actor_params)
        total_var = float(g.var(0).sum())
        rows.append({"advantage": name, "total variance": total_var, "|mean grad|^2": float(g.mean(0).square().sum()),
                     "relative variance": total_var / float(g.mean(0).square().sum())})
    return rows
# --8<-- [end:grad_variance]


def running_mean_crossing(curve: list[tuple[int, float]], level: float, window: int = 20) -> int | None:
    """First env step at which the mean of the last `window` training-episode returns reaches `level`."""
    rets = [r for _, r in curve]
    for i in range(window - 1, len(curve)):
        if np.mean(rets[i - window + 1: i + 1]) >= level:
            return curve[i][0]
    return None


def running_mean_drop(curve: list[tuple[int, float]], window: int = 20) -> dict:
    """The largest fall of the mean of `window` consecutive training-episode returns: from a high (peak, at env
    step peak_step) to a later low (low, at low_step). drop = peak - low, 0 if the running mean never fell."""
    rets = [r for _, r in curve]
    means = [(float(np.mean(rets[i - window + 1: i + 1])), curve[i][0]) for i in range(window - 1, len(curve))]
    best = {"drop": 0.0, "peak": None, "peak_step": None, "low": None, "low_step": None}
    high = None
    for m, step in means:
        high = (m, step) if high is None or m > high[0] else high
        if high[0] - m > best["drop"]:
            best = {"drop": high[0] - m, "peak": high[0], "peak_step": high[1], "low": m, "low_step": step}
    return best


def plot_curves(runs: dict[str, dict], rows: list[dict], args: Settings) -> None:
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, run in runs.items():
        steps, rets = (np.array(x) for x in zip(*run["curve"]))
        smooth = np.convolve(rets, np.ones(20) / 20, mode="valid") if len(rets) >= 20 else rets
        ax.scatter(steps, rets, s=3, alpha=0.2)
        ax.plot(steps[len(steps) - len(smooth):], smooth, label=f"{name} (mean of 20 episodes)")
    ax.set(xlabel="env steps", ylabel="training episode return", title="REINFORCE vs PPO on CartPole-v1")
    ax.legend(fontsize=8)
    print(f"figure: {plot.save(fig, args, 'return_curves')}")
    fig, ax = plt.subplots(figsize=(7, 3))
    values = [r["total variance"] for r in rows]
    ax.barh([r["advantage"] for r in rows], values)
    ax.invert_yaxis()                  # top to bottom in the order of the printed table
    for y, v in enumerate(values):     # each bar's value, and how much smaller it is than the bar above
        cut = f"  ({values[y - 1] / v:.1f}x smaller than the bar above)" if y else ""
        ax.text(v, y, f" {v:.3g}{cut}", va="center", fontsize=9)
    ax.set(xlim=(0, max(values) * 1.25),   # linear axis from 0: bar lengths are in the ratio of the variances
           xlabel="total variance of the actor-gradient estimate (sum over parameters)")
    print(f"figure: {plot.save(fig, args, 'grad_variance')}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"total_steps": 2048, "snapshot_steps": 1024, "num_batches": 3})
    torch.set_num_threads(1)
    common = {"total_steps": args.total_steps, "eval_every": 10**9, "eval_episodes": 4}
    runs = {"REINFORCE + baseline": ppo.train(ppo.Settings(lr=args.reinforce_lr, **common), args.seed, True,
                                              reinforce_update, "REINFORCE"),
            "PPO": ppo.train(ppo.Settings(lr=args.lr, **common), args.seed, True)}
    table = []
    for name, run in runs.items():
        last = [r for _, r in run["curve"][-20:]]
        table.append({"method": name, "updates": len(run["updates"]), "gradient steps":
                      len(run["updates"]) * (1 if name.startswith("REINFORCE") else 40),
                      "last-20 mean return": float(np.mean(last)) if last else 0.0,
                      "largest fall of the 20-episode mean": running_mean_drop(run["curve"])["drop"],
                      "steps to 195": running_mean_crossing(run["curve"], 195) or "never",
                      "steps to 475": running_mean_crossing(run["curve"], 475) or "never",
                      "mean approx KL / update": float(np.mean([u["approx_kl"] for u in run["updates"]]))})
    print(f"training returns after {args.total_steps:,} env steps (8 envs x 128 steps per batch, seed {args.seed})")
    print(report.table(table, floatfmt=".4g"))
    torch.manual_seed(args.seed)
    snapshot = ppo.train(ppo.Settings(total_steps=args.snapshot_steps, eval_every=10**9, eval_episodes=4),
                         args.seed, progress=False)["agent"]
    rows = gradient_variance(snapshot, args.num_batches, args.seed + 7)
    print(f"\nactor-gradient estimates at one fixed policy (PPO after {args.snapshot_steps:,} steps), "
          f"{args.num_batches} independent batches of 1,024 steps")
    print(report.table(rows, floatfmt=".3g"))
    ratio = rows[0]["total variance"] / rows[1]["total variance"]
    print(f"\nthe baseline cuts the gradient variance {ratio:.0f}x; GAE(0.95) cuts it a further "
          f"{rows[1]['total variance'] / rows[2]['total variance']:.1f}x")
    plot_curves(runs, rows, args)
    if args.json:
        summary = {"reinforce_fall": running_mean_drop(runs["REINFORCE + baseline"]["curve"]),
                   "ppo_fall": running_mean_drop(runs["PPO"]["curve"]),
                   "reinforce_last20": table[0]["last-20 mean return"], "ppo_last20": table[1]["last-20 mean return"],
                   "ppo_steps_to_475": table[1]["steps to 475"],     # an env step, or "never", as in the table
                   "baseline_relative_variance": rows[1]["relative variance"], "baseline_variance_cut": ratio}
        report.write_json(args.json, {"summary": summary, "training": table, "gradient_variance": rows}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
