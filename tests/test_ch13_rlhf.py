"""Chapter 13 oracles: the Bradley-Terry loss by hand, the KL estimators against exact expectations and torch's
KL, reward shaping sums, GAE over tokens against a per-row loop, group advantages against numpy, log-probs against
a plain forward, the engine's sampled-token log-probs against the trainer's, and a short seeded RLHF run that
raises the mean reward."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mlsys import rlhf
from mlsys.engine import Engine, EngineConfig
from mlsys.model import GPT, GPTConfig
from mlsys.weights import load_pretrained


@pytest.fixture(autouse=True)
def one_thread():
    """The scripts' setting: a tiny model runs faster on one thread than on two fighting a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny", block_size=128)).eval()


# ----------------------------------------------------------------------------------------------- the task


def test_rule_score_reads_validity_and_languages() -> None:
    base = '{"name": "ada", "age": 34, "city": "london", "langs": '
    assert rlhf.rule_score(base + '["c"]}') == 1
    assert rlhf.rule_score(base + '["c", "go", "rust"]}') == 3
    assert rlhf.rule_score(base + '["c", "go", "lua", "rust"]}') == 0  # four: malformed
    assert rlhf.rule_score(base + '["c", "g') == 0


def test_preference_pairs_are_labelled_by_the_rule() -> None:
    pairs = rlhf.make_preference_pairs(200, seed=3)
    assert len(pairs) == 200
    for chosen, rejected in pairs:
        assert rlhf.rule_score(chosen) > rlhf.rule_score(rejected)
        assert chosen.split('"')[3] == rejected.split('"')[3]  # same name: the same prompt
    assert rlhf.make_preference_pairs(20, seed=3) == pairs[:20]  # deterministic


# ------------------------------------------------------------------------------------------ reward model


def test_bradley_terry_loss_by_hand() -> None:
    chosen, rejected = torch.tensor([2.0, -1.0, 0.3]), torch.tensor([0.5, 0.5, 0.3])
    by_hand = sum(math.log(1 + math.exp(-(c - r))) for c, r in zip(chosen.tolist(), rejected.tolist())) / 3
    assert rlhf.bradley_terry_loss(chosen, rejected).item() == pytest.approx(by_hand, rel=1e-6)
    # gradient w.r.t. r_chosen: -(1 - sigmoid(c - r)) / P
    c = chosen.clone().requires_grad_(True)
    rlhf.bradley_terry_loss(c, rejected).backward()
    want = [-(1 - 1 / (1 + math.exp(-(a - b)))) / 3 for a, b in zip(chosen.tolist(), rejected.tolist())]
    assert c.grad.tolist() == pytest.approx(want, rel=1e-5)


def test_scalar_head_scores_at_the_last_real_token() -> None:
    rm = rlhf.ScalarHeadModel(tiny_gpt())
    torch.nn.init.normal_(rm.head.weight)
    ids, lengths = rlhf.encode_records(['{"name": "ada"}', '{"name": "alan", "age": 41}'])
    per_pos = rm(ids)  # (B, T)
    alone = rm(ids[:1, : lengths[0]])  # the short row without its padding
    assert rm.score(ids, lengths)[0].item() == pytest.approx(alone[0, -1].item(), abs=1e-5)
    assert rm.score(ids, lengths)[1].item() == pytest.approx(per_pos[1, lengths[1] - 1].item(), abs=1e-6)


def test_normalized_reward_model_has_mean_0_std_1_and_keeps_the_order() -> None:
    rm = rlhf.ScalarHeadModel(tiny_gpt())
    torch.nn.init.normal_(rm.head.weight)
    texts = [t for pair in rlhf.make_preference_pairs(20, seed=1) for t in pair]
    ids, lengths = rlhf.encode_records(texts)
    with torch.no_grad():
        before = rm.score(ids, lengths)
        rlhf.normalize_reward_model(rm, texts)
        after = rm.score(ids, lengths)
    assert after.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert after.std().item() == pytest.approx(1.0, abs=1e-5)
    assert torch.equal(before.argsort(), after.argsort())


# ------------------------------------------------------------------------------------------ KL estimators


