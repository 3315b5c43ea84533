"""PPO on CartPole-v1 (or any classic-control environment with discrete actions, --env-id): an actor-critic trained
with vectorized environments, GAE and the clipped surrogate, until the mean return of the policy, sampling its
actions as in training, reaches the environment's reward threshold (475 of a possible 500 on CartPole-v1).

What it shows
    1. The PPO loop (Schulman et al., "Proximal Policy Optimization Algorithms", https://arxiv.org/abs/1707.06347):
       collect --num-steps steps from --num-envs CartPole copies (gymnasium SyncVectorEnv), compute advantages with
       GAE (mlsys.rl.compute_gae), then --update-epochs passes of minibatch updates on the clipped policy loss, the
       value loss and an entropy term (--ent-coef, 0 by default: no entropy bonus unless asked), with advantage
       normalization and gradient-norm clipping.
    2. The diagnostics practitioners watch: approx-KL between the old and new policy, the clip fraction, the
       policy entropy, shown in the tqdm bar and plotted per update.
    3. The solve check: every --eval-every updates the policy plays --eval-episodes fresh episodes, sampling its
       actions as in training; the run stops as soon as their mean return is >= --solve-return (by default the
       environment's reward_threshold from its gymnasium spec: 475 of a possible 500 on CartPole-v1). A full run
       that does not solve within --total-steps env steps or --max-seconds of CPU time exits 1. The greedy policy
       (argmax action) is evaluated beside it, for comparison only: it scores much higher much earlier.
    4. --seeds 0 1 2: the benchmark, one full run per seed, a table of env steps and seconds to solve each.
       (Reference point: cleanrl's ppo.py docs report 490.04 +/- 6.12 on CartPole-v1 after 500k steps with its
       defaults, https://docs.cleanrl.dev/rl-algorithms/ppo/ as read on 2026-11-26.)
    5. Before training, a picture of one real rollout buffer (4 envs x 28 steps, CartPole with a 16-step time
       limit so that both a fall and a time-limit cut appear): rollout_grid.png.

How to run
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/ppo_cartpole.py
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/ppo_cartpole.py --seeds 0 1 2
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/ppo_cartpole.py --smoke
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/ppo_cartpole.py --env-id Acrobot-v1   # -100 to solve
    The network's input and output sizes come from the environment's spaces; nothing else is tuned per environment.

What it prints
    The settings, the median and max approx-KL and clip fraction over the updates, the evaluations (env steps,
    seconds, mean return with sampled actions, mean greedy return), and the verdict: solved after how many env
    steps and seconds, or "NOT SOLVED" and exit 1. Before the verdict, one line on clipping in one real minibatch
    (the last one of the run's middle update): how many ratios left [1 - eps, 1 + eps], and how many of those got
    no gradient. Figures in --plot-dir: rollout_grid.png, learning_curve.png, clip_objective.png (one sample's
    clipped objective against the ratio for A = +1 and A = -1, from mlsys.rl.ppo_policy_loss) and clip_batch.png
    (that real minibatch, each sample at its ratio and advantage, marked by whether the loss gave it a gradient).

Runtime on 2 cores: about 8 s for the whole default run (a tqdm bar on a terminal); about half of that is the
training loop itself, the wall-clock `seconds` the evaluation and result tables print (rollouts, updates and
evaluations; start-up, the rollout picture and the figures are not in it). --seeds 0 1 2 about three times the
default run; --smoke about 3 s. One torch thread: these nets are too small to gain from more.
The machinery (actor-critic, rollouts, the PPO update, the loop) is in _ppo.py, which the chapter's other two
scripts share; this file is the run sheet, the figure and the solve check.

Try next
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/ppo_cartpole.py --lr 0.03
        -> 30x the learning rate: approx-KL about an order of magnitude above the default run's, the clip fraction
           several times higher; the easy task may still be solved, the diagnostics line shows the damage
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/ppo_cartpole.py \\
        --clip-eps 100 --update-epochs 40 --lr 0.01
        -> no clipping and 40 epochs per batch: clip fraction about 0 (median 0), approx-KL in whole nats, an
           evaluation return that jumps between evaluations and nearly equals the greedy one (the policy collapsed
           to near-deterministic actions); add --seeds 0 1 2 to see how often it still solves: exit code 1 if any
           seed did not, which is the point
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/ppo_cartpole.py --env-id MountainCar-v0
        -> a sparse reward sampling almost never finds: it ends with "SELF-CHECK FAILED: NOT SOLVED ..." and
           exit code 1, as expected
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/ppo_cartpole.py --seeds 0 1 2
        -> the benchmark: steps and seconds to solve for three seeds, about three times the default run
"""

