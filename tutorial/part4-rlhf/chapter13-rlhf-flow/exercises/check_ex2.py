"""Checker for ch13.2 — your group advantages against numpy, per group."""

from __future__ import annotations

import numpy as np
import torch

from mlsys.exercises import reference_helpers, task


def _group_oracle(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """numpy's (score - group mean) / (sample std + 1e-6), the oracle of group_advantages."""
    groups = scores.detach().double().numpy().reshape(-1, group_size)
    adv = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-6)
    return torch.from_numpy(adv.reshape(-1)).to(scores.dtype)




@task("group_advantages: (score - group mean) / (group std + eps), numpy as the oracle")
def check_groups(ex) -> None:
    g = torch.Generator().manual_seed(0)
    for group_size in (2, 4, 8):
        scores = torch.randn(4 * group_size, generator=g, dtype=torch.float64)
        got = ex.group_advantages(scores, group_size)
        want = _group_oracle(scores, group_size)
        assert got.shape == scores.shape, f"shape {tuple(got.shape)}, want {tuple(scores.shape)}"
        assert np.allclose(got.numpy(), want.numpy(), atol=1e-9), f"group_size {group_size}: got {got.tolist()}"


@task("group_advantages: within a group they sum to 0, and a group of equal scores gets 0 (no signal)")
def check_baseline(ex) -> None:
    scores = torch.tensor([3.0, 3.0, 3.0, 3.0, 1.0, 2.0, 3.0, 6.0])
    got = ex.group_advantages(scores, 4)
    assert torch.equal(got[:4], torch.zeros(4)), f"equal scores must give 0 advantage, got {got[:4].tolist()}"
    assert abs(got[4:].sum().item()) < 1e-5, f"a group's advantages must sum to 0, got {got[4:].sum().item()}"


@task("token_advantages: the row's advantage on every real token, 0 on padding")
def check_tokens(ex) -> None:
    scores = torch.tensor([1.0, 0.0, 2.0, 5.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    mask[3, 0] = 1.0
    # token_advantages may call your group_advantages: numpy's group advantages stand in for it here, so this task
    # checks the spreading over tokens alone (group_advantages has its own tasks above)
    with reference_helpers(ex, group_advantages=_group_oracle):
        got = ex.token_advantages(scores, mask, 2)
    per_row = _group_oracle(scores, 2)
    assert got.shape == mask.shape, f"shape {tuple(got.shape)}, want {tuple(mask.shape)}"
    assert torch.allclose(got, per_row[:, None] * mask), f"got {got.tolist()}"
