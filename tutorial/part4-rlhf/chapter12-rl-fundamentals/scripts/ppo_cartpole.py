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
       that does not solve within --total-steps env steps or --max-seconds exits 1. The greedy policy (argmax
       action) is evaluated beside it, for comparison only: it scores much higher much earlier.
    4. --seeds 0 1 2: the benchmark, one full run per seed, a table of env steps and seconds to solve each.
       (Reference point: cleanrl's ppo.py reports 492 +/- 13 on CartPole-v1 after 500k steps, with its defaults.)

How to run
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/ppo_cartpole.py
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/ppo_cartpole.py --seeds 0 1 2
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/ppo_cartpole.py --smoke
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/ppo_cartpole.py --env-id Acrobot-v1   # -100 to solve
    The network's input and output sizes come from the environment's spaces; nothing else is tuned per environment.

What it prints
    The settings, the median and max approx-KL and clip fraction over the updates, the evaluations (env steps,
    seconds, mean return with sampled actions, mean greedy return), and the verdict: solved after how many env
    steps and seconds, or "NOT SOLVED" and exit 1. Figure: learning_curve.png in --plot-dir.

Runtime on 2 cores: about 15 s of CPU to solve with the default seed (a tqdm bar on a terminal); --seeds 0 1 2
about three times that; --smoke about 3 s. One torch thread: these nets are too small to gain from more.
The machinery (actor-critic, rollouts, the PPO update, the loop) is in _ppo.py, which the chapter's other two
scripts share; this file is the run sheet, the figure and the solve check.
"""

from __future__ import annotations

import numpy as np
import torch
from _ppo import Settings, train

from mlsys import cli, plot, report


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
    plot.save(fig, args, "learning_curve")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"total_steps": 2048, "num_envs": 4, "num_steps": 64,
                                               "update_epochs": 2, "eval_every": 2, "eval_episodes": 4})
    torch.set_num_threads(1)  # 64-wide MLPs: thread start-up costs more than it saves
    print(f"PPO on {args.env_id} (observations of {args.obs_dim}, {args.num_actions} actions, solved at "
          f"{args.solve_return:g}): {args.num_envs} envs x {args.num_steps} steps per update, {args.update_epochs} "
          f"epochs x {args.num_minibatches} minibatches, lr {args.lr} annealed, budget {args.total_steps:,} steps "
          f"/ {args.max_seconds:.0f} s")
    seeds = args.seeds or [args.seed]
    runs = [train(args, s) for s in seeds]
    if not args.seeds:
        kl, clip = ([u[k] for u in runs[0]["updates"]] for k in ("approx_kl", "clip_frac"))
        print(f"diagnostics over {len(kl)} updates: approx KL median {np.median(kl):.2g} (max {max(kl):.2g}), "
              f"clip fraction median {np.median(clip):.2g} (max {max(clip):.2g})")
        print(report.table([{k: round(v, 1) if isinstance(v, float) else v for k, v in e.items()}
                            for e in runs[0]["evals"]]))
        plot_run(runs[0], args)
    rows = [{"seed": r["seed"], "solved": r["solved"], "env steps": r["steps"], "seconds": round(r["seconds"], 1),
             "eval return": r["eval_return"]} for r in runs]
    print("\n" + report.table(rows))
    if args.json:
        runs_json = [{k: v for k, v in r.items() if k not in ("curve", "agent")} for r in runs]
        agent = runs[0]["agent"]  # the network as built: (in, out) of every linear layer
        layers = {name: [[m.in_features, m.out_features] for m in net if isinstance(m, torch.nn.Linear)]
                  for name, net in (("actor", agent.actor), ("critic", agent.critic))}
        report.write_json(args.json, {"env_id": args.env_id, "obs_dim": args.obs_dim, "num_actions": args.num_actions,
                                      "solve_return": args.solve_return, "layers": layers, "runs": runs_json}, args)
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
