"""Chapter 14 oracles for the memory planner (formulas by hand, on published and toy shapes) and for the placements
(co-located and disaggregated give the same numbers as one process running chapter 13's loop on the same shards)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import load_script, run_json, scripts_dir, smoke_run
from mlsys import kv_memory as kvm
from mlsys import memory as mem

CH14 = scripts_dir(14)
GIB = 1024**3


@pytest.fixture(scope="module")
def planner():
    return load_script(CH14 / "memory_planner.py")


def settings(planner, **kw):
    return planner.Settings(**kw)


# ------------------------------------------------------------------------------------------ planner formulas
def test_state_bytes_by_hand(planner) -> None:
    # trained: 2 + 2 + 12 B per parameter, all three divided by the shards (ZeRO-3)
    assert planner.state_bytes(1000, True, 4) == {"weights": 500.0, "grads": 500.0, "optimizer": 3000.0}
    # frozen: bf16 weights only
    assert planner.state_bytes(1000, False, 4) == {"weights": 500.0, "grads": 0.0, "optimizer": 0.0}
    # Llama-3-8B actor on one GPU: 8,030,261,248 x 16 B
    s = planner.state_bytes(8_030_261_248, True, 1)
    assert sum(s.values()) == 8_030_261_248 * 16


def test_scalar_head_params_by_hand(planner) -> None:
    s = kvm.MODEL_SHAPES["llama-3-8b"]
    # drop the 128256 x 4096 LM head, add a 4096 -> 1 linear with bias
    assert planner.scalar_head_params(s) == 8_030_261_248 - 128256 * 4096 + 4096 + 1
    # and the same from the shape: transformer_params without the untied head
    dense = mem.transformer_params(32, 4096, 32, 8, 128, 14336, 128256, tied_embeddings=True)["total"]
    assert planner.scalar_head_params(s) == dense + 4096 + 1


def test_kv_cache_bytes_gqa_by_hand(planner) -> None:
    s = kvm.MODEL_SHAPES["llama-3-8b"]
    # 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 B = 131072 B per token; 256 sequences of 2048 tokens
    assert planner.kv_cache_bytes(s, 256, 2048) == 131072 * 256 * 2048 == 64 * GIB
    assert planner.kv_cache_bytes(s, 256, 2048, tp=4) == 16 * GIB
    assert planner.kv_cache_bytes(s, 1, 10, tp=16) == 131072 * 10 / 8  # heads run out at tp = 8: replicated
    mha = kvm.MODEL_SHAPES["llama-2-7b"]  # 32 KV heads: 4x the cache per token
    assert kvm.shape_kv_bytes_per_token(mha) == 4 * 131072


def test_activation_and_logits_by_hand(planner) -> None:
    toy = kvm.ModelShape("toy", num_layers=3, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                         intermediate_size=16, vocab_size=10, num_params=1000, source="test")
    # full recompute keeps 2*s*b*h per layer; logits 4 B x b x s x V
    assert planner.train_activation_bytes(toy, 2, 5, "full", lm_head=False) == 3 * 2 * 5 * 2 * 8
    assert planner.logits_bytes(2, 5, 10) == 4 * 2 * 5 * 10
    assert planner.train_activation_bytes(toy, 2, 5, "full", lm_head=True) == 3 * 160 + 400
    # no recompute: s*b*h*(34 + 5*a*s/h) per layer (Korthikanti et al.)
    sbh = 5 * 2 * 8
    assert planner.train_activation_bytes(toy, 2, 5, "none", False) == pytest.approx(3 * sbh * (34 + 5 * 2 * 5 / 8))
    # forward working set: one layer without the attention scores, plus logits
    assert planner.forward_bytes(toy, 2, 5, lm_head=True) == pytest.approx(sbh * 34 + 400)


def test_colocated_phases_add_up(planner) -> None:
    args = settings(planner, rollout_batch=64, prompt_len=512, response_len=512, micro_batch=1)
    n = 8
    phases = planner.colocated_phases(args, n, engine_tp=2)
    actor = kvm.MODEL_SHAPES["llama-3-8b"]
    critic_n = planner.scalar_head_params(actor)
    # resident: actor + critic trained (16 B/param), reward + reference frozen (2 B/param), all over 8 GPUs
    resident = (actor.num_params * 16 + critic_n * 16 + critic_n * 2 + actor.num_params * 2) / n
    for p in planner.PHASES:
        states = phases[p]["weights"] + phases[p]["grads"] + phases[p]["optimizer"]
        assert states == pytest.approx(resident)
    assert phases["generation"]["engine weights"] == actor.num_params * 2 / 2
    assert phases["generation"]["KV cache"] == 131072 * (64 / 8) * 1024
    assert phases["training"]["activations"] == pytest.approx(
        planner.train_activation_bytes(actor, 1, 1024, "full", lm_head=True))


def test_recommendation_is_the_smallest_fit(planner) -> None:
    args = settings(planner)
    result = planner.plan(args)
    budget = 80 * GIB * 0.9
    # brute force over every GPU count, independently of the planner's search (one grid for both placements).
    # Co-located: every (n, tp) pair whose tp divides n (n / tp whole engines), each phase summed here
    def fits(k: int) -> bool:
        return any(max(sum(v.values()) for v in planner.colocated_phases(args, k, tp).values()) <= budget
                   for tp in (1, 2, 4, 8) if k % tp == 0)
    n = next(k for k in range(1, 4097) if fits(k))
    t = next(k for k in range(1, 4097) if planner.trainer_peak(args, k) <= budget)
    assert (result["colocated_gpus"], result["trainer_gpus"]) == (n, t)
    assert result["colocated_gpus"] % result["colocated_engine_tp"] == 0  # whole engines only
    pool = result["rollout"]
    assert pool["weights"] + pool["KV cache"] <= budget
    assert result["disaggregated_gpus"] == t + pool["gpus"]
    want = f"co-located on {n} GPUs" if n <= t + pool["gpus"] else \
        f"disaggregated: {t} trainer + {pool['gpus']} rollout GPUs = {t + pool['gpus']}"
    assert result["pick"] == want
    below = result["colocated_best_below"]  # the lesson's reason why fewer GPUs fail: the best smaller try overflows
    if n > 1:
        peak = max(sum(v.values()) for v in planner.colocated_phases(args, below["gpus"], below["engine_tp"]).values())
        assert below["gpus"] < n and below["gpus"] % below["engine_tp"] == 0
        assert below["peak_gib"] * GIB == pytest.approx(peak) and peak > budget


def test_why_the_best_smaller_colocated_count_is_that_count(planner) -> None:
    """The 70B lesson sentence: the best try below the co-located count is the largest smaller count that its TP
    divides, and every count between allows only smaller TPs; worked out here from divisibility alone."""
    args = settings(planner, actor="llama-3-70b", critic="llama-3-8b")
    result = planner.plan(args)
    n, below = result["colocated_gpus"], result["colocated_best_below"]
    tp = below["engine_tp"]
    assert below["gpus"] == max(k for k in range(1, n) if k % tp == 0)  # the largest smaller count TP divides
    widest = max(t for k in range(below["gpus"] + 1, n) for t in (1, 2, 4, 8) if k % t == 0)
    assert widest < tp
    assert below["reason"] == (f"TP {tp} needs a multiple of {tp} GPUs, and {below['gpus']} is the largest below {n}; "
                               f"{below['gpus'] + 1} to {n - 1} allow at most TP {widest}, "
                               f"so each GPU holds at least {tp // widest}x the engine weights")
    assert planner.below_reason(6, 5, 1) == "the count just below 6"  # nothing between: no divisibility story
    assert planner.below_reason(10, 4, 2) == "the count below 10 with the lowest peak"  # 8 between allows TP 8


def test_colocated_counts_table_from_divisibility(planner) -> None:
    """The 70B run's table of GPU counts from the best smaller try up to the co-located count, worked out here:
    a count that does not fit gets the largest TP in 1, 2, 4, 8 that divides it (the engine weights fall as 1/TP,
    while the KV cache per GPU does not depend on TP), the co-located count gets the smallest TP that fits, and only
    that last row fits."""
    args = settings(planner, actor="llama-3-70b", critic="llama-3-8b")
    result = planner.plan(args)
    n, below, budget = result["colocated_gpus"], result["colocated_best_below"], result["budget_bytes"]
    rows = result["colocated_near"]

    def peak(k: int, tp: int) -> float:
        return max(sum(v.values()) for v in planner.colocated_phases(args, k, tp).values())

    # the table starts at the smaller count whose best TP gives the lowest peak
    start = min(range(1, n), key=lambda k: min(peak(k, t) for t in (1, 2, 4, 8) if k % t == 0))
    assert [r["GPUs"] for r in rows] == list(range(start, n + 1))

    for r in rows[:-1]:
        tp = max(t for t in (1, 2, 4, 8) if r["GPUs"] % t == 0)
        assert (r["engine TP"], r["fits"]) == (tp, "no"), r
        assert r["peak GiB"] == pytest.approx(peak(r["GPUs"], tp) / GIB) and peak(r["GPUs"], tp) > budget
    tp = min(t for t in (1, 2, 4, 8) if n % t == 0 and peak(n, t) <= budget)
    assert (rows[-1]["engine TP"], rows[-1]["fits"]) == (tp, "yes") == (result["colocated_engine_tp"], "yes")
    assert rows[0]["peak GiB"] == pytest.approx(below["peak_gib"])
    # the printed table keeps three of these rows: the first, the lowest peak in between (every other count in
    # between peaks higher, as the lesson says), and the chosen count
    shown = planner.near_shown(rows)
    low = sorted(rows[1:-1], key=lambda r: r["peak GiB"])[0]
    assert shown == [rows[0], low, rows[-1]]
    # the lesson: even the best count in between peaks higher than the first row
    assert all(r["peak GiB"] > rows[0]["peak GiB"] for r in rows[1:-1])
    assert planner.near_shown(rows[:1] + rows[-1:]) == rows[:1] + rows[-1:]  # nothing in between (the 8B run)


def test_smaller_engine_tps_overflow_by_the_printed_amount(planner) -> None:
    """The lesson's Try next (--rollout-batch 1024 --recompute selective) picks engine TP 4 on 8 GPUs because TP 1
    and TP 2 overflow, TP 2 by a few MiB only, less than the rounding of the one-decimal table. The generation peak
    of each TP is summed here from the parameter counts, independently of colocated_phases."""
    args = settings(planner, rollout_batch=1024, recompute="selective")
    result = planner.plan(args)
    s, n, budget = kvm.MODEL_SHAPES["llama-3-8b"], 8, 80 * GIB * 0.9
    n_a = s.num_params
    n_c = n_a - s.vocab_size * s.hidden_size + s.hidden_size + 1  # critic and reward model: scalar head

    def gen(tp: int) -> float:  # ZeRO-3 shards (16 B trained, 2 B frozen) + engine bf16 / tp + this GPU's KV cache
        kv = 131072 * 2048 * (1024 * tp / n) / tp
        return (18 * n_a + 18 * n_c) / n + 2 * n_a / tp + kv

    assert (result["colocated_gpus"], result["colocated_engine_tp"]) == (n, 4)
    assert gen(4) <= budget < gen(2) < gen(1)
    tried = result["colocated_smaller_tps"]
    assert [t["engine_tp"] for t in tried] == [1, 2]
    for t in tried:
        want = gen(t["engine_tp"])
        assert t["phase"] == "generation"
        assert t["peak_gib"] * GIB == pytest.approx(want, rel=1e-12)
        assert sum(t["parts_gib"].values()) * GIB == pytest.approx(want, rel=1e-12)
        assert t["over_bytes"] == pytest.approx(want - budget, rel=1e-9)
    over2 = gen(2) - budget
    assert 2**20 < over2 < 0.05 * GIB  # a few MiB: one-decimal GiB columns cannot show it
    text = planner.tp_overflow_text(n, tried, budget)
    assert f"= {gen(2) / GIB:.3f} GiB, {over2 / 2**20:.0f} MiB over" in text
    assert f"= {gen(1) / GIB:.3f} GiB, {(gen(1) - budget) / GIB:.2f} GiB over" in text
    assert planner.plan(settings(planner))["colocated_smaller_tps"] == []  # the lesson's run: TP 1, nothing smaller
    # the lesson's Try next: keep back a little less (budget 72.08 GiB) and that smaller TP fits
    roomier = settings(planner, rollout_batch=1024, recompute="selective", reserve_fraction=0.099)
    assert 80 * GIB * (1 - 0.099) >= gen(2) and planner.plan(roomier)["colocated_engine_tp"] == 2


def test_scoring_working_set_is_one_layer_plus_the_logits(planner, smoke_cache) -> None:
    """Section 2's scoring formula, 34 s b h + 4 b s V bytes for the actor, by hand, against the JSON the lesson
    quotes and the scoring row's activations of the default run."""
    res = smoke_run(smoke_cache, CH14 / "memory_planner.py")["json"]["results"]
    s, b, seq = kvm.MODEL_SHAPES["llama-3-8b"], 2, 2048
    layer, logits = 34 * seq * b * s.hidden_size, 4 * b * seq * s.vocab_size
    assert res["scoring_gib"] == pytest.approx({"layer": layer / GIB, "logits": logits / GIB,
                                                "total": (layer + logits) / GIB}, rel=1e-12)
    row = planner.colocated_phases(settings(planner), res["colocated_gpus"])["scoring"]["activations"]
    assert row == pytest.approx(layer + logits, rel=1e-12)


