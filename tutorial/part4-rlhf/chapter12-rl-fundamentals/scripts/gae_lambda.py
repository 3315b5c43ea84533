"""GAE's lambda, measured: bias and variance of advantage estimates on real CartPole rollouts, against a
Monte-Carlo ground truth, and a picture of what the estimator does along one episode.

What it shows
    1. A fixed policy and its critic: PPO (_ppo.py) trained for only --train-steps env steps, so the
       policy still fails often and the critic V is imperfect -- the regime where lambda matters.
    2. Ground truth: --num-states states visited by that policy, each with one action a drawn from it. From each
       (s, a), --truth-rollouts Monte-Carlo rollouts (first action a, then the policy, up to --horizon steps) give
       Q(s, a) as the mean discounted return, and A_true(s, a) = Q(s, a) - V(s): what GAE's estimate targets when
       lambda = 1 (GAE paper, https://arxiv.org/abs/1506.02438, section 3).
    3. Estimates: --rollouts fresh rollouts from each (s, a) give --rollouts samples of the GAE advantage at the
       first step, for each lambda in --lambdas (mlsys.rl.compute_gae). Per lambda: bias^2 (squared error of
       their mean, averaged over states), variance (their spread over the rollouts, dividing by --rollouts, averaged
       over states), and mean squared error; with the variance divided by n, MSE = bias^2 + variance exactly.
       Small lambda: low variance, biased by the critic's errors; lambda = 1: unbiased, high variance. The
       estimates stop at --horizon without bootstrapping, as the ground truth does, so both target the same
       truncated return; at lambda = 1 the bias^2 left is sampling noise (variance / (--rollouts - 1) + the
       truth's: this variance divides by --rollouts, so dividing it by one less gives the variance of the mean).
    4. One real rollout, step by step: rewards, V, TD errors and advantages for lambda in {0, 0.95, 1}, with an
       episode end where the estimates restart (gae_advantages.png, and the numbers around that end).
    All rollouts step gymnasium's own vectorized CartPole (CartPoleVectorEnv): thousands of copies in numpy.

How to run
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/gae_lambda.py
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/gae_lambda.py --train-steps 20480 --lambdas 0 0.9 1

What it prints
    The policy's return, then one row per lambda: bias^2, variance, MSE of the first-step advantage estimate, and
    the noise floor of the ground truth itself; the lambda with the lowest MSE; the two lambdas between which the
    variance overtakes bias^2; at lambda = 1, bias^2 beside what noise alone would give. Then the steps around the
    first episode end of one real rollout: r_t, V(s_t), done, delta_t and the advantage for each lambda.
    Figures: gae_bias_variance.png, gae_advantages.png.

Runtime on 2 cores: about 10 s (training the policy, refitting the critic, 2 x 8,192 rollouts); --smoke 4 s.

Try next
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/gae_lambda.py --train-steps 20480
        -> a better policy and critic: compare the bias^2 at lambda = 0 and where the lowest MSE lands. The bias^2
           at lambda = 1 can land well above (or below) what "an unbiased estimate would show": that is an average
           over runs, and one run's value is a mean over only --num-states noisy squared errors; with policy and
           critic frozen and the same truncated return on both sides, only finite sampling separates them
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/gae_lambda.py --rollouts 16
        -> fewer rollouts per state: the variance column estimates the same spread (15/16 of it in expectation,
           as it divides by --rollouts), but the bias^2 left at lambda = 1 is expected to grow, because its
           sampling-noise part is variance / (--rollouts - 1); one run can still land anywhere around it
    python tutorial/part4-rlhf/chapter12-rl-fundamentals/scripts/gae_lambda.py --horizon 100
        -> truth and estimates both stop at step 100 instead of 400, still without bootstrapping, so most rollouts
           now reach the cut. Fewer random rewards are summed: expect less variance at lambda = 1; which lambda is
           best can change (it can even be 0). bias^2 need not fall as lambda grows: expect it to rise over most of
           the range and drop only near lambda = 1. The critic was fit to the whole return, so near the cut its
           values count rewards the truncated truth no longer counts and overestimate, the more the closer to the
           cut; a larger lambda leans on values further along the rollout, until lambda = 1 uses none. Nearer the
           start, that overestimate and the critic's own errors can add up or cancel
"""

