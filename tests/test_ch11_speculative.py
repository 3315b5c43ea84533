"""Chapter 11 oracles, speculative decoding: greedy output equal to the target's own greedy decoding (several
prompts, several k), the KV cache after rollback equal to a fresh prefill, the acceptance rule's output
distribution equal to the target's (exact enumeration and chi-square over fixed-seed samples, explicit p and q,
and on the real models), the expected-tokens formula against enumeration, and transformers' assisted generation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import load_script, run_json, scripts_dir
from mlsys.data import Tokenizer
from mlsys.model import generate
from mlsys.speculative import (
    CachedModel,
    chi_square,
    expected_tokens_per_step,
    residual,
    spec_step,
    speculative_generate,
    verify_greedy,
    verify_sampled,
)
from mlsys.weights import load_pretrained

CH11 = scripts_dir(11)
TOK = Tokenizer()
PROMPTS = ['', '{"name": "', '{"name": "grace", "a', '{"name": "ken", "age": 5', '{"na']


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models(small_model):
    return small_model, load_pretrained("draft")


# ------------------------------------------------------------------------------------------ formulas
@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.99, 1.0])
def test_expected_tokens_formula_equals_enumeration(alpha: float, k: int) -> None:
    # j drafts accepted (then one target token): P(j) = alpha^j (1 - alpha) for j < k, alpha^k for j = k
    probs = [alpha**j * (1 - alpha) for j in range(k)] + [alpha**k]
    assert sum(probs) == pytest.approx(1.0)
    enumerated = sum(p * (j + 1) for j, p in enumerate(probs))
    assert expected_tokens_per_step(alpha, k) == pytest.approx(enumerated)


def test_verify_greedy_hand_cases() -> None:
    logits = torch.full((4, 5), -1.0)
    for row, tok in enumerate([2, 0, 4, 1]):  # target argmax per row
        logits[row, tok] = 1.0
    assert verify_greedy(logits, torch.tensor([2, 0, 4])) == (3, 1)  # all accepted, bonus = row 3
    assert verify_greedy(logits, torch.tensor([2, 3, 4])) == (1, 0)  # second differs: correction = row 1
    assert verify_greedy(logits, torch.tensor([1, 0, 4])) == (0, 2)  # later agreement does not count


def test_residual_hand_case() -> None:
    p, q = torch.tensor([0.5, 0.3, 0.2, 0.0]), torch.tensor([0.2, 0.5, 0.2, 0.1])
    assert torch.allclose(residual(p, q), torch.tensor([1.0, 0.0, 0.0, 0.0]))  # max(0, p-q) = [.3, 0, 0, 0]


# ------------------------------------------------------------------------------------------ the acceptance rule
P = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.6, 0.1, 0.2], [0.25, 0.25, 0.25, 0.25]])  # target, 3 positions
Q = torch.tensor([[0.1, 0.6, 0.1, 0.2], [0.4, 0.1, 0.4, 0.1]])  # draft, 2 positions (far from P on purpose)


def test_rule_exact_enumeration() -> None:
    """Sum over the draft token: q(d) min(1, p/q) accepted + P(reject) * residual = p, exactly."""
    for p, q in [(P[0], Q[0]), (P[1], Q[1]), (P[0], P[0]), (torch.tensor([0.0, 0.0, 1.0, 0.0]), Q[0])]:
        accept = q * torch.clamp(p / q, max=1.0)  # P(draft = x and accepted)
        assert float(accept.sum()) == pytest.approx(float(torch.minimum(p, q).sum()))  # P(accept) = sum min(p, q)
        out = accept + (1 - accept.sum()) * residual(p, q)
        assert torch.allclose(out, p, atol=1e-6)


def test_rule_samples_match_target_chi_square() -> None:
    """k = 2 with fixed seeds: emitted token 1 ~ P[0]; token 2 (when draft 1 passed) ~ P[1]; bonus ~ P[2]."""
    g = torch.Generator().manual_seed(0)
    first, second, bonus = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    all_drafts = torch.stack([torch.multinomial(Q[i], 12_000, replacement=True, generator=g) for i in range(2)])
    for drafts in all_drafts.T:  # (2,) d_i ~ q_i
        j, nxt = verify_sampled(P, Q, drafts, g)
        emitted = [*drafts[:j].tolist(), nxt]
        first[emitted[0]] += 1
        if j >= 1:
            second[emitted[1]] += 1
        if j == 2:
            bonus[nxt] += 1
    for counts, p in [(first, P[0]), (second, P[1]), (bonus, P[2])]:
        stat, critical = chi_square(counts, p)
        assert stat < critical, (counts / counts.sum(), p)
    # and the test has power: the draft's own distribution is rejected
    assert chi_square(first, Q[0])[0] > chi_square(first, Q[0])[1]


@pytest.mark.timeout(120)
def test_real_models_sampling_keeps_target_distribution(models) -> None:
    """First token after '{"name": "' (12 names start here): speculative sampling (k=3) vs softmax(target)."""
    target, draft = models
    prompt = TOK.encode('{"name": "', bos=True)
    with torch.no_grad():
        p = torch.softmax(target(torch.tensor([prompt]))[0][0, -1], -1)  # (V,) the target's distribution
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(TOK.vocab_size)
    for _ in range(600):
        out = speculative_generate(target, draft, prompt, 1, k=3, temperature=1.0, generator=g)
        counts[out.token_ids[0]] += 1
    stat, critical = chi_square(counts, p)
    assert stat < critical


# ------------------------------------------------------------------------------------------ greedy identity
@pytest.mark.timeout(150)
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_greedy_speculative_equals_target_greedy(models, k: int) -> None:
    target, draft = models
    for text in PROMPTS:
        prompt = TOK.encode(text, bos=True)
        ref = generate(target, torch.tensor([prompt]), 90)[0, len(prompt):].tolist()  # runs past <eos>
        out = speculative_generate(target, draft, prompt, 90, k=k)
        assert out.token_ids == ref, (k, text)
        assert out.stats.steps == out.stats.draft_forwards // k < len(ref)  # fewer target forwards than tokens
        assert sum(out.stats.accepted_at) == out.stats.accepted


def test_stop_at_eos_and_token_budget(models) -> None:
    target, draft = models
    prompt = TOK.encode('{"name": "ada"', bos=True)
    out = speculative_generate(target, draft, prompt, 120, k=4, eos_id=TOK.eos_id).token_ids
    assert out[-1] == TOK.eos_id and TOK.eos_id not in out[:-1]
    for n in (1, 2, 5, 13):
        assert len(speculative_generate(target, draft, prompt, n, k=4).token_ids) == n


def test_rollback_leaves_the_cache_of_a_fresh_prefill(models) -> None:
    """After several steps with rejections, the valid part of both caches equals a fresh prefill of those tokens."""
    target, draft = models
    seq = TOK.encode('{"name": "bar', bos=True)
    tgt, drf = CachedModel(target, 128), CachedModel(draft, 128)
    tgt.feed(seq[:-1])
    drf.feed(seq[:-1])
    rejected = 0
    for _ in range(8):
        new, j, _ = spec_step(tgt, drf, seq, 5, temperature=0.0)
        rejected += j < 5
        seq += new
    assert rejected > 0, "pick a prompt where the draft is sometimes wrong"
    assert tgt.cache_len == len(seq) - 1
    assert drf.cache_len == len(seq) - 1 - (j == 5)  # after an all-accepted step the draft never fed its dk
    for cached in (tgt, drf):
        n = cached.cache_len
        fresh = CachedModel(cached.model, 128)
        fresh.feed(seq[:n])
        for a, b in zip(cached.cache, fresh.cache):
            torch.testing.assert_close(a.k[:, :, :n], b.k[:, :, :n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a.v[:, :, :n], b.v[:, :, :n], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ transformers
@pytest.mark.timeout(120)
def test_hf_assisted_generation_gives_the_same_tokens(models) -> None:
    target, draft = models
    mod = load_script(CH11 / "speculative.py")
    prompts = [TOK.encode(t, bos=True) for t in PROMPTS[:3]]
    for k in (2, 5):
        hf = mod.hf_assisted(target, draft, prompts, k, 60)
        ours = [speculative_generate(target, draft, p, 60, k=k, eos_id=TOK.eos_id).token_ids for p in prompts]
        assert hf == ours


# ------------------------------------------------------------------------------------------ Monte Carlo oracles
def simulate_steps(alpha: float, k: int, num_steps: int, seed: int) -> np.ndarray:
    """The acceptance process itself: each step checks drafts in order, each accepted with probability alpha
    independently, and stops at the first rejection; it emits the accepted drafts plus one target token."""
    rng = np.random.default_rng(seed)
    accepted = rng.random((num_steps, k)) < alpha  # (steps, k)
    run = np.cumprod(accepted, axis=1).sum(axis=1)  # leading accepted drafts per step
    return run + 1  # tokens emitted per step


@pytest.mark.parametrize("alpha, k", [(0.0, 3), (0.35, 1), (0.6, 4), (0.9, 8), (1.0, 5)])
def test_expected_tokens_formula_against_monte_carlo(alpha: float, k: int) -> None:
    tokens = simulate_steps(alpha, k, 200_000, seed=k)
    sd = tokens.std() / np.sqrt(tokens.size) + 1e-12
    assert abs(tokens.mean() - expected_tokens_per_step(alpha, k)) < 5 * sd + 1e-9


def test_acceptance_rule_gives_the_formula() -> None:
    """The real rule (verify_sampled) on fixed p and q whose overlap sum(min(p, q)) is alpha: drafts are accepted
    independently with probability alpha, so tokens per step follow the formula (seeded, 20,000 steps)."""
    p, q, k = P[0], Q[0], 3
    alpha = float(torch.minimum(p, q).sum())  # 0.45
    g = torch.Generator().manual_seed(3)
    ps, qs = p.expand(k + 1, -1), q.expand(k, -1)
    drafts = torch.multinomial(q, 20_000 * k, replacement=True, generator=g).view(20_000, k)
    tokens = np.array([verify_sampled(ps, qs, d, g)[0] + 1 for d in drafts])
    assert abs(tokens.mean() - expected_tokens_per_step(alpha, k)) < 5 * tokens.std() / np.sqrt(tokens.size)


@pytest.mark.timeout(120)
def replay_greedy_steps(target, draft, prompt: list[int], max_new: int, k: int) -> tuple[float, float]:
    """(alpha, tokens per step) of greedy speculative decoding, replayed from plain greedy decoding alone
    (mlsys.model.generate, nothing from mlsys.speculative): at each step the draft continues the target's own
    output by k greedy tokens; the leading ones that equal the target's next tokens are accepted, the first
    mismatch is the last draft the target judges, and the step emits the accepted drafts plus one target token."""
    def greedy(model, ids: list[int], n: int) -> list[int]:
        return generate(model, torch.tensor([ids]), n)[0, len(ids):].tolist()

    want = greedy(target, prompt, max_new + k + 1)  # greedy is prefix-consistent: the look-ahead past max_new
    out = steps = accepted = checked = 0
    while out < max_new:
        drafts = greedy(draft, prompt + want[:out], k)
        j = next((i for i in range(k) if drafts[i] != want[out + i]), k)
        steps, accepted, checked = steps + 1, accepted + j, checked + min(j + 1, k)
        out += min(j + 1, max_new - out)
    return accepted / checked, out / steps


def test_spec_vs_k_script_numbers(tmp_path_factory, models) -> None:
    """The table's observed columns (alpha, tokens/step) against a replay from plain greedy decoding; its formula
    and predicted columns against a simulation of the acceptance process at the measured alpha, with each
    simulated step charged k draft forwards and one verification at the measured costs."""
    res = run_json(tmp_path_factory, CH11 / "spec_vs_k.py", "--smoke", "--plot-dir", tmp_path_factory.mktemp("fig"))
    mod = load_script(CH11 / "spec_vs_k.py")
    prompt = mod.make_prompts(1, mod.Settings().seed)[0]  # the --smoke run: one prompt, 40 new tokens
    for row in res["rows"]:
        alpha, per_step = replay_greedy_steps(*models, prompt, 40, row["k"])
        assert row["alpha"] == pytest.approx(alpha, abs=1e-12) and row["tokens/step"] == pytest.approx(per_step), row
    for i, row in enumerate(res["rows"]):
        k, alpha = row["k"], row["alpha"]
        assert 1.0 <= row["tokens/step"] <= k + 1 and 0 <= alpha <= 1
        tokens = simulate_steps(alpha, k, 400_000, seed=i)
        assert row["formula"] == pytest.approx(tokens.mean(), abs=5 * tokens.std() / np.sqrt(tokens.size) + 1e-9)
        # simulated wall clock: plain decoding pays c_target(1) per token; speculative pays per step
        plain = tokens.sum() * res["c_target_1"]
        spec = tokens.size * (k * res["c_draft_1"] + res["c_target_k1"][str(k)])
        assert row["predicted"] == pytest.approx(plain / spec, rel=0.01)


def test_speedup_cap_with_every_draft_accepted() -> None:
    """The lesson's bound: alpha = 1 and free verification give (k + 1) / (k * c_draft / c_target + 1)."""
    mod = load_script(CH11 / "spec_vs_k.py")
    for k, c_t, c_d in [(1, 1.0, 0.5), (4, 1.3, 0.55), (8, 2.0, 0.1)]:
        assert mod.predicted_speedup(1.0, k, c_t, c_t, c_d) == pytest.approx((k + 1) / (k * c_d / c_t + 1))


