"""Checker for ch13.2 — your group advantages against numpy, per group."""

from __future__ import annotations

import numpy as np
import torch

from mlsys.exercises import task


@task("group_advantages: (score - group mean) / (group std + eps), numpy as the oracle")
def check_groups(ex) -> None:
    g = torch.Generator().manual_seed(0)
    for group_size in (2, 4, 8):
        scores = torch.randn(4 * group_size, generator=g, dtype=torch.float64)
        got = ex.group_advantages(scores, group_size)
        groups = scores.numpy().reshape(4, group_size)
        want = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-6)
        assert got.shape == scores.shape, f"shape {tuple(got.shape)}, want {tuple(scores.shape)}"
        assert np.allclose(got.numpy(), want.reshape(-1), atol=1e-9), f"group_size {group_size}: got {got.tolist()}"


@task("advantages within a group sum to 0, and a group of equal scores gets 0 (no signal)")
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
    got = ex.token_advantages(scores, mask, 2)
    per_row = ex.group_advantages(scores, 2)
    assert got.shape == mask.shape, f"shape {tuple(got.shape)}, want {tuple(mask.shape)}"
    assert torch.allclose(got, per_row[:, None] * mask), f"got {got.tolist()}"
