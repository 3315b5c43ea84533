"""mlsys.rl, the cases tests/test_ch12_rl.py leaves open (issue 29: mutation testing).

GAE is checked against its definition as a direct sum, A_t = sum_l (gamma lam)^l delta_{t+l} cut at the end of the
episode, computed in numpy (not the backwards recursion the module uses), on a rectangular float64 rollout; the
masked helpers and the losses against hand-worked numbers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mlsys import rl


def gae_direct_sum(rewards, values, dones, last_value, gamma, lam):
    """numpy: every advantage as an explicit sum of TD errors up to the end of its episode or of the rollout."""
    T, N = rewards.shape
    nxt = np.concatenate([values[1:], last_value[None]], 0)
    deltas = rewards + gamma * nxt * (1 - dones) - values
    adv = np.zeros((T, N))
    for n in range(N):
        for t in range(T):
            for k in range(t, T):
                adv[t, n] += (gamma * lam) ** (k - t) * deltas[k, n]
                if dones[k, n]:
                    break
    return adv


@pytest.mark.parametrize("fn", [rl.compute_gae, rl.compute_gae_loop])
def test_gae_on_a_rectangular_float64_rollout_is_the_direct_sum(fn):
    rng = np.random.default_rng(3)
    T, N = 6, 3
    rewards, values = rng.normal(size=(T, N)), rng.normal(size=(T, N))
    dones = np.zeros((T, N))
    dones[1, 0] = dones[4, 2] = dones[5, 1] = 1.0
    last_value = rng.normal(size=N)
    want = gae_direct_sum(rewards, values, dones, last_value, gamma=0.9, lam=0.8)
    t = lambda a: torch.tensor(a, dtype=torch.float64)
    adv, ret = fn(t(rewards), t(values), t(dones), t(last_value), 0.9, 0.8)
    assert adv.shape == ret.shape == (T, N)
    assert adv.dtype == ret.dtype == torch.float64
    np.testing.assert_allclose(adv.numpy(), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ret.numpy(), want + values, rtol=1e-12, atol=1e-12)


def test_masked_mean_edge_cases():
    x = torch.tensor([2.0, 4.0, 9.0])
    assert rl.masked_mean(x, torch.tensor([0.0, 0.0, 1.0])).item() == 9.0  # one position: itself
    assert rl.masked_mean(x, torch.zeros(3)).item() == 0.0  # nothing selected: 0, not nan
    assert rl.masked_mean(x, torch.tensor([True, False, True])).item() == 5.5  # a bool mask works as 0/1
    assert rl.masked_mean(x).item() == 5.0


def test_masked_whiten_eps_bounds_a_nearly_constant_input():
    # x = [0, 2e-8]: mean 1e-8, std 1e-8, so (x - mean) / (std + 1e-8) = -/+ 1e-8 / 2e-8 = -/+ 0.5
    x = torch.tensor([0.0, 2e-8], dtype=torch.float64)
    np.testing.assert_allclose(rl.masked_whiten(x).numpy(), [-0.5, 0.5], rtol=1e-6)
    # a constant input is centred to 0 and stays finite
    assert rl.masked_whiten(torch.full((4,), 3.0)).tolist() == [0.0] * 4


def test_masked_whiten_of_a_shifted_skewed_input():
    # [1, 2, 6] + 10: mean 13, deviations -2, -1, 3, biased variance 14/3
    x = torch.tensor([11.0, 12.0, 16.0], dtype=torch.float64)
    want = np.array([-2.0, -1.0, 3.0]) / (math.sqrt(14 / 3) + 1e-8)
    np.testing.assert_allclose(rl.masked_whiten(x).numpy(), want, rtol=1e-12)
    # masked: only 11 and 16 count (mean 13.5, std 2.5); the masked-out 12 is shifted and scaled too
    got = rl.masked_whiten(x, torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)).numpy()
    np.testing.assert_allclose(got, (x.numpy() - 13.5) / (2.5 + 1e-8), rtol=1e-12)


def test_clip_frac_counts_only_ratios_strictly_past_the_boundary():
    # a ratio exactly at 1 + eps is not clipped (clamp leaves it as it is): clip_frac counts |r - 1| > eps
    log_ratio = torch.tensor([0.2, 0.0, 0.5], dtype=torch.float64)
    eps = (log_ratio[0].exp() - 1).item()  # the boundary, computed the way the ratio is
    _, stats = rl.ppo_policy_loss(log_ratio, torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64),
                                  eps)
    assert stats["clip_frac"] == pytest.approx(1 / 3)  # only the 0.5 one


def test_policy_loss_stats_with_a_mask_and_the_lower_clip():
    # ratios 0.5, 2, 1 with A = -1, 1, 5; eps 0.25; the last position masked out
    ratio = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    adv = torch.tensor([-1.0, 1.0, 5.0], dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    loss, stats = rl.ppo_policy_loss(ratio.log(), torch.zeros(3, dtype=torch.float64), adv, 0.25, mask)
    # A=-1, r=0.5: max(0.5, 0.75) = 0.75 (clipped at 1 - eps); A=1, r=2: max(-2, -1.25) = -1.25
    assert loss.item() == pytest.approx((0.75 - 1.25) / 2)
    assert stats["clip_frac"] == pytest.approx(1.0)
    assert stats["ratio_mean"] == pytest.approx(1.25)
    assert stats["approx_kl"] == pytest.approx(((0.5 - 1 - math.log(0.5)) + (2 - 1 - math.log(2))) / 2)


def test_value_loss_clips_each_way_around_the_old_value():
    # old 0, new -3 and 3, returns -1 and 5, clip 1: v_clipped = -1, 1 -> errors (0, 16) vs unclipped (4, 4)
    new, old = torch.tensor([-3.0, 3.0]), torch.zeros(2)
    ret = torch.tensor([-1.0, 5.0])
    assert rl.ppo_value_loss(new, old, ret, clip_eps=1.0).item() == pytest.approx(0.5 * (4 + 16) / 2)
    assert rl.ppo_value_loss(new, old, ret).item() == pytest.approx(0.5 * (4 + 4) / 2)
    assert rl.ppo_value_loss(new, old, ret, clip_eps=1.0, mask=torch.tensor([1.0, 0.0])).item() == 2.0


def test_gae_takes_boolean_dones():
    # environments report `terminated` as booleans; the result must be the float 0/1 one
    rng = np.random.default_rng(5)
    rewards, values = torch.tensor(rng.normal(size=(4, 2))), torch.tensor(rng.normal(size=(4, 2)))
    dones = torch.tensor([[False, False], [True, False], [False, False], [False, True]])
    last_value = torch.tensor(rng.normal(size=2))
    got = rl.compute_gae(rewards, values, dones, last_value, 0.9, 0.8)[0]
    want = gae_direct_sum(rewards.numpy(), values.numpy(), dones.numpy().astype(float), last_value.numpy(), 0.9, 0.8)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)


def test_masked_mean_keeps_the_dtype_of_x():
    # a float64 mask must not promote a float32 mean: (2 + 4) / 2 = 3 in float32
    got = rl.masked_mean(torch.tensor([2.0, 4.0, 9.0]), torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64))
    assert got.dtype == torch.float32 and got.item() == 3.0
