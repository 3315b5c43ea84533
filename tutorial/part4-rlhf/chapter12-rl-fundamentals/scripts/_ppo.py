"""Chapter 12's PPO machinery, shared by its three scripts: settings, actor-critic, vectorized environments,
rollouts with GAE, the clipped PPO update and the training loop.

ppo_cartpole.py trains with it, gae_lambda.py trains a policy with it and then measures GAE on that policy, and
reinforce_vs_ppo.py swaps in REINFORCE's update and compares. A file starting with _ is a helper, not a script.
"""


from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from mlsys import cli, report, rl


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    env_id: str = "CartPole-v1"
    """gymnasium id of a classic-control environment with a discrete action space (cleanrl's flag): CartPole-v1,
    Acrobot-v1, MountainCar-v0."""
    total_steps: int = 150_000
    """Env-step budget (training steps over all envs; evaluation steps are not counted)."""
    max_seconds: float = 180.0
    """CPU-time budget of one run in seconds of this process's CPU, evaluations included (CPU time, not wall
    clock, so a run on a busy machine is not stopped for waiting its turn)."""
    num_envs: int = 8
    """Parallel copies of the environment (gymnasium SyncVectorEnv)."""
    num_steps: int = 128
    """Rollout length per env per update: a batch is num_envs * num_steps transitions."""
    num_minibatches: int = 4
    """Minibatches per epoch."""
    update_epochs: int = 10
    """Passes over each batch."""
    lr: float = 1e-3
    """Adam learning rate, annealed linearly to 0 over --total-steps."""
    gamma: float = 0.99
    """Discount factor."""
    gae_lambda: float = 0.95
    """GAE lambda: 0 is one-step TD, 1 is Monte Carlo."""
    clip_eps: float = 0.2
    """PPO clip range for the probability ratio (and the value clipping)."""
    clip_vloss: bool = False
    """Also clip the value update to --clip-eps around the rollout's values (PPO2/cleanrl style). Off by default:
    with unnormalized returns of ~100, a 0.2 step per update leaves the critic far behind."""
    ent_coef: float = 0.0
    """Entropy bonus coefficient: 0 by default, so the loss has no entropy term (cleanrl uses 0.01 on CartPole)."""
    vf_coef: float = 0.5
    """Value-loss coefficient."""
    max_grad_norm: float = 0.5
    """Clip the global gradient norm to this."""
    hidden: int = 64
    """Width of the two tanh hidden layers of actor and critic."""
    eval_every: int = 4
    """Evaluate every this many updates: the policy sampling its actions (the solve criterion), and the greedy
    policy beside it for comparison."""
    eval_episodes: int = 20
    """Episodes per evaluation (played in parallel)."""
    solve_return: float = float("nan")
    """Mean evaluation return that counts as solved (nan: the environment's reward_threshold, 475 on CartPole-v1)."""
    seeds: list[int] = field(default_factory=list)
    """Benchmark: one full run per seed (e.g. --seeds 0 1 2) and a table of steps and time to solve."""

    def validate(self) -> None:
        if any(not 0 <= s < 2**32 for s in self.seeds):  # gymnasium's range
            raise cli.UsageError(f"--seeds must lie in 0..2**32-1, got {self.seeds}")
        if min(self.num_envs, self.num_steps, self.num_minibatches, self.update_epochs, self.eval_every,
               self.eval_episodes, self.hidden) < 1:
            raise cli.UsageError("sizes (--num-envs, --num-steps, --num-minibatches, ...) must be >= 1")
        if (self.num_envs * self.num_steps) % self.num_minibatches:
            raise cli.UsageError("--num-envs * --num-steps must be divisible by --num-minibatches")
        if self.total_steps < self.num_envs * self.num_steps:
            raise cli.UsageError("--total-steps must cover at least one rollout (num_envs * num_steps)")
        if not (0 <= self.gamma <= 1 and 0 <= self.gae_lambda <= 1 and self.clip_eps > 0 and self.lr > 0):
            raise cli.UsageError("need 0 <= --gamma, --gae-lambda <= 1 and --clip-eps, --lr > 0")
        self.obs_dim, self.num_actions, threshold = env_sizes(self.env_id)
        if math.isnan(self.solve_return):
            if threshold is None:
                raise cli.UsageError(f"{self.env_id} has no reward_threshold in its spec: pass --solve-return")
            self.solve_return = float(threshold)