from __future__ import annotations

from dataclasses import dataclass, field

import _ppo as ppo  # the chapter's PPO machinery (_ppo.py), shared with ppo_cartpole.py
import gymnasium as gym
import numpy as np
import torch

from mlsys import cli, plot, report, rl


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    train_steps: int = 8192
    """PPO env steps for the policy under study (few on purpose: a mediocre policy, an imperfect critic)."""
    num_states: int = 32
    """Start states (s, a) at which the advantage is estimated."""
    rollouts: int = 64
    """Independent rollouts per state that give the advantage estimates (variance is measured over these)."""
    truth_rollouts: int = 256
    """Separate Monte-Carlo rollouts per state for the ground truth Q(s, a)."""
    horizon: int = 400
    """Steps per rollout, for the ground truth and the estimates alike: both target the return cut at this
    horizon (what lies past it is discounted by gamma^horizon, 0.99^400 = 0.018)."""
    gamma: float = 0.99
    """Discount factor."""
    lambdas: list[float] = field(default_factory=lambda: [0.0, 0.5, 0.8, 0.9, 0.95, 0.97, 0.99, 1.0])
    """The lambdas to compare."""

    def validate(self) -> None:
        if min(self.train_steps, self.num_states, self.rollouts, self.truth_rollouts, self.horizon) < 1:
            raise cli.UsageError("--train-steps, --num-states, --rollouts, --truth-rollouts, --horizon must be >= 1")
        if self.rollouts < 2 or self.truth_rollouts < 2:
            raise cli.UsageError("--rollouts and --truth-rollouts must be >= 2 to measure a variance")
        if not 0 < self.gamma <= 1 or not all(0 <= x <= 1 for x in self.lambdas):
            raise cli.UsageError("need 0 < --gamma <= 1 and every lambda in [0, 1]")


