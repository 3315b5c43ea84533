"""Chapter 12 oracles: GAE (vectorized vs loop vs hand-worked cases, its lambda = 0 and lambda = 1 limits), the PPO
policy and value losses against hand computations (clipping on both sides, gradients included), the masked helpers
against numpy, and the PPO script's pieces (rollout bookkeeping, the solve itself as a slow test)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import load_script, run, run_json, scripts_dir, smoke_run
from mlsys import rl

CH12 = scripts_dir(12)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: torch's intra-op threads only add contention (10x slower on a loaded 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_rollout(T: int = 9, N: int = 5, p_done: float = 0.25, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rewards, values = torch.randn(T, N, generator=g), torch.randn(T, N, generator=g)
    dones = (torch.rand(T, N, generator=g) < p_done).float()
    return rewards, values, dones, torch.randn(N, generator=g)


# ------------------------------------------------------------------------------------------------------ GAE
def test_gae_hand_case_no_episode_end() -> None:
    r, v, lv = torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[0.5], [1.0], [1.5]]), torch.tensor([2.0])
    d = torch.zeros(3, 1)
    adv, ret = rl.compute_gae(r, v, d, lv, gamma=0.5, lam=0.5)
    # deltas: 1 + .5*1 - .5 = 1,  2 + .5*1.5 - 1 = 1.75,  3 + .5*2 - 1.5 = 2.5;  gamma*lam = 0.25
    # A2 = 2.5, A1 = 1.75 + .25*2.5 = 2.375, A0 = 1 + .25*2.375 = 1.59375
    assert adv[:, 0].tolist() == [1.59375, 2.375, 2.5]
    assert ret[:, 0].tolist() == [1.59375 + 0.5, 2.375 + 1.0, 2.5 + 1.5]


def test_gae_hand_case_episode_end_stops_bootstrap_and_carry() -> None:
    r, v, lv = torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[0.5], [1.0], [1.5]]), torch.tensor([2.0])
    d = torch.tensor([[0.0], [1.0], [0.0]])  # the episode ends after step 1; step 2 starts a new one
    adv, _ = rl.compute_gae(r, v, d, lv, gamma=0.5, lam=0.5)
    # delta1 = 2 - 1 = 1 (no V(s2)); A1 = 1 (nothing carried from the next episode); A0 = 1 + .25*1 = 1.25
    assert adv[:, 0].tolist() == [1.25, 1.0, 2.5]


def test_gae_hand_case_two_envs_differ() -> None:
    r = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    v = torch.zeros(2, 2)
    d = torch.tensor([[0.0, 0.0], [1.0, 0.0]])  # env 0 ends at the last step, env 1 bootstraps from last_value
    adv, _ = rl.compute_gae(r, v, d, torch.tensor([10.0, 10.0]), gamma=0.9, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[1.9, 1 + 0.9 * (1 + 9.0)], [1.0, 1 + 9.0]]))


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (0.9, 0.0), (1.0, 1.0), (0.5, 0.3)])
def test_gae_vectorized_equals_loop(gamma: float, lam: float) -> None:
    for seed in range(3):
        r, v, d, lv = random_rollout(T=17, N=6, seed=seed)
        a1, r1 = rl.compute_gae(r, v, d, lv, gamma, lam)
        a2, r2 = rl.compute_gae_loop(r, v, d, lv, gamma, lam)
        torch.testing.assert_close(a1, a2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r1, r2, rtol=1e-5, atol=1e-5)


def test_gae_lambda_zero_is_one_step_td() -> None:
    r, v, d, lv = random_rollout()
    adv, _ = rl.compute_gae(r, v, d, lv, gamma=0.9, lam=0.0)
    next_v = torch.cat([v[1:], lv[None]])
    torch.testing.assert_close(adv, r + 0.9 * next_v * (1 - d) - v)


def test_gae_lambda_one_is_monte_carlo_return_minus_value() -> None:
    r, v, d, lv = random_rollout(T=12, N=4)
    gamma = 0.9
    adv, ret = rl.compute_gae(r, v, d, lv, gamma=gamma, lam=1.0)
    T, N = r.shape
    for n in range(N):  # discounted sum of rewards to the episode's end (or bootstrapped by last_value), numpy
        for t in range(T):
            g, k = 0.0, t
            while True:
                g += gamma ** (k - t) * float(r[k, n])
                if d[k, n]:
                    break
                if k == T - 1:
                    g += gamma ** (T - t) * float(lv[n])
                    break
                k += 1
            assert math.isclose(float(ret[t, n]), g, rel_tol=1e-5, abs_tol=1e-5)
            assert math.isclose(float(adv[t, n]), g - float(v[t, n]), rel_tol=1e-5, abs_tol=1e-5)


# ----------------------------------------------------------------------------------------------- PPO losses
def hand_case():
    ratio = torch.tensor([0.5, 1.1, 1.5, 0.5, 1.1, 1.5])
    logp_new = ratio.log().requires_grad_()
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    return ratio, logp_new, torch.zeros(6), adv


def test_policy_loss_hand_case_both_sides() -> None:
    ratio, logp_new, logp_old, adv = hand_case()
    loss, stats = rl.ppo_policy_loss(logp_new, logp_old, adv, clip_eps=0.2)
    # A > 0: -min(r, clip r) = -0.5, -1.1, -1.2 (clipped at 1 + eps); A < 0: max(r, clip r) = 0.8 (clipped at
    # 1 - eps), 1.1, 1.5.  Mean = (-2.8 + 3.4) / 6 = 0.1
    assert math.isclose(loss.item(), 0.1, abs_tol=1e-6)
    loss.backward()
    # d loss / d logp = d loss / d r * r: zero where the clipped term wins (A>0, r=1.5 and A<0, r=0.5)
    want = torch.tensor([-0.5, -1.1, 0.0, 0.0, 1.1, 1.5]) / 6
    torch.testing.assert_close(logp_new.grad, want)
    assert math.isclose(stats["clip_frac"], 4 / 6, abs_tol=1e-6)
    kl = float(((ratio - 1) - ratio.log()).mean())
    assert math.isclose(stats["approx_kl"], kl, rel_tol=1e-5)
    assert math.isclose(stats["ratio_mean"], float(ratio.mean()), rel_tol=1e-6)


def test_policy_loss_mask_ignores_masked_positions() -> None:
    ratio, logp_new, logp_old, adv = hand_case()
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    loss, stats = rl.ppo_policy_loss(logp_new, logp_old, adv, 0.2, mask=mask)
    assert math.isclose(loss.item(), (-0.5 - 1.1 + 1.1 + 1.5) / 4, abs_tol=1e-6)
    assert math.isclose(stats["clip_frac"], 2 / 4, abs_tol=1e-6)


def test_policy_loss_at_ratio_one_is_the_vanilla_policy_gradient() -> None:
    # before the first update (new == old) PPO's gradient is REINFORCE's: -mean(A * grad log pi)
    logp = torch.randn(8, requires_grad=True)
    adv = torch.randn(8)
    loss, stats = rl.ppo_policy_loss(logp, logp.detach(), adv, 0.2)
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv / 8)
    assert stats["clip_frac"] == 0.0 and abs(stats["approx_kl"]) < 1e-7


def test_approx_kl_k3_estimates_the_true_kl() -> None:
    # samples from the old policy; mean of (r - 1) - log r with r = p_new / p_old estimates KL(old || new)
    old, new = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.4, 0.4, 0.2])
    g = torch.Generator().manual_seed(0)
    idx = torch.multinomial(old, 200_000, replacement=True, generator=g)
    _, stats = rl.ppo_policy_loss(new.log()[idx], old.log()[idx], torch.zeros(idx.numel()), 0.2)
    true_kl = float((old * (old / new).log()).sum())
    assert math.isclose(stats["approx_kl"], true_kl, rel_tol=0.05)


def test_value_loss_hand_case() -> None:
    new, old, ret = torch.tensor([1.0, 3.0]), torch.tensor([2.0, 2.0]), torch.tensor([0.0, 0.0])
    assert math.isclose(rl.ppo_value_loss(new, old, ret).item(), 0.5 * (1 + 9) / 2)
    # clipped: old + clamp(new - old, -.5, .5) = 1.5, 2.5 -> errors 2.25, 6.25; max with 1, 9 -> 2.25, 9
    assert math.isclose(rl.ppo_value_loss(new, old, ret, clip_eps=0.5).item(), 0.5 * (2.25 + 9) / 2)
    assert math.isclose(rl.ppo_value_loss(new, old, ret, mask=torch.tensor([0.0, 1.0])).item(), 4.5)


def test_masked_mean_and_whiten_match_numpy() -> None:
    g = torch.Generator().manual_seed(0)
    x, mask = torch.randn(4, 7, generator=g) * 3 + 1, (torch.rand(4, 7, generator=g) < 0.6).float()
    sel = x.numpy()[mask.numpy() == 1]
    assert math.isclose(rl.masked_mean(x, mask).item(), float(sel.mean()), rel_tol=1e-5)
    w = rl.masked_whiten(x, mask).numpy()[mask.numpy() == 1]
    np.testing.assert_allclose(w, (sel - sel.mean()) / sel.std(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(rl.masked_whiten(x).numpy(), (x.numpy() - x.numpy().mean()) / x.numpy().std(),
                               rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------- PPO script
def test_rollout_bookkeeping_on_real_cartpole() -> None:
    """Episode returns counted by collect_rollout equal the number of steps between dones (reward 1 per step),
    and a time-limit truncation is bootstrapped: reward 1 + gamma * V(final obs), while done is still set."""
    ppo = load_script(CH12 / "_ppo.py")
    torch.manual_seed(0)
    envs = ppo.make_envs(3, seed=0)
    obs, _ = envs.reset(seed=0)
    agent = ppo.ActorCritic()
    episodes, running = [], np.zeros(3)
    buf, _ = ppo.collect_rollout(envs, agent, obs, 120, 0.99, episodes, running)
    lengths = []
    for n in range(3):
        ends = torch.nonzero(buf["dones"][:, n]).flatten().tolist()
        lengths += [b - a for a, b in zip([-1] + ends, ends)]
    assert sorted(episodes) == sorted(float(x) for x in lengths) and len(episodes) > 3
    assert torch.all(buf["rewards"] == 1.0)  # random policy: no episode reaches the 500-step limit here

    envs = ppo.make_envs(1, seed=0)
    obs, _ = envs.reset(seed=0)
    envs.envs[0]._elapsed_steps = 499  # gymnasium's TimeLimit wrapper: the next step hits the 500-step limit
    agent.value = lambda x: torch.full((x.shape[0],), 7.0)  # a critic with a known value everywhere
    buf, _ = ppo.collect_rollout(envs, agent, obs, 1, 0.99, [], np.zeros(1))
    assert buf["dones"][0, 0] == 1.0
    assert math.isclose(float(buf["rewards"][0, 0]), 1.0 + 0.99 * 7.0, rel_tol=1e-6)


def test_rollout_grid_picture_matches_a_replay_in_single_gymnasium_envs() -> None:
    """The buffer the lesson draws (ppo_cartpole.rollout_grid) against an independent replay: each env n replayed
    alone in gymnasium's own CartPole with the same time limit, seed + n and the recorded actions. Where the
    replay terminates, the grid shows a fall (done, plain reward 1); where it truncates, a time-limit end (done,
    reward 1 + gamma * V(the replay's last observation)); everywhere else an ordinary step."""
    import gymnasium as gym

    script = load_script(CH12 / "ppo_cartpole.py")
    grid = script.rollout_grid(seed=0)
    torch.manual_seed(0)
    agent = load_script(CH12 / "_ppo.py").ActorCritic()   # the same untrained weights rollout_grid builds
    kinds = set()
    for n, actions in enumerate(grid["actions"]):
        env = gym.make("CartPole-v1", max_episode_steps=grid["time_limit"])
        env.reset(seed=grid["seed"] + n)
        for t, action in enumerate(actions):
            obs, reward, terminated, truncated, _ = env.step(int(action))
            want = reward
            if truncated and not terminated:
                with torch.no_grad():
                    want += grid["gamma"] * float(agent.value(torch.as_tensor(obs, dtype=torch.float32)[None])[0])
            assert grid["dones"][n][t] == float(terminated or truncated), (n, t)
            assert grid["truncated"][n][t] == float(truncated and not terminated), (n, t)
            assert math.isclose(grid["rewards"][n][t], want, rel_tol=1e-5), (n, t, grid["rewards"][n][t], want)
            kinds.add("limit" if truncated and not terminated else "fell" if terminated else "step")
            if terminated or truncated:
                env.reset()
    assert kinds == {"step", "fell", "limit"}, f"the picture should show all three kinds of step, got {kinds}"


@pytest.mark.slow
@pytest.mark.long  # a learning check of 15 s or more: make sweep (and CI) run it
@pytest.mark.timeout(300)
def test_ppo_solves_cartpole_default_seed(tmp_path_factory) -> None:
    (res,) = run_json(tmp_path_factory, CH12 / "ppo_cartpole.py", timeout=290)["runs"]
    # the criterion is the sampled policy's mean return over the evaluation episodes, gymnasium's threshold
    assert res["solved"] and res["eval_return"] >= 475 and res["steps"] <= 150_000


# ------------------------------------------------------------------------------- GAE lambda and REINFORCE
def test_batched_rollouts_start_from_the_given_state_and_action() -> None:
    """gae_lambda.rollouts_from sets gymnasium's vectorized CartPole to given states; its first step must equal
    the single-env CartPoleEnv stepped from the same state with the same action."""
    import gymnasium as gym

    gl = load_script(CH12 / "gae_lambda.py")
    torch.manual_seed(0)
    agent = gl.ppo.ActorCritic()
    states = np.array([[0.01, 0.2, -0.03, 0.1], [-0.5, -0.3, 0.1, 0.4], [0.0, 0.0, 0.19, 1.5]], np.float32)
    actions = np.array([1, 0, 1])
    out = gl.rollouts_from(agent, states, actions, repeats=4, horizon=30, seed=0)
    env = gym.make("CartPole-v1").unwrapped
    env.reset(seed=0)
    for k in range(3):
        env.state = states[k].astype(np.float64)
        obs1, r, term, _, _ = env.step(int(actions[k]))
        for m in range(4):
            np.testing.assert_allclose(out["obs"][1, 4 * k + m].numpy(), obs1, rtol=1e-6, atol=1e-6)
            assert out["dones"][0, 4 * k + m] == float(term)
    assert out["dones"][0, 8] == 1.0 and out["rewards"][1:, 8].sum() == 0  # pole past 12 degrees: ends at once
    # after an episode ends nothing more is counted: each column has at most one done, rewards stop after it
    assert torch.all(out["dones"].sum(0) <= 1)
    for b in range(12):
        ends = torch.nonzero(out["dones"][:, b]).flatten()
        if len(ends):
            assert out["rewards"][ends[0] + 1:, b].sum() == 0


def test_discounted_return_and_crossing() -> None:
    gl = load_script(CH12 / "gae_lambda.py")
    r = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    torch.testing.assert_close(gl.discounted_return(r, 0.5), torch.tensor([1.75, 1.0]))
    rv = load_script(CH12 / "reinforce_vs_ppo.py")
    curve = [(100 * i, float(i)) for i in range(1, 50)]  # mean of 20 consecutive i's reaches 30 at i = 40
    assert rv.running_mean_crossing(curve, 30.5) == 4000 and rv.running_mean_crossing(curve, 1e9) is None
    rise_and_fall = [(10 * i, float(r)) for i, r in enumerate([0] * 5 + [90] * 3 + [0] * 5 + [60] * 3)]
    # windows of 3: the mean reaches 90 at step 70 (three 90s), falls to 0 at step 120, climbs to 60 at the end
    assert rv.running_mean_drop(rise_and_fall, window=3) == {"drop": 90.0, "peak": 90.0, "peak_step": 70,
                                                              "low": 0.0, "low_step": 100}
    assert rv.running_mean_drop(curve, window=20)["drop"] == 0.0  # a steady climb never falls


def test_gae_error_split_is_exact_and_matches_numpy(smoke_cache) -> None:
    """gae_lambda.error_split (the table's bias^2, variance and MSE columns) against numpy on a hand-made (K, M)
    array of estimates: the variance is over the M rollouts dividing by M (ddof=0), so that
    MSE = bias^2 + variance holds exactly; a variance dividing by M - 1 would make the sum exceed the MSE. Then the
    script's own rows (the --smoke run) obey the identity, and crossing() names the first pair of lambdas where
    the variance overtakes bias^2."""
    gl = load_script(CH12 / "gae_lambda.py")
    rng = np.random.default_rng(0)
    a0 = rng.normal(size=(5, 4)) * np.array([[1.0], [2.0], [3.0], [0.5], [4.0]]) + 3.0  # (K, M), M small on purpose
    truth = rng.normal(size=5)
    got = gl.error_split(torch.tensor(a0), torch.tensor(truth))
    bias2 = float(((a0.mean(1) - truth) ** 2).mean())
    var = float(a0.var(1, ddof=0).mean())
    mse = float(((a0 - truth[:, None]) ** 2).mean())
    assert got == pytest.approx({"bias^2": bias2, "variance": var, "MSE": mse}, rel=1e-9)
    assert mse == pytest.approx(bias2 + var, rel=1e-12)
    assert bias2 + float(a0.var(1, ddof=1).mean()) > mse * 1.05  # what dividing by M - 1 would print
    proc = smoke_run(smoke_cache, CH12 / "gae_lambda.py")
    assert proc["code"] == 0, proc["stderr"][-2000:]
    rows = proc["json"]["results"]["rows"]
    for r in rows:
        assert r["MSE"] == pytest.approx(r["bias^2"] + r["variance"], rel=1e-4, abs=1e-6), r
    assert tuple(proc["json"]["results"]["crossing"]) == gl.crossing(rows)
    table = [{"lambda": lam, "bias^2": b, "variance": v} for lam, b, v in
             [(0.0, 9.0, 0.0), (0.5, 8.0, 1.0), (0.9, 5.0, 6.0), (1.0, 1.0, 9.0)]]
    assert gl.crossing(table) == (0.5, 0.9) and gl.crossing(table[:2]) is None


def test_gae_episode_picture_equals_a_direct_sum_of_td_errors(smoke_cache) -> None:
    """gae_advantages.png (gae_lambda.py's "episode" in --json): one real rollout's rewards, values and dones as
    drawn, and the TD errors and advantages drawn beside them. Here delta_t is computed from the drawn rewards and
    values in numpy, and A_t as the direct sum sum_l (gamma lambda)^l delta_{t+l} up to the episode's end (or the
    rollout's), with no recursion."""
    proc = smoke_run(smoke_cache, CH12 / "gae_lambda.py")
    assert proc["code"] == 0, proc["stderr"][-2000:]
    ep = proc["json"]["results"]["episode"]
    gamma = ep["gamma"]
    r, v, d = (np.array(ep[k], dtype=np.float64) for k in ("rewards", "values", "dones"))
    T = len(r)
    assert 0 < d.sum() and d[-1] == 0  # an episode ends inside the rollout, and the rollout stops mid-episode
    v_next = np.append(v[1:], ep["last_value"])
    delta = r + gamma * v_next * (1 - d) - v
    np.testing.assert_allclose(ep["td_errors"], delta, rtol=1e-5, atol=1e-4)
    assert ep["ends"] == np.flatnonzero(d).tolist() and ep["at_end"]["t"] == ep["ends"][0]
    for lam, drawn in ep["advantages"].items():
        want = np.zeros(T)
        for t in range(T):
            k = t
            while True:  # delta_t + (gamma lambda) delta_t+1 + ... , stopping after the step an episode ends
                want[t] += (gamma * float(lam)) ** (k - t) * delta[k]
                if d[k] or k == T - 1:
                    break
                k += 1
        np.testing.assert_allclose(drawn, want, rtol=1e-4, atol=1e-3, err_msg=f"lambda {lam}")


def test_clip_batch_picture_against_the_definition() -> None:
    """clip_batch.png (ppo_cartpole.clip_batch): a real minibatch of a short PPO run, with a learning rate high
    enough that ratios leave the band. Against the definitions, in numpy: rho = exp(logp_new - logp_old); the clip
    fraction training logged is the share with |rho - 1| > eps; approx KL is mean((rho - 1) - log rho); and a sample
    gets no gradient exactly where the clipped term wins: A > 0 with rho > 1 + eps, or A < 0 with rho < 1 - eps."""
    pc = load_script(CH12 / "ppo_cartpole.py")
    ppo = load_script(CH12 / "_ppo.py")
    args = ppo.Settings(total_steps=2048, num_envs=4, num_steps=64, update_epochs=10, lr=0.01, eval_every=10**9,
                        eval_episodes=2)
    cb = pc.clip_batch(ppo.train(args, seed=0, progress=False), args.clip_eps)
    eps = cb["clip_eps"]
    rho = np.exp(np.array(cb["logp_new"], dtype=np.float64) - np.array(cb["logp_old"], dtype=np.float64))
    adv, grad = np.array(cb["advantage"]), np.array(cb["gradient"])
    np.testing.assert_allclose(cb["ratio"], rho, rtol=1e-6)
    outside = np.abs(rho - 1) > eps
    assert cb["clip_frac"] == pytest.approx(outside.mean(), abs=1e-6)
    assert cb["approx_kl"] == pytest.approx(np.mean((rho - 1) - np.log(rho)), rel=1e-4, abs=1e-7)
    flat = ((adv > 0) & (rho > 1 + eps)) | ((adv < 0) & (rho < 1 - eps))
    np.testing.assert_array_equal(grad, ~flat & (adv != 0))
    assert (cb["samples"], cb["outside"], cb["no_gradient_above"], cb["no_gradient_below"],
            cb["outside_with_gradient"]) == (len(rho), outside.sum(), (flat & (adv > 0)).sum(),
                                             (flat & (adv < 0)).sum(), (outside & ~flat).sum())
    assert flat.any() and (outside & ~flat).any(), "the picture should show both kinds of samples outside the band"


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_clip_objective_figure_is_min_of_clipped_and_unclipped(adv: float) -> None:
    """ppo_cartpole.clip_objective (the lesson's figure): -loss = min(rho A, clip(rho) A), and its slope is 0 exactly
    where the clipped term wins (rho > 1 + eps for A > 0, rho < 1 - eps for A < 0), A elsewhere."""
    pc = load_script(CH12 / "ppo_cartpole.py")
    eps = 0.2
    ratios = np.array([0.5, 0.79, 0.9, 1.0, 1.1, 1.21, 1.5])
    objective, slope = pc.clip_objective(ratios, adv, eps)
    np.testing.assert_allclose(objective, np.minimum(ratios * adv, np.clip(ratios, 1 - eps, 1 + eps) * adv),
                               rtol=1e-12, atol=1e-12)
    flat = ratios > 1 + eps if adv > 0 else ratios < 1 - eps
    np.testing.assert_allclose(slope, np.where(flat, 0.0, adv), rtol=1e-9, atol=1e-12)


def test_actor_gradient_matches_a_hand_policy_gradient() -> None:
    """reinforce_vs_ppo.actor_gradient: -mean(A * grad log pi(a|s)); check against per-sample autograd sums."""
    rv = load_script(CH12 / "reinforce_vs_ppo.py")
    torch.manual_seed(0)
    agent = rv.ppo.ActorCritic(hidden=8)
    buf = {"obs": torch.randn(3, 2, 4), "actions": torch.randint(0, 2, (3, 2)).float()}
    adv = torch.randn(3, 2)
    got = rv.actor_gradient(agent, buf, adv)
    want = torch.zeros_like(got)
    for t in range(3):
        for n in range(2):
            logp = agent.dist(buf["obs"][t, n][None]).log_prob(buf["actions"][t, n][None]).sum()
            g = torch.autograd.grad(logp, list(agent.actor.parameters()))
            want -= adv[t, n] * torch.cat([x.flatten() for x in g]) / 6
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.long  # a PPO learning run on a second environment, about 15 s: make sweep (and CI) run it
@pytest.mark.timeout(120)
def test_ppo_takes_any_classic_control_env_with_discrete_actions(tmp_path_factory) -> None:
    """--env-id (cleanrl's flag): the network as built (the script records each Linear layer of the agent it
    trained) has the sizes of gymnasium's own spaces for the env, and the solve threshold is the env's spec. The
    oracle is gymnasium, asked here: a script that kept CartPole's sizes (4 observations, 2 actions) or its 475
    fails, as does one that read the sizes from a different env."""
    import gymnasium as gym

    doc = run_json(tmp_path_factory, CH12 / "ppo_cartpole.py", "--smoke", "--env-id", "Acrobot-v1", timeout=110)
    env = gym.make("Acrobot-v1")
    n_obs, n_act = env.observation_space.shape[0], int(env.action_space.n)
    hidden = 64  # the --hidden default
    assert doc["layers"]["actor"] == [[n_obs, hidden], [hidden, hidden], [hidden, n_act]]
    assert doc["layers"]["critic"] == [[n_obs, hidden], [hidden, hidden], [hidden, 1]]
    assert doc["solve_return"] == gym.spec("Acrobot-v1").reward_threshold
    for e in doc["runs"][0]["evals"]:  # the run was judged against that threshold, on its own evaluations
        assert (e["eval_return"] >= doc["solve_return"]) <= doc["runs"][0]["solved"]
    for bad in ("Pendulum-v1", "NoSuchEnv-v0"):  # continuous actions; unknown id
        proc = run([CH12 / "ppo_cartpole.py", "--smoke", "--env-id", bad], timeout=60)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("flag", ["--rollouts", "--truth-rollouts"])
def test_gae_lambda_refuses_a_single_rollout_in_one_line(flag: str) -> None:
    """One rollout has no spread: --truth-rollouts 1 used to run on and print nan for the truth's noise (and a
    variance warning); both counts are refused with exit 2."""
    proc = run([CH12 / "gae_lambda.py", flag, "1"], timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert flag in proc.stderr