def random_categoricals(seed: int, k: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(k, generator=g, dtype=torch.float64).mul(1.5).softmax(0),
            torch.randn(k, generator=g, dtype=torch.float64).mul(1.5).softmax(0))


@pytest.mark.parametrize("seed", range(5))
def test_k1_and_k3_are_unbiased_by_exact_expectation(seed: int) -> None:
    p, q = random_categoricals(seed)
    exact = torch.distributions.kl_divergence(torch.distributions.Categorical(probs=p),
                                              torch.distributions.Categorical(probs=q)).item()
    est = rlhf.kl_estimators(p.log(), q.log())  # the value of each estimator at every outcome x
    assert (p * est["k1"]).sum().item() == pytest.approx(exact, rel=1e-12)
    assert (p * est["k3"]).sum().item() == pytest.approx(exact, rel=1e-12)
    log_r = (q / p).log()
    assert (p * est["k2"]).sum().item() == pytest.approx((p * log_r**2).sum().item() / 2, rel=1e-12)
    assert abs((p * est["k2"]).sum().item() - exact) > 1e-6  # k2 is biased for distributions this far apart


def test_k3_is_nonnegative_per_sample_and_k1_is_not() -> None:
    g = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(10_000, generator=g) * 2, torch.randn(10_000, generator=g) * 2
    est = rlhf.kl_estimators(logp, ref)
    assert (est["k3"] >= 0).all() and (est["k2"] >= 0).all()
    assert (est["k1"] < 0).any()
    same = rlhf.kl_estimators(logp, logp)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in same.values())


@pytest.mark.timeout(300)
def test_kl_calculator_script_matches_exact_values(tmp_path) -> None:
    import json

    from conftest import ROOT, run

    out = tmp_path / "r.json"
    proc = run([ROOT / "tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/kl_calculator.py", "--smoke", "--json", out],
               timeout=290)  # the first run on a fresh checkout trains the `small` GPT (about 2 min)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())["results"]
    for rows in res["categorical"].values():
        exact = {r["estimator"]: r["E_p[k] exact"] for r in rows}
        assert exact["k1"] == pytest.approx(rows[0]["exact KL"], rel=1e-9)
        assert exact["k3"] == pytest.approx(rows[0]["exact KL"], rel=1e-9)
        k = {r["estimator"]: r for r in rows}
        assert k["k3"]["negative %"] == 0 and k["k2"]["negative %"] == 0
    assert res["shaping"]["sum_rewards"] == pytest.approx(1.0 - 0.05 * res["shaping"]["sequence_log_ratio"], rel=1e-9)


# -------------------------------------------------------------------------------------- reward shaping


def test_shape_rewards_by_hand() -> None:
    kl = torch.tensor([[0.5, -0.2, 0.1, 9.0], [0.3, 0.4, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    rewards = rlhf.shape_rewards(torch.tensor([2.0, -1.0]), kl, mask, beta=0.1)
    want = torch.tensor([[-0.05, 0.02, -0.01 + 2.0, 0.0], [-0.03, -0.04 - 1.0, 0.0, 0.0]])
    assert torch.allclose(rewards, want, atol=1e-7)
    # summed: score - beta * sum of the real tokens' KL
    assert torch.allclose(rewards.sum(1), torch.tensor([2.0 - 0.1 * 0.4, -1.0 - 0.1 * 0.7]), atol=1e-6)


def test_adaptive_kl_controller_formula() -> None:
    ctl = rlhf.AdaptiveKLController(beta=0.1, target=2.0, k_beta=0.5)
    assert ctl.update(2.5) == pytest.approx(0.1 * (1 + 0.5 * 0.25 * 0 + 0.5 * 0.2))  # error 0.25 clipped to 0.2
    assert ctl.update(1.8) == pytest.approx(0.11 * (1 + 0.5 * (1.8 / 2 - 1)))
    fixed = rlhf.AdaptiveKLController(beta=0.1, target=None)
    assert fixed.update(100.0) == 0.1


# ------------------------------------------------------------------------------------------ advantages


def gae_row(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """One response as one episode, its value after the last token 0: the textbook sums."""
    n = len(rewards)
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < n else 0.0) - values[t] for t in range(n)]
    adv = [sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, n)) for t in range(n)]
    return adv, [a + v for a, v in zip(adv, values)]


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0)])
def test_token_gae_matches_a_per_row_loop(gamma: float, lam: float) -> None:
    g = torch.Generator().manual_seed(1)
    lengths = [5, 2, 7, 1]
    mask = torch.zeros(4, 7)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    rewards, values = torch.randn(4, 7, generator=g) * mask, torch.randn(4, 7, generator=g) * mask
    adv, ret = rlhf.token_gae(rewards, values, mask, gamma, lam)
    for b, n in enumerate(lengths):
        want_adv, want_ret = gae_row(rewards[b, :n].tolist(), values[b, :n].tolist(), gamma, lam)
        assert adv[b, :n].tolist() == pytest.approx(want_adv, abs=1e-5)
        assert ret[b, :n].tolist() == pytest.approx(want_ret, abs=1e-5)
        assert not adv[b, n:].any() and not ret[b, n:].any()