from __future__ import annotations

import numpy as np
import torch
from _ppo import ActorCritic, Settings, collect_rollout, make_envs, train

from mlsys import cli, plot, report, rl


# --8<-- [start:rollout_grid]
def rollout_grid(seed: int, steps: int = 28, num_envs: int = 4, time_limit: int = 16, gamma: float = 0.99) -> dict:
    """One real rollout buffer, small enough to draw cell by cell: an untrained policy on CartPole whose time limit
    is `time_limit` steps instead of 500, so that both kinds of episode end happen within a few steps. Returns
    the (N, T) grids (env n, step t) of the buffer collect_rollout fills, as lists."""
    torch.manual_seed(seed)
    agent = ActorCritic()
    envs = make_envs(num_envs, seed, max_episode_steps=time_limit)
    obs, _ = envs.reset(seed=seed)
    buf, _ = collect_rollout(envs, agent, obs, steps, gamma, [], np.zeros(num_envs))
    envs.close()
    grid = {k: buf[k].T.tolist() for k in ("actions", "rewards", "dones", "truncated", "values")}
    return {"seed": seed, "time_limit": time_limit, "gamma": gamma, **grid}
# --8<-- [end:rollout_grid]


def plot_rollout_grid(grid: dict, args: Settings) -> None:
    """The buffer as an N x T grid: one row per env, one cell per step, coloured by how the step ended."""
    from matplotlib.patches import Patch, Rectangle

    plt = plot.pyplot()
    rewards, dones, cut = (np.array(grid[k]) for k in ("rewards", "dones", "truncated"))
    N, T = rewards.shape
    colour = {"step": "#dbe9f6", "fell": "#e4826f", "limit": "#f3c05b"}
    fig, ax = plt.subplots(figsize=(T * 0.42 + 1.5, N * 0.62 + 1.4))
    for n in range(N):
        for t in range(T):
            kind = "limit" if cut[n, t] else "fell" if dones[n, t] else "step"
            ax.add_patch(Rectangle((t, N - 1 - n), 1, 1, facecolor=colour[kind], edgecolor="white", lw=1.5))
            ax.text(t + 0.5, N - 0.5 - n, f"{rewards[n, t]:.3g}", ha="center", va="center", fontsize=7)
            if dones[n, t]:     # an episode ends after this step: nothing flows back across the line
                ax.plot([t + 1, t + 1], [N - 1 - n, N - n], color="black", lw=2.5)
    ax.set(xlim=(0, T + 0.3), ylim=(0, N), xlabel="step t (time-major: the buffer's first axis)",
           title=f"A real rollout buffer, (T, N) = ({T}, {N}): the reward stored at each step "
                 f"(CartPole with a {grid['time_limit']}-step time limit, untrained policy)")
    ax.set_xticks(np.arange(T) + 0.5, range(T), fontsize=7)
    ax.set_yticks(np.arange(N) + 0.5, [f"env {n}" for n in reversed(range(N))])
    ax.grid(False)
    ax.legend(handles=[Patch(color=colour["step"], label="ordinary step: reward 1"),
                       Patch(color=colour["fell"], label="pole fell (terminated): done, no value after it"),
                       Patch(color=colour["limit"], label=f"time limit (truncated): reward 1 + "
                                                          f"{grid['gamma']:g} x V(last obs), then done")],
              loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, fontsize=8, frameon=False)
    print(f"figure: {plot.save(fig, args, 'rollout_grid')}")