def test_recorded_steps_for_the_figure(models) -> None:
    """speculative.py's figure: each step emits its accepted drafts plus one target token, and the steps together
    give the target's greedy tokens."""
    target, draft = models
    mod = load_script(CH11 / "speculative.py")
    prompt = TOK.encode('{"name": "', bos=True)
    steps = mod.record_steps(target, draft, prompt, k=4, max_new=40)
    for st in steps:
        assert 0 <= st["accepted"] <= 4 and st["new"][:-1] == st["drafts"][: st["accepted"]]
    ref = generate(target, torch.tensor([prompt]), 40)[0, len(prompt):].tolist()
    assert [t for st in steps for t in st["new"]][:40] == ref


# ------------------------------------------------------------------------------------------ the drawn rollback
def test_drawn_rollback_matches_an_independent_count(models, tmp_path) -> None:
    """rollback.png: the cache lengths and cells drawn for one step with a rejection, against j counted
    independently: the draft's and the target's own greedy continuations of the sequence (mlsys.model.generate),
    compared token by token. After the rollback each cache holds the sequence plus the first j drafts; the
    other drafts sit past its length, stale."""
    from types import SimpleNamespace

    target, draft = models
    script = load_script(CH11 / "speculative.py")
    k = 4
    step = script.rollback_step(target, draft, TOK.encode('{"name": "', bos=True), k, 60)
    drawn = script.draw_rollback(step, SimpleNamespace(plot_dir=str(tmp_path)))
    seq, drafts = step["seq"], step["drafts"]
    n = len(seq)
    assert drafts == generate(draft, torch.tensor([seq]), k)[0, n:].tolist()
    greedy = generate(target, torch.tensor([seq]), k)[0, n:].tolist()
    j = next((i for i in range(k) if drafts[i] != greedy[i]), k)
    assert j < k  # the step drawn rejects a draft
    tgt_lens = [n - 1, n - 1, n + k, n + j]
    drf_lens = [None, n + k - 1, n + k - 1, n + j]
    rows = drawn["rows"]
    assert [r["cache_len"] for r in rows[0::2]] == tgt_lens
    assert [r["cache_len"] for r in rows[1::2]][1:] == drf_lens[1:] and rows[1]["cache_len"] in (n - 1, n - 2)
    tokens, first = seq + drafts, drawn["first_position"]
    for row, written in ((rows[6], n + k), (rows[7], n + k - 1)):  # after the rollback: target, draft
        cells = {pos: (tok, st) for pos, tok, st in row["cells"]}
        kept = [pos for pos, (_, st) in cells.items() if st in ("committed", "accepted draft")]
        assert kept == list(range(first, n + j))
        assert all(cells[pos][0] == tokens[pos] for pos in kept)
        assert [pos for pos, (_, st) in cells.items() if "stale" in st] == list(range(n + j, written))
        assert all(cells[pos][1] == "committed" for pos in range(first, n))