def test_group_advantages_match_numpy() -> None:
    scores = torch.tensor([1.0, 2.0, 4.0, 1.0, 0.0, 0.0, 3.0, -1.0])
    got = rlhf.group_advantages(scores, group_size=4)
    groups = scores.numpy().reshape(2, 4)
    want = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-6)
    assert np.allclose(got.numpy(), want.reshape(-1), atol=1e-6)
    assert np.allclose(got.view(2, 4).sum(1).numpy(), 0, atol=1e-5)  # a baseline: zero-sum within each group


# ------------------------------------------------------------------------------------------- log-probs


def test_token_logprobs_equal_log_softmax_of_a_plain_forward() -> None:
    model = tiny_gpt()
    ids = torch.randint(3, 47, (3, 12), generator=torch.Generator().manual_seed(0))
    got = rlhf.token_logprobs(model, ids)
    logits, _ = model(ids)
    for b in range(3):
        for t in range(11):
            want = F.log_softmax(logits[b, t].double(), -1)[ids[b, t + 1]].item()
            assert got[b, t].item() == pytest.approx(want, abs=1e-5)


def test_response_grid_gathers_each_rows_own_tokens() -> None:
    batch = rlhf.make_batch([[1, 5, 6], [1, 7]], [[8, 9, 2], [10]])
    assert batch.ids.tolist() == [[1, 5, 6, 8, 9, 2], [1, 7, 10, 0, 0, 0]]
    assert batch.mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    grid = torch.arange(10.0).view(2, 5)  # position t of row b holds 5b + t
    got = rlhf.gather_response(grid, batch.positions)
    assert got[0].tolist() == [2.0, 3.0, 4.0]  # response tokens at 3, 4, 5 are predicted at 2, 3, 4
    assert got[1, 0].item() == 6.0  # row 1: its only response token sits at 2, predicted at 1
    assert batch.lengths.tolist() == [6, 3]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_sampled_tokens_get_the_same_logprobs_when_recomputed(temperature: float) -> None:
    model = tiny_gpt(3)
    engine = Engine(model, config=EngineConfig(max_num_seqs=4, block_size=4))
    batch = rlhf.generate_rollouts(engine, rlhf.make_prompts(6, seed=2), max_tokens=20, temperature=temperature)
    logits, _ = model(batch.ids)
    logp = F.log_softmax(logits[:, :-1] / temperature, -1).gather(2, batch.ids[:, 1:, None]).squeeze(2)
    recomputed = rlhf.gather_response(logp, batch.positions)
    assert batch.mask.sum() > 20
    assert torch.allclose(batch.engine_logprobs * batch.mask, recomputed * batch.mask, atol=1e-5)
    engine.check_invariants()


def test_rollouts_are_reproducible_by_seed() -> None:
    engine = Engine(tiny_gpt(), config=EngineConfig(max_num_seqs=8))
    a = rlhf.generate_rollouts(engine, rlhf.make_prompts(4, 0), 16, seed=5)
    b = rlhf.generate_rollouts(engine, rlhf.make_prompts(4, 0), 16, seed=5)
    assert torch.equal(a.ids, b.ids) and a.texts == b.texts