# --8<-- [start:clip_curve]
def clip_objective(ratios: np.ndarray, advantage: float, clip_eps: float) -> tuple[np.ndarray, np.ndarray]:
    """PPO's per-sample objective -loss and its slope d(objective)/d(ratio), computed with the real loss
    (mlsys.rl.ppo_policy_loss) one sample at a time: logp_old = 0, logp_new = log(ratio). Shapes (len(ratios),)."""
    objective, slope = [], []
    for r in ratios:
        logp_new = torch.tensor([float(np.log(r))], dtype=torch.float64, requires_grad=True)
        loss, _ = rl.ppo_policy_loss(logp_new, torch.zeros(1, dtype=torch.float64),
                                     torch.tensor([advantage], dtype=torch.float64), clip_eps)
        loss.backward()
        objective.append(-loss.item())
        slope.append(-logp_new.grad.item() / r)  # d/d ratio = d/d logp / ratio
    return np.array(objective), np.array(slope)
# --8<-- [end:clip_curve]


# --8<-- [start:clip_batch]
def clip_batch(run: dict, clip_eps: float) -> dict:
    """One real minibatch as PPO's loss saw it: the last minibatch of the last epoch of the run's middle update.
    Per sample: the ratio rho = exp(logp_new - logp_old), the whitened advantage, and whether the real loss
    (mlsys.rl.ppo_policy_loss) gives it a gradient, read from one backward pass (the loss is a mean of per-sample
    terms, so sample i's gradient is d loss / d logp_new[i] alone). Lists, for the figure and the --json."""
    update = (len(run["minibatches"]) + 1) // 2          # 1-based: the middle update of the run
    mb = run["minibatches"][update - 1]
    logp_new = mb["logp_new"].double().requires_grad_(True)
    loss, _ = rl.ppo_policy_loss(logp_new, mb["logp_old"].double(), mb["advantages"].double(), clip_eps)
    loss.backward()
    ratio, adv, grad = (logp_new.detach() - mb["logp_old"]).exp(), mb["advantages"], logp_new.grad != 0
    out = (ratio - 1).abs() > clip_eps
    counts = {"samples": len(ratio), "outside": int(out.sum()), "no_gradient": int((~grad).sum()),
              "no_gradient_above": int((~grad & (adv > 0)).sum()), "no_gradient_below": int((~grad & (adv < 0)).sum()),
              "outside_with_gradient": int((out & grad).sum())}
    return {"update": update, "updates": len(run["minibatches"]), "clip_eps": clip_eps, **counts,
            "logp_new": mb["logp_new"].tolist(), "logp_old": mb["logp_old"].tolist(),
            "advantage": adv.tolist(), "ratio": ratio.tolist(),
            "gradient": grad.tolist(),  # False: the clipped term won, this sample pushes nothing
            "clip_frac": mb["stats"]["clip_frac"], "approx_kl": mb["stats"]["approx_kl"]}  # as training logged
# --8<-- [end:clip_batch]


def print_clip_batch(cb: dict) -> None:
    rho = np.array(cb["ratio"])
    print(f"clipping in one real minibatch (update {cb['update']} of {cb['updates']}, its last minibatch of the last "
          f"epoch, {cb['samples']} samples, clip_batch.png): ratio from {rho.min():.3f} to {rho.max():.3f}; "
          f"{cb['outside']} outside [1 - eps, 1 + eps] = [{1 - cb['clip_eps']:g}, {1 + cb['clip_eps']:g}] "
          f"(clip fraction {cb['clip_frac']:.3f}); {cb['no_gradient']} of them get no gradient "
          f"({cb['no_gradient_above']} with A > 0 above 1 + eps, {cb['no_gradient_below']} with A < 0 below 1 - eps), "
          f"{cb['outside_with_gradient']} are outside on the side that still gets one")