def env_sizes(env_id: str) -> tuple[int, int, float | None]:
    """(observation size, number of actions, reward threshold) of a classic-control env with discrete actions;
    a one-line usage error for anything else."""
    try:
        spec = gym.spec(env_id)
    except gym.error.Error as err:
        raise cli.UsageError(f"--env-id {env_id!r}: {err}") from None
    if not str(spec.entry_point).startswith("gymnasium.envs.classic_control"):
        raise cli.UsageError(f"--env-id {env_id!r} is not a classic-control environment (try CartPole-v1, Acrobot-v1)")
    env = gym.make(env_id)
    obs_space, act_space = env.observation_space, env.action_space
    env.close()
    if not isinstance(act_space, gym.spaces.Discrete) or len(obs_space.shape) != 1:
        raise cli.UsageError(f"--env-id {env_id!r} needs a discrete action space and a flat observation; it has "
                             f"{act_space} and {obs_space}")
    return obs_space.shape[0], int(act_space.n), spec.reward_threshold


# --8<-- [start:agent]
def layer(n_in: int, n_out: int, std: float) -> nn.Linear:
    """Orthogonal init (a detail that matters for PPO: "The 37 Implementation Details of PPO", ICLR blog 2022)."""
    lin = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(lin.weight, std)
    nn.init.zeros_(lin.bias)
    return lin


class ActorCritic(nn.Module):
    """Two separate MLPs: the actor maps an observation (B, obs_dim) to action logits (B, num_actions), the critic to
    V(s) (B,). CartPole-v1: obs_dim 4, num_actions 2."""

    def __init__(self, obs_dim: int = 4, num_actions: int = 2, hidden: int = 64) -> None:
        super().__init__()
        self.critic = nn.Sequential(layer(obs_dim, hidden, 2**0.5), nn.Tanh(), layer(hidden, hidden, 2**0.5),
                                    nn.Tanh(), layer(hidden, 1, 1.0))
        self.actor = nn.Sequential(layer(obs_dim, hidden, 2**0.5), nn.Tanh(), layer(hidden, hidden, 2**0.5),
                                   nn.Tanh(), layer(hidden, num_actions, 0.01))  # near-uniform policy at start

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def dist(self, obs: torch.Tensor) -> torch.distributions.Categorical:
        return torch.distributions.Categorical(logits=self.actor(obs))
# --8<-- [end:agent]