def test_rollout_pool_tie_goes_to_the_smaller_tp(planner) -> None:
    """The lesson's 70B sentence: TP 4 (2 engines) and TP 8 (1 engine) both fill 8 rollout GPUs; TP 4 is kept."""
    args = settings(planner, actor="llama-3-70b", critic="llama-3-8b")
    budget, s = 80 * GIB * 0.9, kvm.MODEL_SHAPES["llama-3-70b"]
    seq = args.prompt_len + args.response_len

    def gpus(tp: int) -> int:  # by hand: engines whose free memory holds the batch's KV cache, times tp
        free = budget - s.num_params * 2 / tp
        return tp * math.ceil(args.rollout_batch / int(free // (327680 * seq / tp)))

    assert gpus(4) == gpus(8) == 8 and gpus(2) > 8
    pool = planner.rollout_pool(args, budget)
    assert (pool["tp"], pool["replicas"], pool["gpus"]) == (4, 2, 8)


def test_planner_script_runs_and_writes_json(tmp_path_factory) -> None:
    plots = tmp_path_factory.mktemp("plots")
    res = run_json(tmp_path_factory, CH14 / "memory_planner.py", "--actor", "llama-3-70b", "--plot-dir", plots)
    assert res["kv_total_bytes"] == 327680 * 256 * 2048  # Llama-3-70B: 2 x 80 x 8 x 128 x 2 B per token
    assert (plots / "memory_phases.png").exists() and (plots / "roles.png").exists()
    _check_roles(res["roles"], "llama-3-70b", "llama-3-8b")  # the critic and reward model stay 8B
    assert res["colocated_gpus"] % res["colocated_engine_tp"] == 0  # the engine's TP divides the GPU count
    tried = res["colocated_smaller_tps"]  # every smaller TP that divides the count, each over the budget
    assert [t["engine_tp"] for t in tried] == [t for t in (1, 2, 4, 8)
                                               if t < res["colocated_engine_tp"] and res["colocated_gpus"] % t == 0]
    assert all(t["over_bytes"] > 0 for t in tried)


def test_fp32_logits_against_checkpointed_layer_inputs_8b_and_70b(planner) -> None:
    """The lesson's sentence: per token, fp32 logits (4 B x vocab) exceed the checkpointed layer inputs (2 B x h per
    layer) for Llama-3-8B and fall below them for Llama-3-70B; the planner's own functions say the same."""
    for name, more in (("llama-3-8b", True), ("llama-3-70b", False)):
        s = kvm.MODEL_SHAPES[name]
        logits, inputs = 4 * s.vocab_size, 2 * s.hidden_size * s.num_layers
        assert (logits > inputs) is more, name
        with_head = planner.train_activation_bytes(s, 1, 1, "full", lm_head=True)
        without = planner.train_activation_bytes(s, 1, 1, "full", lm_head=False)
        assert (with_head - without > without) is more, name


def _role_bytes_from_real_models(actor: str, critic: str) -> dict[str, dict[str, int]]:
    """Each role's bytes counted from the parameters of the real architecture, built by Hugging Face transformers
    on the meta device (no memory): LlamaForCausalLM for actor and reference, LlamaModel plus a hidden -> 1 linear
    (with bias) for critic and reward model. Sum of p.numel() times the element size of each dtype: bf16 weights and
    gradients, fp32 master weights and Adam's two fp32 moments for the trained two; bf16 weights alone otherwise."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    def config(name: str) -> LlamaConfig:
        s = kvm.MODEL_SHAPES[name]
        return LlamaConfig(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                           num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
                           num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim, tie_word_embeddings=False)

    with torch.device("meta"):
        lm = LlamaForCausalLM(config(actor))
        trunk, head = LlamaModel(config(critic)), torch.nn.Linear(config(critic).hidden_size, 1)
    n_lm = sum(p.numel() for p in lm.parameters())
    n_scalar = sum(p.numel() for p in trunk.parameters()) + sum(p.numel() for p in head.parameters())
    bf16, fp32 = (torch.empty(0, dtype=d).element_size() for d in (torch.bfloat16, torch.float32))
    trained = {"weights": bf16, "grads": bf16, "optimizer": 3 * fp32}
    frozen = {"weights": bf16, "grads": 0, "optimizer": 0}
    return {role: {"params": n, **{k: n * b for k, b in per.items()}}
            for role, n, per in (("actor", n_lm, trained), ("critic", n_scalar, trained),
                                 ("reward", n_scalar, frozen), ("reference", n_lm, frozen))}


def _check_roles(drawn: dict, actor: str, critic: str) -> None:
    want = _role_bytes_from_real_models(actor, critic)
    assert list(drawn) == list(want)
    for role, w in want.items():
        got = drawn[role]
        assert got["params"] == w["params"], role
        for part in ("weights", "grads", "optimizer"):
            assert got[part] == pytest.approx(w[part], rel=1e-12), (role, part)


def test_roles_picture_against_parameters_of_the_real_models(smoke_cache) -> None:
    """roles.png of the default run (Llama-3-8B in all four roles): each bar's weights, gradients and optimizer
    state against bytes counted from the real architecture's parameters (transformers on the meta device)."""
    proc = smoke_run(smoke_cache, CH14 / "memory_planner.py")
    assert proc["code"] == 0, proc["stderr"][-2000:]
    # the rollout line's sizes are per GPU (weights / tp, KV / tp), and it says so, as the lesson does
    assert "GiB KV per GPU)" in proc["stdout"] and "GiB KV each" not in proc["stdout"]
    _check_roles(proc["json"]["results"]["roles"], "llama-3-8b", "llama-3-8b")


def test_fewer_gpus_header_names_a_middle_row_only_when_one_exists(smoke_cache) -> None:
    """The heading of the table under 'Fewer GPUs do not fit' promises a middle row only when some GPU count lies
    strictly between the best try below and the chosen count (the 8B run has none: 5 and 6)."""
    proc = smoke_run(smoke_cache, CH14 / "memory_planner.py")
    gpus = [r["GPUs"] for r in proc["json"]["results"]["colocated_near"]]
    has_middle = gpus[-1] - gpus[0] > 1
    assert ("the count between with the lowest peak" in proc["stdout"]) == has_middle
    assert ("That try and the chosen count" in proc["stdout"]) == (not has_middle)


# ------------------------------------------------------------------------------------------ placements
@pytest.fixture(scope="module")
def placement_json(smoke_cache) -> dict:
    """placement.py --smoke's JSON: the smoke test's own run (conftest.smoke_run), not a second one."""
    proc = smoke_run(smoke_cache, CH14 / "placement.py")
    assert proc["code"] == 0, proc["stderr"][-3000:]
    return proc["json"]


@pytest.mark.timeout(300)
def test_colocated_equals_disaggregated_and_one_process(placement_json: dict) -> None:
    """The oracle: one process runs the same shards and micro-batches with chapter 13's functions."""
    from mlsys import rlhf

    res, s = placement_json["results"], placement_json["settings"]
    assert res["weights_equal"] is True
    co, dis = res["colocated"]["stats"], res["disaggregated"]["stats"]
    assert [x["reward"] for x in co] == [x["reward"] for x in dis]

    mod = load_script(CH14 / "placement.py")
    args = mod.Settings(**{k: v for k, v in s.items() if k in mod.Settings.__dataclass_fields__})
    torch.set_num_threads(1)  # as each rank ran
    models, opts, kl_ctl, engine, cfg = mod.setup("all", args.seed)
    for it in range(args.iterations):
        batch = mod.merge([mod.generate_shard(engine, args, it, sh) for sh in range(args.shards)])
        extras = [mod.score_micro_batch(models, batch, args, m) for m in range(args.shards)]
        stats = mod.train_on(models, opts, kl_ctl, cfg, batch, extras)
        engine.load_weights(models.actor.state_dict())
        assert stats["reward"] == co[it]["reward"], f"iteration {it}"
        assert stats["kl"] == co[it]["kl"]
    del rlhf


def _spans(res: dict, placement: str, rank: int, phases: tuple[str, ...]) -> list[tuple[float, float]]:
    """A rank's spans of the given phases on the machine's one perf_counter clock (each rank's t0 added back)."""
    t0 = res[placement]["t0"][rank]
    return [(t0 + s, t0 + e) for p, s, e in res[placement]["timelines"][rank] if p in phases]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


@pytest.mark.timeout(300)
def test_async_is_one_step_off_policy_and_overlaps_while_sync_takes_turns(placement_json: dict) -> None:
    res = placement_json["results"]
    sync, asy = res["disaggregated"]["stats"], res["async"]["stats"]
    # iteration 0 is on-policy for both (nothing has been trained yet): same batch, same result
    assert asy[0]["reward"] == sync[0]["reward"]
    # sync: the engine sampled with the weights being trained (gap ~ float noise); async from iteration 1: stale
    assert all(abs(x["off_policy_gap"]) < 1e-4 for x in sync)
    assert all(abs(x["off_policy_gap"]) > 1e-4 for x in asy[1:])
    # The timelines, read across ranks on one clock. Synchronous: the trainer never scores or trains while a rollout
    # rank generates (they take turns), so its idle time covers their generation, and batch k is generated after
    # the trainer began sending step k-1's weights. Asynchronous: batch k is generated before (with the old
    # weights), so the trainer's broadcast of step k-1 can only start once that generation has ended.
    world = len(res["disaggregated"]["t0"])
    for placement in ("disaggregated", "async"):
        trainer = _spans(res, placement, 0, ("score", "train"))
        sends = _spans(res, placement, 0, ("weight sync",))
        for r in range(1, world):
            gen = _spans(res, placement, r, ("generate",))
            assert len(gen) == len(sends) + 1 and gen
            for (g_start, g_end), (s_start, _) in zip(gen[1:], sends):
                if placement == "async":
                    assert g_end <= s_start
                else:
                    assert g_start >= s_start
            if placement == "disaggregated":
                assert _overlap(trainer, gen) == 0
                assert res[placement]["ranks"][0]["idle"] >= sum(e - s for s, e in gen) - 0.01


@pytest.mark.timeout(300)
def test_each_rank_holds_the_models_its_role_needs(placement_json: dict) -> None:
    """Parameters per rank, against counts made here from the draft GPT's config: co-located ranks hold actor,
    critic, reward model, reference and the engine's own copy of the actor; the trainer the four models; a rollout
    rank only the engine's actor."""
    from mlsys.model import GPT
    from mlsys.weights import load_pretrained

    cfg = load_pretrained("draft").config
    gpt = sum(p.numel() for p in GPT(cfg).parameters())  # a fresh GPT of the same config; tied head counted once
    scalar = gpt + cfg.n_embd + 1  # critic and reward model: the GPT as trunk plus a hidden -> 1 linear head
    res = placement_json["results"]
    world = len(res["colocated"]["ranks"])
    assert [r["params held"] for r in res["colocated"]["ranks"]] == [3 * gpt + 2 * scalar] * world
    for placement in ("disaggregated", "async"):
        assert [r["params held"] for r in res[placement]["ranks"]] == [2 * gpt + 2 * scalar] + [gpt] * (world - 1)


@pytest.mark.timeout(300)
def test_placement_picture_roles_and_work_per_rank(placement_json: dict) -> None:
    """placement.png: which rank held which model and ran which shards, as the ranks reported it, against the
    placement worked out here from the world size W and the number of shards S alone: co-located, every rank holds
    the four models and an engine and runs shards s with s mod W == rank; disaggregated (and async), rank 0 holds
    the four models and scores every micro-batch, and rollout rank r holds only an engine and generates the shards
    with s mod (W - 1) == r - 1. Parameter counts from a fresh GPT of the draft config."""
    from mlsys.model import GPT
    from mlsys.weights import load_pretrained

    cfg = load_pretrained("draft").config
    gpt = sum(p.numel() for p in GPT(cfg).parameters())
    scalar = gpt + cfg.n_embd + 1
    four = {"actor": gpt, "critic": scalar, "reward_model": scalar, "reference": gpt}
    res, settings = placement_json["results"], placement_json["settings"]
    W, S = settings["world_size"], settings["shards"]
    assert res["colocated"]["placed"] == [{"params": 3 * gpt + 2 * scalar, "roles": {**four, "engine": gpt},
                                           "generated": [s for s in range(S) if s % W == r],
                                           "scored": [s for s in range(S) if s % W == r]} for r in range(W)]
    for placement in ("disaggregated", "async"):
        want = [{"params": 2 * gpt + 2 * scalar, "roles": four, "generated": [], "scored": list(range(S))}]
        want += [{"params": gpt, "roles": {"engine": gpt}, "generated": [s for s in range(S) if s % (W - 1) == r - 1],
                  "scored": []} for r in range(1, W)]
        assert res[placement]["placed"] == want, placement


@pytest.mark.timeout(300)
def test_versions_picture_lag_per_batch(placement_json: dict) -> None:
    """versions.png draws what rollout rank 1 recorded: which weights version (updates received) sampled each batch.
    The rule worked out here, counting batches from 1 as timeline.png does: sync samples batch k with w k-1, the
    weights after every update so far (lag 0); async samples batch k with w k-2 (lag 1 from batch 2 on, 0 for
    batch 1)."""
    res = placement_json["results"]
    n = placement_json["settings"]["iterations"]
    want = {"disaggregated": list(range(n)), "async": [0] + list(range(n - 1))}
    for name, versions in want.items():
        for rank, got in enumerate(res[name]["sampled_with"]):
            assert got == (versions if rank else None), (name, rank)
        assert res["versions_drawn"][name] == [{"batch": b, "version": v, "lag": b - 1 - v}
                                               for b, v in enumerate(versions, start=1)]
    assert {r["lag"] for r in res["versions_drawn"]["async"][1:]} == {1}
    assert {r["lag"] for r in res["versions_drawn"]["disaggregated"]} == {0}


@pytest.mark.timeout(120)
def test_default_response_length_fits_a_record() -> None:
    """At the default --max-tokens some responses of the first shard are whole, well-formed records (at 32 tokens
    every record was cut, so the placements were compared on a task with rule score 0 everywhere)."""
    from mlsys import reward_model

    mod = load_script(CH14 / "placement.py")
    args = mod.Settings()
    torch.set_num_threads(1)
    _, _, _, engine, _ = mod.setup("rollout", args.seed)
    batch = mod.generate_shard(engine, args, 0, 0)
    assert sum(reward_model.rule_score(t) > 0 for t in batch.texts) >= len(batch.texts) // 2, batch.texts


def test_mean_off_policy_gap_never_prints_negative_zero() -> None:
    """A synchronous run's gap is float noise of either sign; the table prints it to 3 decimals, as 0.000."""
    mod = load_script(CH14 / "placement.py")
    for noise in (-1e-9, -0.0, -4e-4, 0.0, 3e-9):
        assert format(mod.shown_gap(noise), ".3f") == "0.000", noise
    assert format(mod.shown_gap(-6e-4), ".3f") == "-0.001"  # a real negative value keeps its sign
    assert format(mod.shown_gap(0.0051), ".3f") == "0.005"


@pytest.mark.timeout(300)
def test_reading_values_the_lesson_quotes(placement_json: dict) -> None:
    """The values section 3 quotes, recomputed here from the run's own tables: the printed gaps (never -0.0), each
    co-located rank's train time over the trainer's, each rank's tail after its last event, and the load."""
    res = placement_json["results"]
    for placement in ("colocated", "disaggregated", "async"):
        s = res[placement]
        mean = sum(x["off_policy_gap"] for x in s["stats"]) / len(s["stats"])
        shown = s["mean_off_policy_gap_shown"]
        assert shown == pytest.approx(round(mean, 3), abs=1e-12)
        assert not (shown == 0 and math.copysign(1.0, shown) < 0), f"{placement}: a negative zero"
        wall = max(end for events in s["timelines"] for _, _, end in events)
        assert s["tail_s"] == pytest.approx([wall - max(e for _, _, e in events) for events in s["timelines"]])
    trainer = res["disaggregated"]["ranks"][0]["train"]
    assert res["colocated"]["train_vs_trainer"] == pytest.approx([r["train"] / trainer
                                                                 for r in res["colocated"]["ranks"]])
    assert res["machine"]["cores"] >= 1 and res["machine"]["load_avg"] >= 0
