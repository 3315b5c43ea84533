"""Chapter 13 oracles: the Bradley-Terry loss by hand, the KL estimators against exact expectations and torch's
KL, reward shaping sums, GAE over tokens against a per-row loop, group advantages against numpy, log-probs against
a plain forward, the engine's sampled-token log-probs against the trainer's, GRPO's KL term against a k3 computed
from the full softmax, and short seeded RLHF runs: GRPO raises the mean reward, PPO raises the rule score (the
"human") over the SFT model on three seeds while the share of well-formed records falls (reward hacking)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import load_script, run_json, scripts_dir, smoke_run
from mlsys import reward_model, rlhf
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
    assert reward_model.rule_score(base + '["c"]}') == 1
    assert reward_model.rule_score(base + '["c", "go", "rust"]}') == 3
    assert reward_model.rule_score(base + '["c", "go", "lua", "rust"]}') == 0  # four: malformed
    assert reward_model.rule_score(base + '["c", "g') == 0


def test_preference_pairs_are_labelled_by_the_rule() -> None:
    pairs = reward_model.make_preference_pairs(200, seed=3)
    assert len(pairs) == 200
    for chosen, rejected in pairs:
        assert reward_model.rule_score(chosen) > reward_model.rule_score(rejected)
        assert chosen.split('"')[3] == rejected.split('"')[3]  # same name: the same prompt
    assert reward_model.make_preference_pairs(20, seed=3) == pairs[:20]  # deterministic


def _rule_by_hand(text: str) -> int:
    """The preference rule, written here from the schema with the json library: 0 unless the text is one JSON
    object with exactly the keys name, age, city, langs (in that order) holding a known name, an integer age in
    range, a known city and 1 to 3 distinct known languages; else the number of languages."""
    import json

    from mlsys.data import AGE_RANGE, LANGS, MAX_LANGS, PEOPLE

    try:
        rec = json.loads(text)
    except ValueError:
        return 0
    if not isinstance(rec, dict) or list(rec) != ["name", "age", "city", "langs"]:
        return 0
    langs, age = rec["langs"], rec["age"]
    ok = (rec["name"] in PEOPLE and isinstance(age, int) and not isinstance(age, bool)
          and AGE_RANGE[0] <= age <= AGE_RANGE[1] and rec["city"] in {p.city for p in PEOPLE.values()}
          and isinstance(langs, list) and 1 <= len(langs) <= MAX_LANGS
          and all(isinstance(x, str) and x in LANGS for x in langs) and len(set(langs)) == len(langs))
    return len(langs) if ok else 0


def test_records_picture_counts_agree_with_the_rule_written_by_hand(smoke_cache) -> None:
    """records.png (preference_rule.py --smoke): the SFT model's responses, the examples drawn with their scores,
    and the bars of responses per score and per malformed kind, against the rule written here with json."""
    import json

    proc = smoke_run(smoke_cache, scripts_dir(13) / "preference_rule.py")
    assert proc["code"] == 0, proc["stderr"][-2000:]
    res = proc["json"]["results"]
    texts, prompts = res["texts"], res["prompts"]
    assert len(texts) == len(prompts) == proc["json"]["settings"]["num_prompts"]
    assert all(t.startswith(p) for t, p in zip(texts, prompts))  # each response continues its own prompt
    by_hand = [_rule_by_hand(t) for t in texts]
    assert res["scores"] == by_hand
    assert res["per_score"] == {str(s): by_hand.count(s) for s in range(4)}
    assert all(by_hand.count(s) > 0 for s in range(4)), "the picture should show every score, malformed included"
    malformed = [t for t, s in zip(texts, by_hand) if s == 0]
    kinds = res["per_kind"]
    assert kinds["well_formed"] == len(texts) - len(malformed)
    assert sum(n for k, n in kinds.items() if k != "well_formed") == len(malformed)

    def not_json(t: str) -> bool:
        try:
            json.loads(t)
            return False
        except ValueError:
            return True
    assert kinds["not_json"] == sum(map(not_json, malformed))
    assert kinds["four_plus_langs"] == sum(not not_json(t) and isinstance(json.loads(t), dict)
                                           and isinstance(json.loads(t).get("langs"), list)
                                           and len(json.loads(t)["langs"]) > 3 for t in malformed)
    shown = res["examples"]
    assert len(set(shown)) == len(shown) == min(proc["json"]["settings"]["examples"], len(texts))
    assert {by_hand[i] for i in shown} >= {0, 1, 2, 3}  # one of each score among the examples drawn


# ------------------------------------------------------------------------------------------ reward model


def test_bradley_terry_loss_by_hand() -> None:
    chosen, rejected = torch.tensor([2.0, -1.0, 0.3]), torch.tensor([0.5, 0.5, 0.3])
    by_hand = sum(math.log(1 + math.exp(-(c - r))) for c, r in zip(chosen.tolist(), rejected.tolist())) / 3
    assert reward_model.bradley_terry_loss(chosen, rejected).item() == pytest.approx(by_hand, rel=1e-6)
    # gradient w.r.t. r_chosen: -(1 - sigmoid(c - r)) / P
    c = chosen.clone().requires_grad_(True)
    reward_model.bradley_terry_loss(c, rejected).backward()
    want = [-(1 - 1 / (1 + math.exp(-(a - b)))) / 3 for a, b in zip(chosen.tolist(), rejected.tolist())]
    assert c.grad.tolist() == pytest.approx(want, rel=1e-5)


def test_scalar_head_scores_at_the_last_real_token() -> None:
    rm = reward_model.ScalarHeadModel(tiny_gpt())
    torch.nn.init.normal_(rm.head.weight)
    ids, lengths = reward_model.encode_records(['{"name": "ada"}', '{"name": "alan", "age": 41}'])
    per_pos = rm(ids)  # (B, T)
    alone = rm(ids[:1, : lengths[0]])  # the short row without its padding
    assert rm.score(ids, lengths)[0].item() == pytest.approx(alone[0, -1].item(), abs=1e-5)
    assert rm.score(ids, lengths)[1].item() == pytest.approx(per_pos[1, lengths[1] - 1].item(), abs=1e-6)


def test_normalized_reward_model_has_mean_0_std_1_and_keeps_the_order() -> None:
    rm = reward_model.ScalarHeadModel(tiny_gpt())
    torch.nn.init.normal_(rm.head.weight)
    texts = [t for pair in reward_model.make_preference_pairs(20, seed=1) for t in pair]
    ids, lengths = reward_model.encode_records(texts)
    with torch.no_grad():
        before = rm.score(ids, lengths)
        reward_model.normalize_reward_model(rm, texts)
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
def test_kl_calculator_script_matches_exact_values(tmp_path_factory) -> None:
    """Section 1 against torch.distributions and the estimators' definitions, summed over the five outcomes in
    numpy; the sampled columns against the binomial and central-limit spread of --smoke's 2000 draws. Section 3
    against log pi(y) and log pi_ref(y) of the recorded response, from one forward of each model here."""
    from torch.distributions import Categorical, kl_divergence

    mod = load_script(scripts_dir(13) / "kl_calculator.py")
    settings, draws = mod.Settings(), 2000  # the --smoke draws
    res = run_json(tmp_path_factory, scripts_dir(13) / "kl_calculator.py", "--smoke", timeout=290)
    for name, rows in res["categorical"].items():
        p, q = (np.array(res["distributions"][name][x]) for x in ("p", "q"))
        kl = kl_divergence(Categorical(probs=torch.tensor(p)), Categorical(probs=torch.tensor(q))).item()
        r = q / p  # each outcome's ratio pi_ref / pi: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r
        values = {"k1": -np.log(r), "k2": np.log(r) ** 2 / 2, "k3": r - 1 - np.log(r)}
        for row in rows:
            v = values[row["estimator"]]
            mean, sd = float(p @ v), float(np.sqrt(p @ (v - p @ v) ** 2))
            assert row["exact KL"] == pytest.approx(kl, rel=1e-9)
            assert row["E_p[k] exact"] == pytest.approx(mean, rel=1e-9), (name, row["estimator"])
            assert abs(row["sample mean"] - mean) < 5 * sd / np.sqrt(draws) + 1e-12, (name, row["estimator"])
            neg = float(p[v < 0].sum())  # the chance that one draw is negative
            assert abs(row["negative %"] / 100 - neg) < 5 * np.sqrt(neg * (1 - neg) / draws) + 1e-12
    shaping = res["shaping"]
    ids, start = torch.tensor([shaping["ids"]]), shaping["prompt_len"]
    with torch.no_grad():
        logp = [Categorical(logits=model(ids)[0][0, start - 1 : -1].double()).log_prob(ids[0, start:]).sum().item()
                for model in (load_pretrained("small"), load_pretrained("draft"))]
    assert shaping["num_tokens"] == len(shaping["ids"]) - start
    assert shaping["sum_rewards"] == pytest.approx(settings.score - settings.beta * (logp[0] - logp[1]), abs=1e-5)


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
    batch = rlhf.generate_rollouts(engine, reward_model.make_prompts(6, seed=2), max_tokens=20, temperature=temperature)
    logits, _ = model(batch.ids)
    logp = F.log_softmax(logits[:, :-1] / temperature, -1).gather(2, batch.ids[:, 1:, None]).squeeze(2)
    recomputed = rlhf.gather_response(logp, batch.positions)
    assert batch.mask.sum() > 20
    assert torch.allclose(batch.engine_logprobs * batch.mask, recomputed * batch.mask, atol=1e-5)
    engine.check_invariants()


def test_rollouts_are_reproducible_by_seed() -> None:
    engine = Engine(tiny_gpt(), config=EngineConfig(max_num_seqs=8))
    a = rlhf.generate_rollouts(engine, reward_model.make_prompts(4, 0), 16, seed=5)
    b = rlhf.generate_rollouts(engine, reward_model.make_prompts(4, 0), 16, seed=5)
    assert torch.equal(a.ids, b.ids) and a.texts == b.texts


# ---------------------------------------------------------------------------------------------- training


def _check_run(history: list[dict], cfg, models, engine) -> None:
    """What any short run must show: the controller answers each batch's KL, the first batch is the reference's
    own, the engine serves the trained actor, and the reference is still the SFT model."""
    for now, nxt in zip(history, history[1:]):  # beta rises after a batch above the target KL, falls below it
        assert (nxt["beta"] - now["beta"]) * (now["kl"] - cfg.kl_target) >= 0, (now, nxt)
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the first batch comes from the reference itself
    served = engine.model.state_dict()
    assert all(torch.equal(served[k], v) for k, v in models.actor.state_dict().items())
    assert not any(p.requires_grad for p in models.reference.parameters())
    sft = load_pretrained("draft").state_dict()  # the reference never moved: still the SFT model
    assert all(torch.equal(sft[k], v) for k, v in models.reference.state_dict().items())


@pytest.mark.timeout(120)
def test_short_grpo_run_raises_mean_reward() -> None:
    torch.manual_seed(0)
    random.seed(0)
    cfg = rlhf.PPOConfig()  # actor lr 3e-4, beta 0.1, KL target 1 nat
    models, opts, kl_ctl, engine = rlhf.setup_rlhf(cfg, max_num_seqs=16, algo="grpo")
    assert models.critic is None
    history = [rlhf.rlhf_iteration(engine, models, opts, kl_ctl, cfg, 16, 72, seed=i, algo="grpo")[0]
               for i in range(6)]
    first, last = history[0]["reward"], sum(h["reward"] for h in history[-2:]) / 2
    assert last > first + 0.3, [round(h["reward"], 3) for h in history]
    _check_run(history, cfg, models, engine)


@pytest.mark.long  # two trainings, about 10 s: make sweep (and CI) run it
def test_reward_model_weights_do_not_depend_on_the_callers_thread_count() -> None:
    """scripts/train_weights.py (torch's default threads: 2 on a 2-core machine) and reward_model.py (one thread)
    write the same checkpoint; trained under different thread counts they once differed, and PPO's results with
    them. A short recipe trained under 2 and under 1 thread gives bit-identical weights, and the caller's thread
    count is left as it was."""
    recipe = reward_model.RewardRecipe(num_pairs=64, steps=3, batch_size=16)
    sft, before = load_pretrained("draft"), torch.get_num_threads()
    models = []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            models.append(reward_model.train_reward_model(sft, recipe)[0].state_dict())
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    assert models[0].keys() == models[1].keys()
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])


@pytest.mark.long  # three seeds of 12 iterations: make sweep (and CI) run it
@pytest.mark.timeout(300)
def test_ppo_raises_the_rule_score_over_the_sft_model_and_hacks_the_reward_model() -> None:
    """The "human" must agree, not only the reward model: on 256 fresh prompts (the same prompts and sampling seeds
    for every policy), the policy after 12 PPO iterations of 32 rollouts scores higher by the rule than the SFT model
    it started from by at least 0.25 languages averaged over three seeds (measured: +0.59, +0.60, -0.10), the
    lesson's "on average": one seed can lose a little while the reward model's view gains on every seed. And the
    reward is hacked as the lesson says: the share of well-formed records falls below the SFT model's."""
    cfg = rlhf.PPOConfig()
    sft_engine = Engine(load_pretrained("draft"), config=EngineConfig(max_num_seqs=64))
    sft = rlhf.evaluate_policy(sft_engine, reward_model.load_reward_model("draft"), num_prompts=256)
    # well-formed by the schema written in this file (_rule_by_hand), not by the rule_score that `valid` and
    # `kinds` both come from
    by_hand = sum(_rule_by_hand(t) > 0 for t in sft["texts"])
    assert sum(sft["kinds"].values()) == 256 and sft["kinds"]["well_formed"] == by_hand
    assert sft["valid"] == pytest.approx(by_hand / 256)
    gains, valid = [], []
    for seed in range(3):
        torch.manual_seed(seed)
        models, opts, kl_ctl, engine = rlhf.setup_rlhf(cfg, max_num_seqs=64)
        history = [rlhf.rlhf_iteration(engine, models, opts, kl_ctl, cfg, 32, 72, seed=seed * 10_000 + i)[0]
                   for i in range(12)]
        _check_run(history, cfg, models, engine)
        trained = rlhf.evaluate_policy(engine, models.reward_model, num_prompts=256)
        rule = [float(_rule_by_hand(t)) for t in trained["texts"]]  # the rule applied here, not the summary
        gains.append(sum(rule) / len(rule) - sum(map(_rule_by_hand, sft["texts"])) / 256)
        valid.append(sum(r > 0 for r in rule) / len(rule))
        assert trained["reward"] > sft["reward"] + 0.3  # the reward model's view: a large gain
    assert sum(gains) / 3 >= 0.25 and sum(g > 0.1 for g in gains) >= 2, gains
    assert sum(valid) / 3 < sft["valid"], (valid, sft["valid"])


@pytest.mark.parametrize("before, after, fmt", [
    (9, 4, ""),             # the lesson's run: fewer four-or-repeated records after training, not more
    (4, 9, ""), (5, 5, ""),
    (0.9414, 0.9492, ".0%"), (0.9414, 0.90, ".0%"),
    (0.9414, 0.9430, ".0%"),  # different values that print alike: no direction to claim
])
def test_hacking_words_read_the_direction_from_the_two_values(before: float, after: float, fmt: str) -> None:
    """The words section 3 prints and the lesson quotes ('fell from 9 to 4'): the direction recomputed here from
    the numbers as printed, so a sentence that always says the policy learned more ('learns both') fails."""
    script = load_script(scripts_dir(13) / "rlhf_loop.py")
    a, b = format(before, fmt), format(after, fmt)
    want = f"stayed at {a}" if a == b else ("rose" if after > before else "fell") + f" from {a} to {b}"
    assert script.change(before, after, fmt) == want


@pytest.mark.parametrize("sft, trained", [(15, 13), (15, 62), (15, 15), (0, 1), (9, 0)])
def test_hack_verdict_reads_more_malformed_records_as_hacking(sft: int, trained: int) -> None:
    """The verdict the lesson quotes up front: hacking by the rule's count only when the trained policy wrote
    strictly more malformed records than the SFT model (the lesson's run wrote fewer), with both counts named."""
    verdict = load_script(scripts_dir(13) / "rlhf_loop.py").hack_verdict(sft, trained)
    word = "more" if trained > sft else "fewer" if trained < sft else "as many"
    assert f"wrote {trained} malformed records against the SFT model's {sft}: {word}," in verdict
    assert verdict.endswith("shows no reward hacking") == (not trained > sft)
    assert verdict.endswith("shows reward hacking") == (trained > sft)


def test_rlhf_loop_hacking_words_agree_with_its_own_counts(smoke_cache) -> None:
    """rlhf_loop.py --smoke: the printed and recorded words of section 3 against its recorded numbers."""
    proc = smoke_run(smoke_cache, scripts_dir(13) / "rlhf_loop.py")
    assert proc["code"] == 0, proc["stderr"][-2000:]
    h = proc["json"]["results"]["hacking"]
    sft, trained = h["sft"], h["trained"]
    counts = [sum(e["kinds"][k] for k in ("four_plus_langs", "repeated_lang")) for e in (sft, trained)]
    assert counts == [sft["hacks"], trained["hacks"]]
    word = "stayed" if counts[0] == counts[1] else "rose" if counts[1] > counts[0] else "fell"
    assert h["hacks_change"].startswith(word)
    a, b = (format(e["rule_score"], ".2f") for e in (sft, trained))  # the rule score as printed
    assert h["rule_change"] == (f"stayed at {a}" if a == b else
                                f"{'rose' if trained['rule_score'] > sft['rule_score'] else 'fell'} from {a} to {b}")
    assert f"rule score {h['rule_change']};" in proc["stdout"]
    paid = sft["reward_malformed"] > sft["reward_valid"]  # nan (no malformed record) compares False
    assert h["sft_malformed_paid"] == ("above" if paid else "not above")
    assert f"records with four or repeated languages {h['hacks_change']};" in proc["stdout"]
    malformed = [e["prompts"] - e["kinds"]["well_formed"] for e in (sft, trained)]  # counted from the kinds
    assert malformed == [sft["malformed"], trained["malformed"]]
    want = "shows reward hacking" if malformed[1] > malformed[0] else "shows no reward hacking"
    assert h["hack_verdict"].endswith(want)
    assert f"   verdict: {h['hack_verdict']}\n" in proc["stdout"]
    settings = proc["json"]["settings"]  # section 2's header names the controller the run used (--k-beta shows)
    assert f"KL target {settings['kl_target']}, gain K_beta {settings['k_beta']})" in proc["stdout"]


def _signs_by_hand(d_last: float, d_top: float, r_top: float, top_is_last: bool) -> list[str]:
    """The phrases the sentence under the token table must hold, decided here from the deltas themselves."""
    words = [("fell short of" if d_last < 0 else "reached") + " the critic's last value, so the last tokens are "
             f"pushed {'down' if d_last < 0 else 'up'}"]
    if top_is_last:
        return words + ["the largest delta is that last one"]
    mostly = "its reward r_t" if abs(r_top) > abs(d_top - r_top) else "the critic's change of value"  # V_(t+1) - V_t
    return words + [f"before it {'up' if d_top > 0 else 'down'}, is mostly {mostly};",
                    "a KL bonus" if r_top > 0 else "a KL charge"]


@pytest.mark.parametrize("d_last, d_top, r_top, top_is_last", [
    (-0.896, 0.333, 0.511, False),  # the lesson's run: R short of V at the end, a KL bonus carries the largest delta
    (0.2, 0.4, -0.05, False), (0.2, 0.4, 0.05, False), (-0.3, 0.3, -0.4, False), (0.3, 0.3, 0.3, True),
    (-0.1, -0.02, -0.01, False),
])
def test_signs_sentence_reads_the_deltas(d_last: float, d_top: float, r_top: float, top_is_last: bool) -> None:
    """The 'so:' line under the token table, which the lesson quotes: each direction recomputed from the numbers."""
    text = load_script(scripts_dir(13) / "rlhf_loop.py").signs_text(d_last, d_top, r_top, top_is_last)
    assert all(w in text for w in _signs_by_hand(d_last, d_top, r_top, top_is_last)), text


def test_rlhf_loop_signs_sentence_agrees_with_its_own_token_table(smoke_cache) -> None:
    """rlhf_loop.py --smoke: the deltas recomputed in numpy from the recorded rewards and values of the response."""
    proc = smoke_run(smoke_cache, scripts_dir(13) / "rlhf_loop.py")
    assert proc["code"] == 0, proc["stderr"][-2000:]
    resp = proc["json"]["results"]["response"]
    r, v = np.array(resp["rewards"]), np.array(resp["values"])
    delta = r + np.append(v[1:], 0.0) - v  # gamma 1
    top = int(np.argmax(delta))
    for w in _signs_by_hand(delta[-1], delta[top], r[top], top == len(r) - 1):
        assert w in resp["signs_text"], (w, resp["signs_text"])
    assert f"   so: {resp['signs_text']}" in proc["stdout"]


def test_response_kind_names_how_a_record_breaks_the_schema() -> None:
    base = '{"name": "ada", "age": 34, "city": "london", "langs": '
    assert rlhf.response_kind(base + '["c", "go"]}') == "well_formed"
    assert rlhf.response_kind(base + '["c", "go", "lua", "rust"]}') == "four_plus_langs"
    assert rlhf.response_kind(base + '["go", "go"]}') == "repeated_lang"
    assert rlhf.response_kind(base + '["c", "g') == "not_json"
    assert rlhf.response_kind(base.replace("london", "lodnon") + '["c"]}') == "other"


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


@pytest.mark.parametrize("beta", [0.0, 0.04, 0.5])
def test_grpo_loss_and_gradient_are_beta_times_an_independent_k3_kl(beta: float) -> None:
    """One GRPO step with zero advantages (the clipped surrogate is then 0 with zero gradient), plain SGD at lr 1
    and no gradient clipping: the loss it reports must be beta * mean_t k3_t and its step must be -beta * grad of
    that mean, with k3 = exp(ref - logp) - 1 - (ref - logp) computed here from the full softmax of both models
    (none of mlsys.rlhf's helpers). Deleting or rescaling the KL term fails at beta > 0."""
    actor, reference = tiny_gpt(0).train(), tiny_gpt(1)
    batch = _frozen_grpo_batch(actor, reference)
    params = list(actor.parameters())
    before = [p.detach().clone() for p in params]
    logits, _ = actor(batch.ids)
    logp = torch.log_softmax(logits.double(), -1)[:, 5:-1].gather(2, batch.ids[:, 6:, None]).squeeze(2)  # (4, 10)
    ref = _response_logprobs_by_hand(reference, batch.ids, 6)
    k3 = (ref - logp).exp() - 1 - (ref - logp)
    want_loss = beta * k3.mean()
    grads = torch.autograd.grad(k3.mean(), params)
    actor.zero_grad(set_to_none=True)

    models = rlhf.Models(actor=actor, critic=None, reward_model=None, reference=reference)
    cfg = rlhf.PPOConfig(ppo_epochs=1, num_minibatches=1, max_grad_norm=1e9)
    stats = rlhf.ppo_update(models, {"actor": torch.optim.SGD(params, lr=1.0)}, batch, cfg, beta, algo="grpo")
    assert stats["policy_loss"] == pytest.approx(want_loss.item(), rel=1e-4, abs=1e-9)
    scale = max(g.abs().max().item() for g in grads)
    assert k3.mean().item() > 1e-3 and scale > 1e-3  # two different random models: the KL term has a gradient
    for p, p0, g in zip(params, before, grads):  # the step, to 0.1% of the largest gradient entry
        torch.testing.assert_close((p.detach() - p0).double(), -beta * g.double(), rtol=1e-3, atol=1e-3 * beta * scale)


# ----------------------------------------------------------------------------------------------- the drawn pictures
@pytest.fixture(scope="module")
def two_ppo_iterations():
    """Two short PPO iterations (4 rollouts of at most 72 tokens; the critic has been trained once, so the second
    batch's values are not zero): the second batch, the beta it was shaped with, its stats and the config."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = rlhf.PPOConfig()
    models, opts, kl_ctl, engine = rlhf.setup_rlhf(cfg, max_num_seqs=4)
    for i in range(2):
        beta = kl_ctl.beta
        stats, batch = rlhf.rlhf_iteration(engine, models, opts, kl_ctl, cfg, 4, 72, seed=i)
    return batch, beta, stats, cfg


@pytest.mark.timeout(120)
def test_drawn_response_advantages_equal_an_independent_numpy_gae(tmp_path, two_ppo_iterations) -> None:
    """response.png: after two short PPO iterations, the rewards, values and advantages drawn for one response.
    The rewards are -beta k1 per token plus the score on the last; the raw advantages equal a GAE written here in
    numpy over the drawn rewards and values (gamma 1, lambda 0.95, nothing bootstrapped past the last token); the
    whitened ones are the batch's own."""
    from types import SimpleNamespace

    from conftest import load_script

    script = load_script(scripts_dir(13) / "rlhf_loop.py")
    batch, beta, _, cfg = two_ppo_iterations
    row = 1
    drawn = script.draw_response(batch, beta, cfg, SimpleNamespace(plot_dir=str(tmp_path)), row=row)
    x, n = batch.extra, int(batch.mask[row].sum())
    k1 = (x["logprobs"][row, :n] - x["ref_logprobs"][row, :n]).numpy()
    rewards, values = np.array(drawn["rewards"]), np.array(drawn["values"])
    expected_rewards = -beta * k1
    expected_rewards[-1] += x["scores"][row].item()
    np.testing.assert_allclose(rewards, expected_rewards, atol=1e-5)
    assert np.abs(values).max() > 1e-3  # a trained critic: the test would be trivial with V = 0
    adv, next_adv, next_value = np.zeros(n), 0.0, 0.0
    for t in reversed(range(n)):  # the textbook recursion, terminal after the last token
        delta = rewards[t] + cfg.gamma * next_value - values[t]
        next_adv = adv[t] = delta + cfg.gamma * cfg.lam * next_adv
        next_value = values[t]
    np.testing.assert_allclose(drawn["advantages_raw"], adv, atol=1e-5)
    np.testing.assert_allclose(drawn["advantages"], x["advantages"][row, :n].numpy(), atol=1e-6)
    assert drawn["raw_negative"] == int((adv < 0).sum())
    # the TD errors the lesson reads off the output, and the stretches of one sign
    deltas = rewards + cfg.gamma * np.append(values[1:], 0.0) - values
    assert drawn["delta_last"] == pytest.approx(rewards[-1] - values[-1], abs=1e-5)
    assert drawn["delta_max"] == pytest.approx(deltas.max(), abs=1e-5)
    assert drawn["delta_max_reward"] == pytest.approx(rewards[int(deltas.argmax())], abs=1e-5)
    flips = int((np.diff((adv >= 0).astype(int)) != 0).sum())
    stretches, first = drawn["sign_stretches"], "positive" if adv[0] >= 0 else "negative"
    assert stretches.startswith(first) and stretches.count(" on t ") == min(flips + 1, 4)
    if flips == 0:
        assert stretches == f"{first} on t 0-{n - 1}"


@pytest.mark.timeout(120)
def test_drawn_iteration_shapes_and_grids_against_counts_from_the_texts(tmp_path, two_ppo_iterations) -> None:
    """iteration.png: the tensors of one iteration, drawn in dataflow order. Their shapes against counts made here
    from the response texts alone (a character-level tokenizer: <bos>, one id per character, <eos> unless the
    response hit the token limit): ids (B, max prompt + response), every per-token grid (B, max response), the
    reward model's scores (B,); each drawn grid has exactly each row's response tokens, padding blank; the ids
    drawn spell the texts; each row's drawn rewards sum to its score minus beta times its drawn k1; the drawn
    advantages have mean 0 and standard deviation 1 over the real tokens (whitening)."""
    from types import SimpleNamespace

    from conftest import load_script
    from mlsys.data import Tokenizer

    script = load_script(scripts_dir(13) / "rlhf_loop.py")
    batch, beta, stats, _ = two_ppo_iterations
    drawn = script.draw_iteration(batch, stats, 2, SimpleNamespace(plot_dir=str(tmp_path)))
    max_tokens = 72
    prompts = [t[: t.index('", ') + 3] for t in batch.texts]  # '{"name": "ada", ' starts every text
    resp_chars = [len(t) - len(p) for t, p in zip(batch.texts, prompts)]
    n = [min(max_tokens, c + 1) for c in resp_chars]  # + <eos>, unless the limit cut the response first
    assert min(n) < max_tokens or max(resp_chars) == max_tokens
    B, L, T = len(prompts), max(n), max(1 + len(p) + k for p, k in zip(prompts, n))
    for title, shape in drawn["shapes"].items():
        want = [B, T] if "ids" in title else [B] if "reward model" in title else [B, L]
        assert shape == want, (title, shape, want)
    grids = {k: np.array(v, dtype=float) for k, v in drawn.items() if isinstance(v, list) and k not in
             ("ids", "scores")}
    assert len(grids) == 8
    for name, g in grids.items():
        assert g.shape == (B, L) and (~np.isnan(g)).sum(1).tolist() == n, name
    itos = Tokenizer().itos
    for b, text in enumerate(batch.texts):
        row = drawn["ids"][b]
        assert row[0] == 1 and "".join(itos[i] for i in row[1: 1 + len(text)]) == text
    k1, rewards = np.nan_to_num(grids["3. KL: k1 = log pi - log pi_ref"]), np.nan_to_num(grids["3. shaped reward r_t"])
    np.testing.assert_allclose(rewards.sum(1), np.array(drawn["scores"]) - drawn["beta"] * k1.sum(1), atol=1e-5)
    assert drawn["beta"] == pytest.approx(beta)
    adv = grids["4. GAE: advantage, whitened"][~np.isnan(grids["4. GAE: advantage, whitened"])]
    assert abs(adv.mean()) < 1e-5 and adv.std() == pytest.approx(1.0, abs=1e-4)


def test_grpo_vs_ppo_beta_paths_and_extremes_against_numpy_on_the_history(smoke_cache) -> None:
    """grpo_vs_ppo.py --smoke: the printed beta paths (in how many iterations PPO's and GRPO's beta differed, and
    each one's steps up and down) and the lowest share of well-formed records, recounted with numpy from the
    per-iteration histories; and the lesson's reason why two different paths can end at the same beta: the final
    beta is the start times the product of the steps, in any order."""
    proc = smoke_run(smoke_cache, scripts_dir(13) / "grpo_vs_ppo.py")
    assert proc["code"] == 0, proc["stderr"][-2000:]
    res = proc["json"]["results"]
    betas = {a: np.array([h["beta"] for h in res[a]["history"]]) for a in ("ppo", "grpo")}
    differ = np.flatnonzero(~np.isclose(betas["ppo"], betas["grpo"], rtol=0, atol=1e-9))
    assert res["beta_differ_iterations"] == len(differ)
    assert res["beta_first_differ"] == (int(differ[0]) + 1 if len(differ) else None)
    assert res["beta_paths"] == ("different" if len(differ) else "identical")
    for algo, b in betas.items():
        e, ratio = res[algo]["extremes"], b[1:] / b[:-1]
        assert (e["beta_up"], e["beta_down"]) == (int((ratio > 1 + 1e-9).sum()), int((ratio < 1 - 1e-9).sum()))
        assert e["valid_min"] == min(h["valid"] for h in res[algo]["history"])
        assert b[-1] == pytest.approx(b[0] * np.prod(np.sort(ratio)))  # the order of the steps does not matter
    low, high = sorted(float(b[-1]) for b in betas.values())
    step = rlhf.PPOConfig().k_beta * 0.2  # one step of the controller at its clip
    want = "equal" if np.isclose(low, high, rtol=1e-9, atol=0) else "close" if high / low < 1 + step else "different"
    assert res["beta_final_verdict"] == want
    start = {"equal": "both end at the same", "close": "they end at close", "different": "they end at different"}
    assert res["beta_end_text"].startswith(start[want])
    line = next(ln for ln in proc["stdout"].splitlines() if ln.startswith("beta per iteration"))
    assert start[want] in line


@pytest.mark.parametrize("ppo, grpo, want", [
    (0.264, 0.454, "different"),   # the lesson's kind of run: 17 vs 15 steps up
    (0.325, 0.353, "close"),       # the same steps up and down, one of them below the clip
    (0.353, 0.325, "close"),       # either order
    (0.1 * 1.1**3, 0.1 * 1.1**3 * (1 + 1e-12), "equal"),
    (0.2, 0.2 * 1.1 * 1.0001, "different"),  # just past one step at the clip
])
def test_final_beta_verdict_against_the_ratio_of_the_two_betas(ppo: float, grpo: float, want: str) -> None:
    """The words the lesson quotes for the final betas: equal, less than one 10% controller step apart (close),
    or more (different); checked against the ratio of the two betas computed here."""
    script = load_script(scripts_dir(13) / "grpo_vs_ppo.py")
    step = rlhf.PPOConfig().k_beta * 0.2
    ratio = max(ppo, grpo) / min(ppo, grpo)
    assert want == ("equal" if ratio - 1 < 1e-9 else "close" if ratio < 1 + step else "different")
    assert script.final_beta_verdict(ppo, grpo, step) == want


def test_grpo_vs_ppo_first_group_advantages_against_numpy(smoke_cache) -> None:
    """grpo_vs_ppo.py --smoke: the worked group the lesson quotes before GRPO's formula. The advantages its update
    used, as printed and in the JSON, equal (R_i - mean) / (std + 1e-6) of the printed scores computed with numpy
    (sample std, n - 1), and sum to zero within the group."""
    proc = smoke_run(smoke_cache, scripts_dir(13) / "grpo_vs_ppo.py")
    assert proc["code"] == 0, proc["stderr"][-2000:]
    group = proc["json"]["results"]["grpo_group"]
    scores = np.array(group["scores"])
    want = (scores - scores.mean()) / (scores.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(group["advantages"], want, atol=1e-5)
    assert (group["mean"], group["std"]) == (pytest.approx(scores.mean()), pytest.approx(scores.std(ddof=1)))
    assert abs(sum(group["advantages"])) < 1e-4 and len(group["tokens"]) == len(scores) and min(group["tokens"]) > 0
    line = next(ln for ln in proc["stdout"].splitlines() if ln.startswith("GRPO's first group"))
    printed = [float(v) for v in line.split("(std + 1e-6) ")[1].split(", on all")[0].split()]
    np.testing.assert_allclose(printed, want, atol=0.006)  # the printed line, rounded to 2 decimals


def nearer_by_hand(ppo: float, grpo: float, target: float) -> str:
    """Whose KL the lesson may call nearer the target: distances of the two KLs as printed (2 decimals), exact."""
    from decimal import Decimal

    off = [abs(Decimal(f"{x:.2f}") - Decimal(str(target))) for x in (ppo, grpo)]
    if off[0] == off[1]:
        return "both equally near it" if target else "equal"
    return f"{'PPO' if off[0] < off[1] else 'GRPO'}'s is {'nearer' if target else 'lower'}"


@pytest.mark.parametrize("ppo, grpo, target", [
    (1.648, 2.207, 1.0),   # the lesson's kind of run: both above the target
    (0.5, 1.2, 1.0),       # the lower KL is the farther one
    (1.9, 0.3, 1.0),
    (0.799, 1.204, 1.0),   # printed 0.80 and 1.20: equally near, though the raw numbers are not
    (1.0, 2.0, 0.0),       # --kl-target 0: no target, the lower one
    (10.0, 9.0, 0.0),      # compared as numbers, not as the printed strings
    (3.001, 2.999, 0.0),
])
def test_kl_verdict_names_the_kl_nearer_the_target(ppo: float, grpo: float, target: float) -> None:
    """The sentence the lesson quotes under GRPO for the two `kl` columns: whose KL, averaged over the last five
    iterations, ended nearer the target, read from the two KLs as printed; checked against distances computed
    here with exact decimals."""
    text = load_script(scripts_dir(13) / "grpo_vs_ppo.py").kl_verdict(ppo, grpo, target)
    assert text.startswith(f"PPO {ppo:.2f}, GRPO {grpo:.2f} nats, ")
    assert text.endswith(": " + nearer_by_hand(ppo, grpo, target))


def test_grpo_vs_ppo_kl_verdict_reads_its_own_kl_columns(smoke_cache) -> None:
    """grpo_vs_ppo.py --smoke: the KL sentence, as printed and recorded, names the algorithm whose `kl` column
    (the mean over the last iterations) is nearer the run's target."""
    proc = smoke_run(smoke_cache, scripts_dir(13) / "grpo_vs_ppo.py")
    assert proc["code"] == 0, proc["stderr"][-2000:]
    results, target = proc["json"]["results"], proc["json"]["settings"]["kl_target"]
    kl = [results[algo]["summary"]["kl"] for algo in ("ppo", "grpo")]
    assert results["kl_text"].endswith(": " + nearer_by_hand(*kl, target))
    assert f"iterations: {results['kl_text']}\n" in proc["stdout"]


def test_rlhf_loop_printed_parts_joined_are_the_whole_output(smoke_cache) -> None:
    """rlhf_loop.py --smoke: the lesson shows the output part by part, beside the text that reads each part, from
    the JSON's "printed"; together, in order, the parts are exactly what the run printed (less the `figure:` lines,
    whose paths are the machine's)."""
    proc = smoke_run(smoke_cache, scripts_dir(13) / "rlhf_loop.py")
    assert proc["code"] == 0, proc["stderr"][-2000:]
    parts = proc["json"]["results"]["printed"]
    assert list(parts) == ["models", "phases", "loop", "hacking", "examples", "response", "tensors"]
    shown = [line for line in proc["stdout"].strip("\n").split("\n") if not line.startswith("figure: ")]
    assert "\n\n".join(parts.values()).split("\n") == shown
    starts = {"models": "   model ", "phases": "1. ", "loop": "2. ", "hacking": "3. ",
              "response": "   One response of iteration", "tensors": "4. "}
    assert all(parts[k].startswith(v) for k, v in starts.items())
    # the lesson shows the no-penalty run's section 3 through its verdict alone: the part must end there
    assert parts["hacking"].split("\n")[-1].startswith("   verdict: ")
    assert parts["examples"].startswith(("   malformed, scored", "   the same prompts, SFT then trained:"))
    assert "reward model  " in parts["models"] and "read at the last token: (B,)" in parts["models"]
