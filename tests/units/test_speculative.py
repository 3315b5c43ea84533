"""mlsys.speculative's statistics helpers and its sampling path, in the test's own process (mutation testing).

The chapter's sampling tests (chi-square over many samples) are too slow to run once per mutant, so here:
- `chi_square` against hand-computed Pearson statistics (with the pooling of thin cells done by hand) and its
  critical value against the chi-square quantile found by bisection on torch's regularized incomplete gamma
  function (the survival function of chi2(df) is Q(df/2, x/2));
- `SpecStats` against counts done by hand;
- greedy decoding against the target's own greedy decoding (mlsys.model.generate), `_probs` against numpy's softmax;
- the sampling path with a draft identical to the target: p = q at every position, so every draft is accepted
  (u < p/q = 1 always), every step emits exactly k + 1 tokens, and the caches afterwards equal a fresh prefill.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mlsys.model import GPT, GPTConfig, generate
from mlsys.speculative import (
    CachedModel,
    SpecStats,
    _probs,
    chi_square,
    residual,
    spec_step,
    speculative_generate,
    verify_sampled,
)


def chi2_quantile(df: int, significance: float) -> float:
    """x with P(chi2(df) > x) = significance, by bisection on Q(df/2, x/2) (torch.special.gammaincc)."""
    lo, hi = 0.0, 1000.0
    a = torch.tensor(df / 2, dtype=torch.float64)
    for _ in range(200):
        mid = (lo + hi) / 2
        if float(torch.special.gammaincc(a, torch.tensor(mid / 2, dtype=torch.float64))) > significance:
            lo = mid
        else:
            hi = mid
    return lo


# ------------------------------------------------------------------------------------------ chi_square
def test_chi_square_statistic_by_hand() -> None:
    assert chi_square([30, 50, 20], [0.3, 0.5, 0.2])[0] == pytest.approx(0.0)
    # (40 - 30)^2 / 30 + (40 - 50)^2 / 50 + 0 = 3.333 + 2
    assert chi_square([40, 40, 20], [0.3, 0.5, 0.2])[0] == pytest.approx(100 / 30 + 100 / 50)
    assert chi_square([25, 75], [0.5, 0.5])[0] == pytest.approx(2 * 25**2 / 50)


def test_chi_square_pools_thin_cells_by_hand() -> None:
    # expected 50, 45, 3, 2: the last two (5 together) form one cell (6 + 2 observed)
    stat, critical = chi_square([52, 40, 6, 2], [0.5, 0.45, 0.03, 0.02])
    assert stat == pytest.approx(2**2 / 50 + 5**2 / 45 + 3**2 / 5)
    assert critical == pytest.approx(chi2_quantile(2, 1e-3), rel=0.03)  # df = 3 cells - 1
    # expected 50, 47, 2, 1: the thin rest (3) is too small alone, so it joins the last cell: (40 + 5, 47 + 3)
    stat, critical = chi_square([55, 40, 3, 2], [0.5, 0.47, 0.02, 0.01])
    assert stat == pytest.approx(5**2 / 50 + 5**2 / 50)
    assert critical == pytest.approx(chi2_quantile(1, 1e-3), rel=0.1)  # df = 1
    # thin cells first, then a big one: the rest still joins the last (big) cell
    stat, _ = chi_square([4, 1, 95], [0.02, 0.01, 0.97])
    assert stat == pytest.approx((100 - 100) ** 2 / 100)
    stat, _ = chi_square([1, 1, 88, 10], [0.02, 0.01, 0.87, 0.10])  # rest (3 expected, 2 seen) joins (10, 10)
    assert stat == pytest.approx(1**2 / 87 + 1**2 / 13)
    # every cell thin: one pooled cell, statistic 0, df floored at 1
    stat, critical = chi_square([1, 2], [0.5, 0.5])
    assert stat == 0.0 and critical == pytest.approx(chi2_quantile(1, 1e-3), rel=0.1)
    # a zero-probability cell never seen: nothing to pool
    stat, critical = chi_square([50, 50, 0], [0.5, 0.5, 0.0])
    assert stat == 0.0 and critical == pytest.approx(chi2_quantile(1, 1e-3), rel=0.1)
    stat, _ = chi_square([48, 46, 6], [0.5, 0.45, 0.05])  # expected exactly 5: a cell of its own
    assert stat == pytest.approx(2**2 / 50 + 1**2 / 45 + 1**2 / 5)
    # a cell expected exactly 5 is a cell of its own, even before thin ones: (7, 5), (50, 50), (40 + 3, 42 + 3)
    stat, _ = chi_square([7, 50, 40, 3], [0.05, 0.5, 0.42, 0.03])
    assert stat == pytest.approx(2**2 / 5 + 0 + 2**2 / 45)
    stat, _ = chi_square([50, 49, 1], [0.5, 0.495, 0.005])  # a rest of 0.5 expected still joins: (50, 50)
    assert stat == pytest.approx(0.0, abs=1e-12)
    assert chi_square([1, 0], [0.5, 0.5])[0] == 0.0  # one observation: a single pooled cell (1, 1)
    assert chi_square([0, 0], [0.5, 0.5])[0] == 0.0  # no observations: no cell, statistic 0
    stat, _ = chi_square(np.array([60, 40]), torch.tensor([0.5, 0.5]))  # numpy counts, tensor probabilities
    assert stat == pytest.approx(2 * 10**2 / 50)


@pytest.mark.parametrize("df", [3, 5, 10, 30, 80])
@pytest.mark.parametrize("significance", [1e-3, 0.01, 0.05])
def test_chi_square_critical_value_is_the_quantile(df: int, significance: float) -> None:
    counts, probs = [100] * (df + 1), [1 / (df + 1)] * (df + 1)
    stat, critical = chi_square(counts, probs, significance) if significance != 1e-3 else chi_square(counts, probs)
    assert stat == pytest.approx(0.0, abs=1e-9)
    exact = chi2_quantile(df, significance)
    # Wilson-Hilferty: within 2% for df <= 5, 0.8% from df = 10 on (a 9 -> 10 in it moves it by 1.1% or more)
    assert critical == pytest.approx(exact, rel=0.02 if df < 10 else 0.008), (critical, exact)


# ------------------------------------------------------------------------------------------ SpecStats
def test_spec_stats_rates_by_hand() -> None:
    s = SpecStats(k=3, steps=4, drafted=12, accepted=4, emitted=8, accepted_at=[3, 1, 0], reached=[4, 3, 1])
    assert s.checked == 8 and s.acceptance_rate == 0.5 and s.tokens_per_step == 2.0
    alpha = s.alpha_per_position()
    assert alpha == [0.75, pytest.approx(1 / 3), 0.0]
    s = SpecStats(k=2, accepted_at=[2, 0], reached=[2, 0])
    alpha = s.alpha_per_position()
    assert alpha[0] == 1.0 and math.isnan(alpha[1]) and len(alpha) == 2  # never reached: no estimate
    empty = SpecStats(k=2)
    assert empty.acceptance_rate == 0.0 and empty.tokens_per_step == 0.0 and empty.alpha_per_position() == []


# ------------------------------------------------------------------------------------------ sampling path
def test_probs_is_the_tempered_softmax() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 3.0, 1.0]])
    for temperature in (0.5, 1.0, 2.0):
        x = logits.numpy() / temperature
        want = np.exp(x - x.max(-1, keepdims=True))
        want /= want.sum(-1, keepdims=True)
        assert np.allclose(_probs(logits, temperature).numpy(), want, atol=1e-6)
        assert np.allclose(_probs(logits[0], temperature).numpy(), want[0], atol=1e-6)  # one row (V,)


def tiny(seed: int, vocab: int = 6) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab, block_size=64, n_layer=1, n_head=2, n_embd=16)).eval()


def test_greedy_gives_the_targets_own_greedy_tokens() -> None:
    """Oracle: mlsys.model.generate, plain greedy decoding of the target alone (a different tiny draft)."""
    target, draft = tiny(5), tiny(6)
    for k in (1, 3):
        out = speculative_generate(target, draft, [1, 2], max_new_tokens=12, k=k)
        assert out.token_ids == generate(target, torch.tensor([[1, 2]]), 12)[0, 2:].tolist()


def test_a_draft_equal_to_the_target_is_always_accepted_when_sampling() -> None:
    model, k = tiny(0), 3
    runs = []
    for global_seed in (1, 2):  # the request's generator alone decides the tokens, not the global RNG
        torch.manual_seed(global_seed)
        g = torch.Generator().manual_seed(0)
        runs.append(speculative_generate(model, model, [1, 2], max_new_tokens=10, k=k, temperature=1.3, generator=g))
    out = runs[0]
    assert out.token_ids == runs[1].token_ids
    s = out.stats
    assert len(out.token_ids) == 10 and all(0 <= t < 6 for t in out.token_ids)
    assert s.steps == 3 and s.draft_forwards == 9 and s.drafted == 9 and s.accepted == 9  # 4 + 4 + 2 (cut)
    assert s.emitted == 10 and s.reached == [3, 3, 3] and s.accepted_at == [3, 3, 3]
    assert s.acceptance_rate == 1.0 and s.alpha_per_position() == [1.0, 1.0, 1.0]


def test_spec_step_sampling_keeps_the_caches_of_the_accepted_prefix() -> None:
    model, k = tiny(1), 2
    tgt, drf = CachedModel(model, 32), CachedModel(model, 32)
    seq = [1, 2, 3]
    tgt.feed(seq[:-1])
    drf.feed(seq[:-1])
    new, j, drafts = spec_step(tgt, drf, seq, k, 1.0, torch.Generator().manual_seed(2))
    assert j == k and new[:k] == drafts and len(new) == k + 1  # p = q: all accepted, plus the bonus token
    # the target holds seq + drafts (the bonus token is pending); the draft never fed its last draft
    assert tgt.cache_len == len(seq) + j and drf.cache_len == len(seq) + j - 1
    want = CachedModel(model, 32).feed(seq + new)[-1]  # a fresh prefill of everything
    assert torch.allclose(tgt.feed([new[-1]])[-1], want, atol=1e-5)
    assert torch.allclose(drf.feed(new[-2:])[-1], want, atol=1e-5)


def test_residual_row_by_row_by_hand() -> None:
    """normalize(max(0, p - q)) over the last dim, each row on its own; where p = q (nothing left) it returns p."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.6, 0.1, 0.2], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.2, 0.5, 0.2, 0.1], [0.4, 0.1, 0.4, 0.1], [0.25, 0.25, 0.25, 0.25]])
    want = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 5 / 6, 0.0, 1 / 6], [0.25, 0.25, 0.25, 0.25]])
    assert torch.allclose(residual(p, q), want, atol=1e-6)
    assert torch.allclose(residual(p[1], q[1]), want[1], atol=1e-6)
    assert torch.equal(residual(p[0], p[0]), p[0])