def fit_critic(agent: ppo.ActorCritic, seed: int, gamma: float, num_steps: int = 512, iters: int = 1000,
               batch: int = 1024) -> float:
    """Policy evaluation: regress the critic on Monte-Carlo returns (GAE with lambda = 1) of fresh rollouts of the
    fixed policy (16 envs x num_steps), iters Adam steps on random minibatches, so that V is a decent but imperfect
    fit -- as in the middle of a PPO run. Returns the final MSE over all the samples."""
    envs = ppo.make_envs(16, seed)
    obs, _ = envs.reset(seed=seed)
    buf, _ = ppo.collect_rollout(envs, agent, obs, num_steps, gamma, [], np.zeros(16))
    _, returns = rl.compute_gae(buf["rewards"], buf["values"], buf["dones"], buf["last_value"], gamma, 1.0)
    obs, target = buf["obs"].flatten(0, 1), returns.flatten()     # (T*N, 4), (T*N,)
    opt = torch.optim.Adam(agent.critic.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(iters):
        mb = torch.randint(0, len(target), (batch,), generator=g)
        loss = rl.ppo_value_loss(agent.value(obs[mb]), None, target[mb])  # 0.5 * MSE, no clipping
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return 2 * rl.ppo_value_loss(agent.value(obs), None, target).item()


def start_states(agent: ppo.ActorCritic, num: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`num` states visited by the policy (from 64 steps of 16 envs) and one sampled action each: (num, 4), (num,)."""
    envs = ppo.make_envs(16, seed)
    obs, _ = envs.reset(seed=seed)
    seen = []
    for _ in range(64):
        seen.append(obs)
        with torch.no_grad():
            obs = envs.step(agent.dist(torch.as_tensor(obs)).sample().numpy())[0]
    seen = np.concatenate(seen)                                    # (64 * 16, 4)
    rng = np.random.default_rng(seed)
    states = seen[rng.choice(len(seen), num, replace=False)]
    with torch.no_grad():
        actions = agent.dist(torch.as_tensor(states)).sample().numpy()
    return states, actions


@torch.no_grad()
def rollouts_from(agent: ppo.ActorCritic, states: np.ndarray, actions: np.ndarray, repeats: int, horizon: int,
                  seed: int) -> dict:
    """Play `repeats` rollouts from each (state, action): B = len(states) * repeats CartPole copies in lockstep,
    first action fixed, then the policy. Returns time-major (H, B) rewards and dones, and the observations."""
    B = len(states) * repeats
    env = gym.make_vec("CartPole-v1", num_envs=B, vectorization_mode="vector_entry_point")  # numpy, vectorized
    env.reset(seed=seed)
    core = env.unwrapped
    core.state = np.repeat(states, repeats, axis=0).T.astype(np.float64)  # (4, B): copy k*repeats..: state k
    core.steps[:], core.prev_done[:] = 0, False
    obs = np.repeat(states, repeats, axis=0).astype(np.float32)
    action = np.repeat(actions, repeats)
    alive = np.ones(B, dtype=bool)
    rewards, dones, all_obs = np.zeros((horizon, B), np.float32), np.zeros((horizon, B), np.float32), []
    for t in range(horizon):
        all_obs.append(obs)
        obs_next, reward, terminated, _, _ = env.step(action)
        rewards[t] = reward * alive                                # nothing counts after the first episode ends
        dones[t] = terminated & alive
        alive &= ~terminated
        obs = obs_next
        action = agent.dist(torch.as_tensor(obs)).sample().numpy()
        if not alive.any():
            rewards, dones = rewards[: t + 1], dones[: t + 1]
            break
    env.close()
    all_obs.append(obs)
    return {"rewards": torch.as_tensor(rewards), "dones": torch.as_tensor(dones),
            "obs": torch.as_tensor(np.stack(all_obs)), "alive": torch.as_tensor(alive)}  # obs: (H + 1, B, 4)


def discounted_return(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """sum_t gamma^t r_t over the time axis of (H, B) rewards (already zero after an episode's end): (B,)."""
    return (rewards * gamma ** torch.arange(rewards.shape[0], dtype=torch.float32)[:, None]).sum(0)


# --8<-- [start:measure]
def error_split(a0: torch.Tensor, a_true: torch.Tensor) -> dict:
    """bias^2, variance and MSE of (K, M) estimates (M per state) against the truth (K,), averaged over the K
    states. The variance divides by M, not M - 1, so that MSE = bias^2 + variance holds exactly, state by state."""
    return {"bias^2": float(((a0.mean(1) - a_true) ** 2).mean()),
            "variance": float(a0.var(1, correction=0).mean()),       # over the rollouts, dividing by M
            "MSE": float(((a0 - a_true[:, None]) ** 2).mean())}


@torch.no_grad()
def measure(agent: ppo.ActorCritic, states: np.ndarray, actions: np.ndarray, args: Settings) -> list[dict]:
    """Bias^2, variance and MSE of the first-step GAE advantage, per lambda, against A_true = Q_MC(s, a) - V(s)."""
    K, M = len(states), args.rollouts
    truth = rollouts_from(agent, states, actions, args.truth_rollouts, args.horizon, args.seed + 1)
    q_samples = discounted_return(truth["rewards"], args.gamma).view(K, args.truth_rollouts)  # (K, M_truth)
    v0 = agent.value(torch.as_tensor(states))                                               # (K,)
    a_true = q_samples.mean(1) - v0                                                          # (K,)
    noise_floor = float((q_samples.var(1) / args.truth_rollouts).mean())                    # error of Q_MC itself
    est = rollouts_from(agent, states, actions, M, args.horizon, args.seed + 2)
    H = est["rewards"].shape[0]
    values = agent.value(est["obs"])                                                         # (H + 1, K*M)
    last_value = torch.zeros(K * M)  # cut at the horizon, as the truth is: no bootstrap past it, for any lambda
    rows = []
    for lam in args.lambdas:
        adv, _ = rl.compute_gae(est["rewards"], values[:H], est["dones"], last_value, args.gamma, lam)
        a0 = adv[0].view(K, M)                                                               # (K, M) estimates
        rows.append({"lambda": lam, **error_split(a0, a_true)})
    for r in rows:
        r["truth noise"] = noise_floor
    return rows  # at lambda = 1, E[bias^2] = E[variance] / (M - 1) + truth noise: sampling noise, no bias
# --8<-- [end:measure]


@torch.no_grad()
def one_episode(agent: ppo.ActorCritic, seed: int, steps: int = 300) -> dict:
    """A real rollout of `steps` steps in one env (SAME_STEP autoreset, so an episode end shows up as done)."""
    envs = ppo.make_envs(1, seed)
    obs, _ = envs.reset(seed=seed)
    buf, _ = ppo.collect_rollout(envs, agent, obs, steps, 0.99, [], np.zeros(1))
    return buf


def crossing(rows: list[dict]) -> tuple[float, float] | None:
    """The first two neighbouring lambdas where bias^2 is above the variance at the first and not at the second."""
    for a, b in zip(rows, rows[1:]):
        if a["bias^2"] > a["variance"] and b["bias^2"] <= b["variance"]:
            return a["lambda"], b["lambda"]
    return None


def plot_bias_variance(rows: list[dict], args: Settings) -> None:
    plt = plot.pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    # the lambdas evenly spaced, not to scale: on a linear lambda axis 0.95 ... 1, where the curves cross, would
    # be squeezed into the last twentieth of the width
    x, ticks = range(len(rows)), [f"{r['lambda']:g}" for r in rows]
    xlabel = "GAE lambda (the values measured, evenly spaced)"
    # bias^2 last, in front, with large hollow markers: at small lambda it equals the MSE and would hide under it
    for key, style, color, extra in (("variance", "s-", "C1", {}), ("MSE", "^-", "C2", {}),
                                     ("bias^2", "o--", "C0", {"ms": 9, "mfc": "none", "mew": 1.5, "zorder": 3})):
        ax.plot(x, [max(r[key], 1e-6) for r in rows], style, color=color, label=key, **extra)
    ax.axhline(rows[0]["truth noise"], ls=":", color="gray", label="noise of the MC ground truth")
    ax.set(yscale="log", xlabel=xlabel, ylabel="squared error of the advantage at (s, a)",
           title=f"bias and variance, log scale ({args.num_states} states x {args.rollouts} rollouts)")
    ax.set_xticks(x, ticks)
    ax.text(0.02, 0.02, "a variance of exactly 0 is drawn at 1e-6", transform=ax.transAxes, fontsize=7)
    ax.legend(fontsize=8)
    # the same MSE on a linear axis: the log axis spans orders of magnitude and flattens the minimum
    best_i = min(x, key=lambda i: rows[i]["MSE"])
    best = rows[best_i]
    ax2.plot(x, [r["MSE"] for r in rows], "^-", color="C2", label="MSE = bias^2 + variance")
    ax2.plot([best_i], [best["MSE"]], "o", ms=12, mfc="none", mec="black", label=f"lowest: lambda = "
             f"{best['lambda']:g}")
    # show every point when that leaves the minimum readable; otherwise cut the axis at 3x the lowest MSE and
    # write each point above the cut at the top edge with its value, so none silently falls off the panel
    top_mse = max(r["MSE"] for r in rows)
    top = 1.1 * top_mse if top_mse <= 5 * best["MSE"] else 3 * best["MSE"]
    for i, r in zip(x, rows):
        if r["MSE"] > top:
            ax2.annotate(f"{r['MSE']:.3g}\n(off scale)", (i, top), xytext=(0, -6), textcoords="offset points",
                         ha="center", va="top", fontsize=8, color="C2")
            ax2.plot([i], [top], "^", color="C2", ms=9, clip_on=False)
    ax2.set(ylim=(0, top), xlabel=xlabel, ylabel="MSE (linear scale)",
            title="where the mean squared error is lowest")
    ax2.set_xticks(x, ticks)
    ax2.legend(fontsize=8)
    print(f"figure: {plot.save(fig, args, 'gae_bias_variance')}")


# --8<-- [start:episode]
def episode_picture(buf: dict, gamma: float, lambdas: tuple[float, ...] = (0.0, 0.95, 1.0)) -> dict:
    """What the lesson draws of one real rollout (one env): per step the reward r_t, the critic's V(s_t), the done
    flag, the TD error delta_t (compute_gae with lambda = 0 is exactly delta_t) and the advantage for each lambda.
    Lists, for the figure and the --json."""
    r, v, d, lv = buf["rewards"], buf["values"], buf["dones"], buf["last_value"]
    out = {"gamma": gamma, "rewards": r[:, 0].tolist(), "values": v[:, 0].tolist(), "dones": d[:, 0].tolist(),
           "last_value": float(lv[0]), "td_errors": rl.compute_gae(r, v, d, lv, gamma, 0.0)[0][:, 0].tolist()}
    out["advantages"] = {f"{lam:g}": rl.compute_gae(r, v, d, lv, gamma, lam)[0][:, 0].tolist() for lam in lambdas}
    out["ends"] = [t for t, x in enumerate(out["dones"]) if x]  # episode ends after these steps
    if out["ends"]:  # the step that ends the first episode, and the one before it, as the lesson reads them
        out["at_end"], out["before_end"] = ({"t": t, "r": out["rewards"][t], "V": out["values"][t],
                                             "delta": out["td_errors"][t],
                                             "A": [a[t] for a in out["advantages"].values()]}  # in lambdas' order
                                            for t in (out["ends"][0], out["ends"][0] - 1))
    return out
# --8<-- [end:episode]


def print_episode(ep: dict, before: int = 6, after: int = 2) -> None:
    """The steps around the rollout's first episode end, as numbers: what the figure draws there."""
    ends = ep["ends"]
    end = ends[0] if ends else len(ep["dones"]) - 1
    rows = [{"t": t, "r_t": ep["rewards"][t], "V(s_t)": ep["values"][t], "done": int(ep["dones"][t]),
             "delta_t": ep["td_errors"][t], **{f"A (lambda {k})": a[t] for k, a in ep["advantages"].items()}}
            for t in range(max(0, end - before), min(len(ep["dones"]), end + after + 1))]
    print(f"one real rollout of {len(ep['dones'])} steps (gae_advantages.png); episode ends after steps {ends}; "
          f"the steps around the first end:")
    print(report.table(rows, floatfmt=".3f"))


def plot_episode(ep: dict, args: Settings) -> None:
    plt = plot.pyplot()
    t = range(len(ep["rewards"]))
    fig, axes = plt.subplots(4, 1, figsize=(9, 7.5), sharex=True, height_ratios=(1, 1.3, 1.3, 2))
    axes[0].step(t, ep["rewards"], where="mid", color="C2", label="reward r_t")
    axes[0].set(ylabel="r_t", ylim=(0, 1.5 * max(1.0, max(ep["rewards"]))))
    axes[0].text(0.01, 0.12, "CartPole pays 1 for every step the pole stays up", transform=axes[0].transAxes,
                 fontsize=8)
    axes[1].plot(t, ep["values"], color="C0", label="V(s_t): the critic's guess of the return to come")
    axes[1].set(ylabel="V(s_t)")
    axes[2].plot(t, ep["td_errors"], color="C1", label="TD error delta_t = r_t + gamma V(s_t+1) - V(s_t)")
    axes[2].axhline(0, color="black", lw=0.6)
    axes[2].set(ylabel="delta_t")
    for i, (lam, adv) in enumerate(ep["advantages"].items()):
        axes[3].plot(t, adv, color=("C3", "C9", "C4")[i % 3], label=f"advantage A_t, lambda = {lam}")
    axes[3].axhline(0, color="black", lw=0.6)
    axes[3].set(xlabel="step t", ylabel="A_t")
    for ax in axes:
        for end in (k for k, d in enumerate(ep["dones"]) if d):
            ax.axvline(end + 0.5, color="gray", ls="--", lw=1)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)  # beside, not over
    axes[0].set_title(f"one real rollout of the policy under study, step by step (dashed: an episode ends; "
                      f"gamma = {ep['gamma']:g})", fontsize=10)
    print(f"figure: {plot.save(fig, args, 'gae_advantages')}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"train_steps": 1024, "num_states": 6, "rollouts": 8,
                                               "truth_rollouts": 16, "horizon": 60, "lambdas": [0.0, 0.9, 1.0]})
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    policy_args = ppo.Settings(total_steps=args.train_steps, eval_every=10**9, num_envs=8, num_steps=128
                               if args.train_steps >= 1024 else args.train_steps // 8)
    run = ppo.train(policy_args, args.seed, progress=False)
    agent = run["agent"]
    print(f"policy under study: PPO after {run['steps']:,} env steps, mean return {run['eval_return']:.1f} "
          f"(of 500) over {policy_args.eval_episodes} episodes")
    mse = fit_critic(agent, args.seed + 3, args.gamma, *((64, 20) if args.smoke else ()))
    print(f"critic refit on the fixed policy's Monte-Carlo returns: MSE {mse:.3g}\n")
    states, actions = start_states(agent, args.num_states, args.seed)
    rows = measure(agent, states, actions, args)
    print(report.table(rows, floatfmt=".4g"))
    best = min(rows, key=lambda r: r["MSE"])
    one = rows[-1] if rows[-1]["lambda"] == 1.0 else None
    noise_only = one["variance"] / (args.rollouts - 1) + one["truth noise"] if one else None  # E[bias^2], unbiased
    cross = crossing(rows)
    if cross:
        print(f"the variance overtakes bias^2 between lambda = {cross[0]:g} and lambda = {cross[1]:g}")
    if one:
        print(f"lambda = 1: bias^2 {one['bias^2']:.3g}; an unbiased estimate would show {noise_only:.3g} on average, "
              f"from sampling noise alone (variance / ({args.rollouts} - 1) + the truth's noise)")
    print(f"\nlowest MSE at lambda = {best['lambda']:g}: variance {best['variance']:.3g}, bias^2 {best['bias^2']:.3g}; "
          f"lambda = {rows[0]['lambda']:g}: bias^2 {rows[0]['bias^2']:.3g}; lambda = {rows[-1]['lambda']:g}: "
          f"variance {rows[-1]['variance']:.3g}")
    buf = one_episode(agent, args.seed)
    gae_args = (buf["rewards"], buf["values"], buf["dones"], buf["last_value"], args.gamma, 0.95)
    report.expect_close("GAE vectorized vs loop on the plotted rollout", rl.compute_gae(*gae_args)[0],
                        rl.compute_gae_loop(*gae_args)[0], rtol=1e-4, atol=1e-4)
    episode = episode_picture(buf, args.gamma)
    print()
    print_episode(episode)
    plot_bias_variance(rows, args)
    plot_episode(episode, args)
    if args.json:
        report.write_json(args.json, {"policy_return": run["eval_return"], "rows": rows, "best_lambda": best["lambda"],
                                      "crossing": cross, "lambda1_noise_only": noise_only, "episode": episode}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