# ---------------------------------------------------------------------------------------------- training


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_short_rlhf_run_raises_mean_reward(algo: str) -> None:
    torch.manual_seed(0)
    random.seed(0)
    cfg = rlhf.PPOConfig()  # actor lr 3e-4, beta 0.1, KL target 1 nat
    models, opts, kl_ctl, engine = rlhf.setup_rlhf(cfg, max_num_seqs=16, algo=algo)
    assert (models.critic is None) == (algo == "grpo")
    history = [rlhf.rlhf_iteration(engine, models, opts, kl_ctl, cfg, 16, 72, seed=i, algo=algo)[0]
               for i in range(6)]
    first, last = history[0]["reward"], sum(h["reward"] for h in history[-2:]) / 2
    assert last > first + 0.3, [round(h["reward"], 3) for h in history]
    # the controller answers each batch's KL: beta rises after a batch above the 1-nat target, falls below it
    for now, nxt in zip(history, history[1:]):
        assert (nxt["beta"] - now["beta"]) * (now["kl"] - cfg.kl_target) >= 0, (now, nxt)
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the first batch comes from the reference itself
    # the engine serves the trained actor after each iteration
    served = engine.model.state_dict()
    assert all(torch.equal(served[k], v) for k, v in models.actor.state_dict().items())
    assert not any(p.requires_grad for p in models.reference.parameters())
    sft = load_pretrained("draft").state_dict()  # the reference never moved: still the SFT model
    assert all(torch.equal(sft[k], v) for k, v in models.reference.state_dict().items())


def _frozen_grpo_batch(actor: GPT, reference: GPT) -> rlhf.RolloutBatch:
    """4 random sequences of 16 tokens, the last 10 the response; zero advantages, old log-probs = the actor's."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, actor.config.vocab_size, (4, 16), generator=gen)
    batch = rlhf.RolloutBatch(ids=ids, prompt_lens=torch.full((4,), 6), mask=torch.ones(4, 10), texts=[""] * 4,
                              engine_logprobs=torch.zeros(4, 10))
    with torch.no_grad():
        old = rlhf.gather_response(rlhf.token_logprobs(actor, ids), batch.positions)
        ref = rlhf.gather_response(rlhf.token_logprobs(reference, ids), batch.positions)
    batch.extra = {"logprobs": old, "ref_logprobs": ref, "advantages": torch.zeros(4, 10)}
    return batch


def _response_logprobs_by_hand(model: GPT, ids: torch.Tensor, start: int) -> torch.Tensor:
    """log pi(token) of every response token, from the model's full softmax (not the library's helpers)."""
    with torch.no_grad():
        logits, _ = model(ids)
    logp = torch.log_softmax(logits.double(), dim=-1)  # (B, T, V)
    return torch.stack([logp[:, t - 1].gather(1, ids[:, t:t + 1]).squeeze(1) for t in range(start, ids.size(1))], 1)


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_grpo_loss_pulls_the_policy_to_the_reference_only_through_its_kl_term(beta: float) -> None:
    """With zero advantages the clipped surrogate has no gradient, so a GRPO step moves the actor only through
    beta * KL(actor || reference): at beta = 0 not at all, at beta > 0 toward the reference's log-probs of the
    sampled tokens (measured from the full softmax). Deleting the KL term from the loss fails the beta > 0 case."""
    actor, reference = tiny_gpt(0).train(), tiny_gpt(1)
    batch = _frozen_grpo_batch(actor, reference)
    before = {k: v.clone() for k, v in actor.state_dict().items()}
    gap_before = (_response_logprobs_by_hand(actor, batch.ids, 6) - _response_logprobs_by_hand(reference, batch.ids, 6))
    models = rlhf.Models(actor=actor, critic=None, reward_model=None, reference=reference)
    cfg = rlhf.PPOConfig(ppo_epochs=3, num_minibatches=1, actor_lr=1e-3)
    rlhf.ppo_update(models, rlhf.make_optimizers(models, cfg), batch, cfg, beta, algo="grpo")
    moved = max((actor.state_dict()[k] - v).abs().max().item() for k, v in before.items())
    gap_after = (_response_logprobs_by_hand(actor, batch.ids, 6) - _response_logprobs_by_hand(reference, batch.ids, 6))
    if beta == 0.0:
        assert moved == 0.0
    else:
        assert moved > 0
        assert gap_after.abs().mean() < gap_before.abs().mean()  # closer to the reference on the sampled tokens