def test_verify_sampled_redraws_from_the_residual_by_hand() -> None:
    """k = 1. Draft 0 has p = 0, q = 0.5: always rejected, and max(0, p - q) = [0, 0.5, 0, 0] leaves token 1 alone.
    Draft 1 has p/q = 2: always accepted, and the bonus comes from p[1], all on token 3."""
    p = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        assert verify_sampled(p, q, torch.tensor([0]), g) == (0, 1)
        assert verify_sampled(p, q, torch.tensor([1]), g) == (1, 3)


def test_verify_sampled_draws_from_the_generator_it_is_given() -> None:
    p = torch.tensor([[0.3, 0.3, 0.4], [0.2, 0.5, 0.3], [0.6, 0.2, 0.2]])
    q = torch.tensor([[0.6, 0.2, 0.2], [0.1, 0.1, 0.8]])
    drafts = torch.tensor([0, 2])
    results = []
    for global_seed in (3, 4):
        torch.manual_seed(global_seed)
        g = torch.Generator().manual_seed(7)
        results.append([verify_sampled(p, q, drafts, g) for _ in range(30)])
    assert results[0] == results[1]


def test_chi_square_rejects_a_count_where_the_probability_is_zero() -> None:
    """A sampler that emits a token the target gives probability 0 must fail, however few times it does: pooling
    the thin cells would otherwise fold that count away (expected 0 + 0)."""
    stat, critical = chi_square([500, 499, 1], [0.5, 0.5, 0.0])
    assert stat == float("inf") and stat > critical
    stat, critical = chi_square([500, 500, 0], [0.5, 0.5, 0.0])  # the same cell empty: a perfect fit
    assert stat == 0.0 < critical


def test_a_draft_the_target_never_picks_is_rejected_even_at_u_zero(monkeypatch) -> None:
    """torch.rand draws from [0, 1): u = 0 can happen. A draft with p(d) = 0 has ratio 0 and must be rejected
    (u < 0 is false), the next token then coming from the residual, here all on token 1."""
    p = torch.tensor([[0.0, 1.0], [0.5, 0.5]])  # the target never writes token 0 first
    q = torch.tensor([[1.0, 0.0]])  # the draft always does
    monkeypatch.setattr(torch, "rand", lambda k, generator=None: torch.zeros(k))
    assert verify_sampled(p, q, torch.tensor([0])) == (0, 1)