def plot_clip_batch(cb: dict, args: Settings) -> None:
    """Each sample at (ratio, advantage): inside the band, outside with no gradient, outside with one."""
    plt = plot.pyplot()
    rho, adv, grad = (np.array(cb[k]) for k in ("ratio", "advantage", "gradient"))
    eps = cb["clip_eps"]
    out = np.abs(rho - 1) > eps
    fig, ax = plt.subplots(figsize=(8, 4.6))
    lo, hi = min(rho.min(), 1 - eps) - 0.03, max(rho.max(), 1 + eps) + 0.03
    top = np.abs(adv).max() * 1.1
    ax.fill_between([1 + eps, hi], 0, top, color="C3", alpha=0.1, lw=0)    # A > 0, rho > 1 + eps: flat
    ax.fill_between([lo, 1 - eps], -top, 0, color="C3", alpha=0.1, lw=0)   # A < 0, rho < 1 - eps: flat
    for sel, style, label in ((~out, dict(color="C0", marker="o", s=14), "inside [1 - eps, 1 + eps]: gradient"),
                              (out & ~grad, dict(color="C3", marker="x", s=30), "clipped: no gradient"),
                              (out & grad, dict(color="C4", marker="^", s=24),
                               "outside, but on the side that makes things worse: gradient")):
        ax.scatter(rho[sel], adv[sel], label=f"{label} ({int(sel.sum())})", **style)
    for x in (1 - eps, 1 + eps):
        ax.axvline(x, color="gray", ls=":", lw=1)
    ax.axvline(1, color="black", lw=0.8)
    ax.axhline(0, color="black", lw=0.6)
    ax.set(xlim=(lo, hi), ylim=(-top, top), xlabel="probability ratio rho = pi_new / pi_old",
           ylabel="advantage A (whitened)")
    ax.set_title(f"One real minibatch: update {cb['update']} of {cb['updates']}, last epoch; shaded: where the "
                 f"clipped term wins", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    print(f"figure: {plot.save(fig, args, 'clip_batch')}")


def plot_clip_objective(args: Settings) -> None:
    """The clipped objective against the ratio for A = +1 and A = -1, beside the unclipped ratio * A."""
    plt = plot.pyplot()
    ratios = np.linspace(0.3, 1.8, 301)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, adv in zip(axes, (1.0, -1.0)):
        objective, slope = clip_objective(ratios, adv, args.clip_eps)
        flat = np.abs(slope) < 1e-12  # where the clipped term wins: no gradient
        ax.plot(ratios, ratios * adv, "--", color="gray", lw=1, label="unclipped: ratio x A")
        ax.plot(ratios, objective, color="C0", lw=2, label="PPO: min(ratio x A, clip(ratio) x A)")
        ax.fill_between(ratios, -2, 2, where=flat, color="C3", alpha=0.12, label="gradient 0 (clipped)")
        for x in (1 - args.clip_eps, 1 + args.clip_eps):
            ax.axvline(x, color="gray", lw=0.8, ls=":")
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set(xlabel="probability ratio rho = pi_new / pi_old", ylim=(-1.9, 1.9),
               title=f"A = {adv:+g} (" + ("a good action: flat above 1 + eps)" if adv > 0
                                          else "a bad action: flat below 1 - eps)"))
        ax.legend(fontsize=8, loc="lower right" if adv > 0 else "upper right")
    axes[0].set_ylabel("objective per sample (-loss)")
    print(f"figure: {plot.save(fig, args, 'clip_objective')}")


def plot_run(run: dict, args: Settings) -> None:
    plt = plot.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    steps, rets = zip(*run["curve"]) if run["curve"] else ((), ())
    ax1.scatter(steps, rets, s=4, alpha=0.3, label="training episodes (sampled actions)")
    ax1.plot([e["steps"] for e in run["evals"]], [e["eval_return"] for e in run["evals"]], "o-", color="C1",
             label=f"evaluation: mean of {args.eval_episodes} episodes")
    ax1.plot([e["steps"] for e in run["evals"]], [e["greedy_return"] for e in run["evals"]], "x:", color="C2",
             label="greedy policy (argmax), not the criterion")
    ax1.axhline(args.solve_return, ls="--", color="gray", lw=1)
    ax1.set(xlabel="env steps", ylabel="episode return", title=f"PPO on {args.env_id}, seed {run['seed']}")
    ax1.legend(loc="lower right", fontsize=8)
    u = run["updates"]
    ax2.plot([x["steps"] for x in u], [x["approx_kl"] for x in u], label="approx KL (k3)")
    ax2.plot([x["steps"] for x in u], [x["clip_frac"] / 10 for x in u], label="clip fraction / 10")
    ax2.set(xlabel="env steps", title="per-update diagnostics (last epoch)")
    ax2.legend(fontsize=8)
    print(f"figure: {plot.save(fig, args, 'learning_curve')}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"total_steps": 2048, "num_envs": 4, "num_steps": 64,
                                               "update_epochs": 2, "eval_every": 2, "eval_episodes": 4})
    torch.set_num_threads(1)  # 64-wide MLPs: thread start-up costs more than it saves
    print(f"PPO on {args.env_id} (observations of {args.obs_dim}, {args.num_actions} actions, solved at "
          f"{args.solve_return:g}): {args.num_envs} envs x {args.num_steps} steps per update, {args.update_epochs} "
          f"epochs x {args.num_minibatches} minibatches, lr {args.lr} annealed, budget {args.total_steps:,} steps "
          f"/ {args.max_seconds:.0f} s of CPU")
    grid = rollout_grid(args.seed, gamma=args.gamma) if args.env_id == "CartPole-v1" else None
    if grid and not args.seeds:
        plot_rollout_grid(grid, args)
    seeds = args.seeds or [args.seed]
    runs = [train(args, s) for s in seeds]
    if not args.seeds:
        kl, clip = ([u[k] for u in runs[0]["updates"]] for k in ("approx_kl", "clip_frac"))
        print(f"diagnostics over {len(kl)} updates: approx KL median {np.median(kl):.2g} (max {max(kl):.2g}), "
              f"clip fraction median {np.median(clip):.2g} (max {max(clip):.2g})")
        print(report.table([{k: round(v, 1) if isinstance(v, float) else v for k, v in e.items()}
                            for e in runs[0]["evals"]]))
        batch_picture = clip_batch(runs[0], args.clip_eps)
        print_clip_batch(batch_picture)
        plot_run(runs[0], args)
        plot_clip_objective(args)
        plot_clip_batch(batch_picture, args)
    rows = [{"seed": r["seed"], "solved": r["solved"], "env steps": r["steps"], "seconds": round(r["seconds"], 1),
             "eval return": r["eval_return"]} for r in runs]
    print("\n" + report.table(rows))
    if args.json:
        runs_json = [{k: v for k, v in r.items() if k not in ("curve", "agent", "minibatches")} for r in runs]
        agent = runs[0]["agent"]  # the network as built: (in, out) of every linear layer
        layers = {name: [[m.in_features, m.out_features] for m in net if isinstance(m, torch.nn.Linear)]
                  for name, net in (("actor", agent.actor), ("critic", agent.critic))}
        report.write_json(args.json, {"env_id": args.env_id, "obs_dim": args.obs_dim, "num_actions": args.num_actions,
                                      "solve_return": args.solve_return, "layers": layers, "runs": runs_json,
                                      "rollout_grid": grid, "clip_batch": None if args.seeds else batch_picture},
                          args)
    unsolved = [r["seed"] for r in runs if not r["solved"]]
    if args.smoke:
        print(f"\nsmoke run: {runs[0]['steps']} steps, no solve check")
        return 0
    if unsolved:
        raise cli.SelfCheckFailed(f"NOT SOLVED for seed(s) {unsolved}: mean eval return below {args.solve_return}")
    print(f"\nsolved: mean return >= {args.solve_return:g} over {args.eval_episodes} episodes, "
          f"median {np.median([r['steps'] for r in runs]):,.0f} env steps, "
          f"{np.median([r['seconds'] for r in runs]):.1f} s")
    return 0


if __name__ == "__main__":
    cli.run(main)