def make_envs(num_envs: int, seed: int, env_id: str = "CartPole-v1",
              max_episode_steps: int | None = None) -> gym.vector.SyncVectorEnv:
    """num_envs copies of the environment stepped in lockstep. SAME_STEP autoreset (gymnasium >= 1.1): when an episode
    ends, step() already returns the next episode's first observation and puts the last one in info["final_obs"].
    (The 1.x default, NEXT_STEP, would instead spend the following step() on the reset, with a dummy transition.)"""
    envs = gym.vector.SyncVectorEnv([lambda: gym.make(env_id, max_episode_steps=max_episode_steps)] * num_envs,
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    envs.reset(seed=seed)
    envs.action_space.seed(seed)
    return envs


# --8<-- [start:rollout]
@torch.no_grad()
def collect_rollout(envs, agent: ActorCritic, obs: np.ndarray, num_steps: int, gamma: float,
                    episodes: list[float], running: np.ndarray) -> tuple[dict, np.ndarray]:
    """Play num_steps steps in every env with the current policy. Returns time-major (T, N) tensors and the
    observation to continue from. Finished episodes' returns are appended to `episodes` (running: (N,) sums)."""
    T, N = num_steps, envs.num_envs
    buf = {k: torch.zeros(T, N) for k in ("actions", "logp", "values", "rewards", "dones", "truncated")}
    buf["obs"] = torch.zeros(T, N, obs.shape[-1])
    for t in range(T):
        obs_t = torch.as_tensor(obs)                              # (N, 4)
        dist = agent.dist(obs_t)
        action = dist.sample()                                    # (N,)
        buf["obs"][t], buf["actions"][t], buf["logp"][t] = obs_t, action, dist.log_prob(action)
        buf["values"][t] = agent.value(obs_t)
        obs, reward, terminated, truncated, info = envs.step(action.numpy())
        running += reward
        done = terminated | truncated
        episodes.extend(running[done].tolist())
        running[done] = 0.0
        # A time-limit truncation is not a failure: bootstrap with gamma * V(last obs), as if the episode went on.
        cut = np.flatnonzero(truncated & ~terminated)
        if cut.size:
            final = torch.as_tensor(np.stack(info["final_obs"][cut]), dtype=torch.float32)
            reward = reward.astype(np.float32)
            reward[cut] += gamma * agent.value(final).numpy()
        buf["rewards"][t], buf["dones"][t] = torch.as_tensor(reward), torch.as_tensor(done)
        buf["truncated"][t] = torch.as_tensor(truncated & ~terminated)  # kept for the picture of the buffer
    buf["last_value"] = agent.value(torch.as_tensor(obs))      # (N,) V of the state after the last step
    return buf, obs
# --8<-- [end:rollout]


# --8<-- [start:update]
def ppo_update(agent: ActorCritic, opt: torch.optim.Optimizer, buf: dict, args: Settings) -> dict:
    """--update-epochs passes of minibatch SGD on the PPO loss over one rollout; returns the last epoch's means,
    and under "minibatch" what the loss saw in the last minibatch of the last epoch (for the lesson's picture)."""
    adv, ret = rl.compute_gae(buf["rewards"], buf["values"], buf["dones"], buf["last_value"],
                              args.gamma, args.gae_lambda)       # (T, N) each
    flat = {k: buf[k].flatten(0, 1) for k in ("obs", "actions", "logp", "values")}  # (T*N, ...)
    adv, ret = adv.flatten(), ret.flatten()
    batch = adv.numel()
    for _epoch in range(args.update_epochs):
        log: dict[str, list[float]] = {}
        for mb in torch.randperm(batch).split(batch // args.num_minibatches):
            dist = agent.dist(flat["obs"][mb])
            logp_new = dist.log_prob(flat["actions"][mb])
            pg_loss, stats = rl.ppo_policy_loss(logp_new, flat["logp"][mb], rl.masked_whiten(adv[mb]),
                                                args.clip_eps)  # advantages normalized per minibatch
            v_loss = rl.ppo_value_loss(agent.value(flat["obs"][mb]), flat["values"][mb], ret[mb],
                                     args.clip_eps if args.clip_vloss else None)
            entropy = dist.entropy().mean()
            loss = pg_loss - args.ent_coef * entropy + args.vf_coef * v_loss
            opt.zero_grad()
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            opt.step()
            for k, v in {**stats, "pg_loss": pg_loss.item(), "v_loss": v_loss.item(), "entropy": entropy.item(),
                         "grad_norm": grad_norm.item()}.items():
                log.setdefault(k, []).append(v)
            seen = {"logp_new": logp_new.detach(), "logp_old": flat["logp"][mb], "stats": stats,
                    "advantages": rl.masked_whiten(adv[mb])}  # recorded only: the update is unchanged
    return {**{k: float(np.mean(v)) for k, v in log.items()}, "minibatch": seen}
# --8<-- [end:update]


@torch.no_grad()
def evaluate(agent: ActorCritic, episodes: int, seed: int, greedy: bool = True,
             env_id: str = "CartPole-v1") -> np.ndarray:
    """Play `episodes` episodes in parallel (one per env) and return their returns, shape (episodes,)."""
    envs = make_envs(episodes, seed, env_id)
    obs, _ = envs.reset(seed=seed)
    returns, alive = np.zeros(episodes), np.ones(episodes, dtype=bool)
    while alive.any():
        dist = agent.dist(torch.as_tensor(obs))
        action = dist.probs.argmax(-1) if greedy else dist.sample()
        obs, reward, terminated, truncated, _ = envs.step(action.numpy())
        returns += reward * alive
        alive &= ~(terminated | truncated)  # an env counts only its first episode
    envs.close()
    return returns


def train(args: Settings, seed: int, progress: bool = True, update_fn=None, name: str = "PPO") -> dict:
    """One run; stops when solved or out of budget. Returns the agent, the curves and the verdict.
    update_fn(agent, opt, buf, args) -> stats replaces ppo_update (reinforce_vs_ppo.py passes REINFORCE's)."""
    update_fn = update_fn or ppo_update
    torch.manual_seed(seed)
    np.random.seed(seed)
    env_id = getattr(args, "env_id", "CartPole-v1")
    envs = make_envs(args.num_envs, seed, env_id)
    obs, _ = envs.reset(seed=seed)
    obs_dim, num_actions = envs.single_observation_space.shape[0], int(envs.single_action_space.n)  # from the spaces
    agent = ActorCritic(obs_dim, num_actions, hidden=args.hidden)
    opt = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    batch = args.num_envs * args.num_steps
    num_updates = args.total_steps // batch
    episodes: list[float] = []
    running = np.zeros(args.num_envs)
    curve, evals, updates, minibatches = [], [], [], []
    start, cpu_start, solved_at = time.perf_counter(), time.process_time(), None
    bar = tqdm(range(1, num_updates + 1), desc=f"{name} seed {seed}", leave=False,
               disable=None if progress else True)  # None: shown only when stderr is a terminal
    for update in bar:
        opt.param_groups[0]["lr"] = args.lr * (1.0 - (update - 1) / num_updates)  # linear annealing
        n_before = len(episodes)
        buf, obs = collect_rollout(envs, agent, obs, args.num_steps, args.gamma, episodes, running)
        if update == 1:  # self-check: the vectorized GAE equals the plain loop on real rollout data
            args_gae = (buf["rewards"], buf["values"], buf["dones"], buf["last_value"], args.gamma, args.gae_lambda)
            report.expect_close("GAE vectorized vs loop", rl.compute_gae(*args_gae)[0],
                                rl.compute_gae_loop(*args_gae)[0], rtol=1e-4, atol=1e-4)
        stats = update_fn(agent, opt, buf, args)
        steps = update * batch
        curve += [(steps, r) for r in episodes[n_before:]]
        minibatches.append(stats.pop("minibatch", None))  # kept out of the per-update log (and the --json)
        updates.append({"steps": steps, **stats})
        bar.set_postfix(ret=f"{np.mean(episodes[-20:]) if episodes else 0:.0f}", kl=f"{stats['approx_kl']:.4f}",
                        clip=f"{stats['clip_frac']:.2f}")
        last = update == num_updates or time.process_time() - cpu_start > args.max_seconds
        if update % args.eval_every == 0 or last:
            score = float(evaluate(agent, args.eval_episodes, 10_000 + seed, greedy=False, env_id=env_id).mean())
            greedy = float(evaluate(agent, args.eval_episodes, 10_000 + seed, greedy=True, env_id=env_id).mean())
            evals.append({"steps": steps, "seconds": time.perf_counter() - start, "eval_return": score,
                          "greedy_return": greedy})
            if score >= args.solve_return:
                solved_at = evals[-1]
                break
        if last:
            break
    bar.close()
    envs.close()
    return {"agent": agent, "seed": seed, "solved": solved_at is not None, "evals": evals, "updates": updates,
            "curve": curve, "minibatches": minibatches,
            **{k: evals[-1][k] for k in ("steps", "seconds", "eval_return")}}
