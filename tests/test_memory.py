"""mlsys.memory: every formula against a hand-computed case, and the ones a table could re-encode (ZeRO's traffic,
the pipeline's step time) against a simulation of what the ranks do."""

from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import simulate_1f1b
from mlsys import memory


@pytest.mark.parametrize(
    "stage, expected",
    [
        # 1000 params, 4 ranks, mixed: 2000 B params, 2000 B grads, 12000 B optimizer
        (0, {"params": 2000, "grads": 2000, "optimizer": 12000, "total": 16000}),
        (1, {"params": 2000, "grads": 2000, "optimizer": 3000, "total": 7000}),
        (2, {"params": 2000, "grads": 500, "optimizer": 3000, "total": 5500}),
        (3, {"params": 500, "grads": 500, "optimizer": 3000, "total": 4000}),
    ],
)
def test_zero_bytes_per_rank_mixed(stage, expected):
    assert memory.zero_bytes_per_rank(1000, 4, stage) == pytest.approx(expected)


def test_zero_bytes_per_rank_fp32_and_single_rank():
    # fp32: 4 + 4 + 8 = 16 B/param; stage 3 over 8 ranks -> 2 B/param
    assert memory.zero_bytes_per_rank(800, 8, 3, "fp32") == pytest.approx(
        {"params": 400, "grads": 400, "optimizer": 800, "total": 1600})
    # one rank: every stage is plain training, 16 B/param
    for stage in range(4):
        assert memory.zero_bytes_per_rank(10, 1, stage)["total"] == 160


@pytest.mark.parametrize("kwargs", [dict(stage=4), dict(stage=-1), dict(world_size=0), dict(precision="fp8")])
def test_zero_bytes_per_rank_rejects(kwargs):
    args = dict(num_params=10, world_size=2, stage=1, precision="mixed") | kwargs
    with pytest.raises(ValueError):
        memory.zero_bytes_per_rank(**args)


# ----------------------------------------------------------------------------------------------- planner formulas
def test_transformer_params_hand_case_and_published_counts():
    # 1 layer, h=4, 2 heads of 2 (1 KV head), MLP 8, vocab 10:
    # attention 2*4*4 + 2*4*2 = 48, gated MLP 3*4*8 = 96, norms 8 -> 152; embeddings 2*10*4 = 80; final norm 4
    assert memory.transformer_params(1, 4, 2, 1, 2, 8, 10) == {"dense": 236, "expert": 0, "total": 236}
    # two experts: router 4*2 = 8 joins the dense part (48 + 8 + 8 = 64), the MLPs (2 * 96) are expert parameters
    assert memory.transformer_params(1, 4, 2, 1, 2, 8, 10, num_experts=2) == {
        "dense": 64 + 80 + 4, "expert": 192, "total": 340}
    assert memory.transformer_params(1, 4, 2, 2, 2, 16, 10, gated_mlp=False, tied_embeddings=True)["total"] == (
        2 * 4 * 4 + 2 * 4 * 4 + 2 * 4 * 16 + 8 + 40 + 4)
    # published totals: Llama-3-8B and Mixtral-8x7B (config.json shapes)
    assert memory.transformer_params(32, 4096, 32, 8, 128, 14336, 128256)["total"] == 8_030_261_248
    assert memory.transformer_params(32, 4096, 32, 8, 128, 14336, 32000, num_experts=8)["total"] == 46_702_792_704


def test_activation_bytes_per_layer_korthikanti_table2():
    # s=2, b=1, h=4, a=2: sbh = 8, 5as/h = 5
    kw = dict(seq=2, micro_batch=1, hidden=4, num_heads=2)
    assert memory.activation_bytes_per_layer(**kw) == 8 * (34 + 5)  # 312
    assert memory.activation_bytes_per_layer(**kw, tp=2) == 8 * (10 + 12 + 2.5)  # 196
    assert memory.activation_bytes_per_layer(**kw, tp=2, sequence_parallel=True) == 8 / 2 * (34 + 5)  # 156
    assert memory.activation_bytes_per_layer(**kw, tp=2, recompute="selective") == 8 * 22  # 176
    assert memory.activation_bytes_per_layer(**kw, tp=2, sequence_parallel=True, recompute="selective") == 4 * 34
    assert memory.activation_bytes_per_layer(**kw, tp=2, recompute="full") == 16
    # with SP the kept layer input is the sequence-sharded one: 2sbh / t
    assert memory.activation_bytes_per_layer(**kw, tp=2, sequence_parallel=True, recompute="full") == 8
    # MoE, k * c = 2.5 copies of the MLP's input (2 sbh) and hidden (16 sbh / t) at t = 2, selective:
    # 10 + 24/2 + (2 + 8) * 1.5 extra = 37 per sbh
    assert memory.activation_bytes_per_layer(**kw, tp=2, recompute="selective", mlp_copies=2.5) == 8 * 37
    # t = 1: with and without sequence parallelism agree
    assert memory.activation_bytes_per_layer(**kw, sequence_parallel=True) == memory.activation_bytes_per_layer(**kw)


def test_pipeline_activations_and_kv():
    assert memory.in_flight_micro_batches(4, 8) == 4  # 1F1B: p
    assert memory.in_flight_micro_batches(4, 2) == 2  # fewer micro-batches than stages
    assert memory.in_flight_micro_batches(4, 8, "gpipe") == 8
    assert memory.activation_bytes_per_gpu(100, 10, 4, 8) == 100 * 3 * 4  # ceil(10/4) layers x 4 in flight
    # 1000 B/token, 2 x 10 tokens, tp 4 over 2 KV heads (replicated twice), pp 2: 20000 / (2 * 2)
    assert memory.kv_cache_bytes_per_gpu(1000, 2, 10, 4, 2, 2) == 5000


def test_model_state_bytes_per_gpu():
    # dense 1200 over tp 2 -> 600 params, ZeRO-1 over dp 4: 1200 + 1200 + 600*12/4 = 1800
    # experts 800 over tp 2 * ep 2 -> 200 params, ZeRO-1 over dp/ep = 2: 400 + 400 + 200*12/2 = 1200
    got = memory.model_state_bytes_per_gpu(1200, 800, dp=4, tp=2, pp=1, ep=2, zero_stage=1)
    assert got == pytest.approx({"params": 1600, "grads": 1600, "optimizer": 3000, "total": 6200})
    with pytest.raises(ValueError):
        memory.model_state_bytes_per_gpu(1200, 800, dp=3, tp=1, pp=1, ep=2, zero_stage=1)  # ep must divide dp


def test_comm_bytes_hand_cases():
    assert memory.dp_comm_bytes(1000, 1, 0) == 0
    # b=1 s=2 h=4 bf16 -> 16 B per activation; 4 all-reduces * 2 * 1/2 = 4 per layer and micro-batch; 3 layers, m=2
    assert memory.tp_comm_bytes(1, 2, 4, 2, 3, 2) == 4 * 16 * 3 * 2
    assert memory.tp_comm_bytes(1, 2, 4, 1, 3, 2) == 0
    assert memory.pp_comm_bytes(1, 2, 4, 2, 3) == 2 * 16 * 3  # one activation + one gradient per micro-batch
    assert memory.pp_comm_bytes(1, 2, 4, 1, 3) == 0
    # sequence parallelism: each of the t = 2 TP ranks sends its half of the sequence
    assert memory.pp_comm_bytes(1, 2, 4, 2, 3, tp=2, sequence_parallel=True) == 16 * 3
    assert memory.pp_comm_bytes(1, 2, 4, 2, 3, tp=2) == 2 * 16 * 3
    # 4 all-to-alls * 3/4 leaves * (1*2 tokens * k=2 * cf 1.5 * h 4 * 2 B = 48 B) * 3 layers * 2 micro-batches
    assert memory.ep_comm_bytes(1, 2, 4, 2, 4, 3, 2, 1.5) == pytest.approx(4 * 0.75 * 48 * 3 * 2)  # 864


def test_flops_and_stage_flops():
    assert memory.train_flops(10, 100) == 6000
    # 10 layers over 4 stages: 3, 3, 2, 2 (the first L % p take one more); embedding first, head last
    assert memory.stage_flops(1.0, 10, 4, head_flops=0.5, embed_flops=0.25) == [3.25, 3, 2, 2.5]
    assert memory.stage_flops(1.0, 10, 1, head_flops=0.5, embed_flops=0.25) == [10.75]
    with pytest.raises(ValueError):
        memory.stage_flops(1.0, 3, 4)


# ----------------------------------------------------------------------------------------------- the 1F1B oracle
def test_simulator_on_equal_stages_is_the_textbook_bubble():
    for p, m in ((1, 1), (4, 8), (3, 2), (8, 3)):
        assert simulate_1f1b([1.0] * p, [2.0] * p, m) == pytest.approx(3.0 * (m + p - 1))


@pytest.mark.parametrize("seed", range(6))
def test_step_time_is_the_simulated_1f1b_paced_by_the_slowest_stage(seed):
    """step_time_estimate's compute + bubble + imbalance against the event clock, for random stage costs: exact when
    the heaviest stage is the last (the planner's case: the output head) or all are equal, an upper bound otherwise."""
    rng = random.Random(seed)
    p, m = rng.randint(1, 6), rng.randint(1, 12)
    for heavy_last in (True, False):
        work = [rng.choice([1.0, 1.0, 1.3, 0.7, 2.0]) for _ in range(p)]
        if heavy_last:
            work = [1.0] * (p - 1) + [rng.uniform(1.0, 2.5)]
        flops, gpus, peak, mfu = 1e15 * sum(work), 4 * p, 1e12, 0.5
        t = memory.step_time_estimate(flops, gpus, peak, mfu, p, m, {}, [w / sum(work) for w in work])
        # stage s's share of the flops, spread over its gpus / p GPUs and m micro-batches, split 1:2 between the
        # forward and the backward
        per_micro = [flops * w / sum(work) / m / (gpus / p * peak * mfu) for w in work]
        sim = simulate_1f1b([x / 3 for x in per_micro], [2 * x / 3 for x in per_micro], m)
        pipeline = t["compute"] + t["bubble"] + t["imbalance"]
        assert t["total"] == pytest.approx(pipeline)
        if heavy_last:
            assert pipeline == pytest.approx(sim, rel=1e-12)
        else:
            assert pipeline >= sim * (1 - 1e-12)
        assert t["compute"] == pytest.approx(flops / (gpus * peak * mfu))


# ----------------------------------------------------------------------------------------------- the ZeRO oracle
def ring(bufs: list[np.ndarray], gather: bool) -> tuple[list[np.ndarray], float]:
    """A ring reduce-scatter (or all-gather) over d ranks, chunk by chunk: d - 1 steps, each rank passes one chunk to
    the next. bufs are full-size (reduce-scatter) or each rank's shard (all-gather). Returns the result per rank
    (its reduced shard, or the full gathered buffer) and the bytes rank 0 sent."""
    d = len(bufs)
    if gather:
        chunks = [[bufs[r] if c == r else None for c in range(d)] for r in range(d)]
    else:
        chunks = [list(np.split(b.copy(), d)) for b in bufs]
    sent = 0.0
    for step in range(d - 1):
        # rank r sends chunk (r - step) (gather) or (r - step - 1) (reduce) to rank r + 1
        moves = [(r, (r - step - (0 if gather else 1)) % d) for r in range(d)]
        payload = [chunks[r][c].copy() for r, c in moves]
        for (r, c), data in zip(moves, payload):
            dst = (r + 1) % d
            chunks[dst][c] = data if gather else chunks[dst][c] + data
        sent += payload[0].nbytes
    if gather:
        return [np.concatenate(ch) for ch in chunks], sent
    return [chunks[r][r] for r in range(d)], sent


def zero_step_bytes(stage: int, d: int, m: int, n: int, rng: np.random.Generator) -> float:
    """One training step of m micro-batches on d data-parallel ranks, driven by what each rank may hold: weights
    whole only if stage < 3 (else gathered for every forward and again for every backward, then dropped), a whole
    gradient only if stage < 2 (else reduce-scattered as soon as a micro-batch's backward produces it), and the
    optimizer state for its 1/d shard only if stage >= 1 (that shard's updated weights must then reach everyone).
    The collectives follow from those rules, run as rings on numpy arrays; returns the bytes rank 0 sent, after
    checking every rank's reduced gradient is the sum of all micro-batch gradients."""
    sent, grads = 0.0, []
    acc: list[np.ndarray] = [np.zeros(n if stage < 2 else n // d, np.float16) for _ in range(d)]
    for _ in range(m):
        for _pass in ("forward", "backward"):
            if stage == 3:  # the weights are sharded: gather them for this pass (the shards are the same each time)
                _, b = ring([np.ones(n // d, np.float16)] * d, gather=True)
                sent += b
        g = [rng.integers(-3, 4, n).astype(np.float16) for _ in range(d)]
        grads.append(g)
        if stage >= 2:  # no room for a whole gradient: reduce it to the owner now
            shards, b = ring(g, gather=False)
            acc, sent = [a + s for a, s in zip(acc, shards)], sent + b
        else:
            acc = [a + x for a, x in zip(acc, g)]
    total = sum(sum(g) for g in grads)
    if stage == 0:  # everyone updates everything: the whole reduced gradient everywhere (an all-reduce)
        shards, b1 = ring(acc, gather=False)
        acc, b2 = ring(shards, gather=True)
        sent += b1 + b2
        assert all(np.array_equal(a, total) for a in acc)
        return sent
    if stage == 1:  # the optimizer owns a shard: reduce the gradient to it
        acc, b = ring(acc, gather=False)
        sent += b
    assert all(np.array_equal(a, np.split(total, d)[r]) for r, a in enumerate(acc))
    if stage in (1, 2):  # updated shards must reach every rank's whole weights before the next forward
        _, b = ring([np.ones(n // d, np.float16)] * d, gather=True)
        sent += b
    return sent


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_traffic_matches_a_simulated_step(stage):
    rng = np.random.default_rng(stage)
    for d, m in ((4, 1), (4, 3), (2, 5), (8, 2)):
        n = 8 * d
        assert memory.dp_comm_bytes(2.0 * n, d, stage, m) == pytest.approx(zero_step_bytes(stage, d, m, n, rng))


@pytest.mark.parametrize("call", [
    lambda: memory.activation_bytes_per_layer(0, 1, 4, 2),
    lambda: memory.activation_bytes_per_layer(2, 1, 4, 2, recompute="some"),
    lambda: memory.in_flight_micro_batches(0, 1),
    lambda: memory.kv_cache_bytes_per_gpu(1000, 1, 1, 0, 1, 1),
    lambda: memory.dp_comm_bytes(10, 0, 0),
    lambda: memory.step_time_estimate(1, 1, 0, 0.5, 1, 1, {}),
    lambda: memory.step_time_estimate(1, 1, 1, 0.0, 1, 1, {}),
    lambda: memory.step_time_estimate(1, 1, 1, 0.5, 1, 1, {"dp": (10, 0)}),
    lambda: memory.step_time_estimate(1, 2, 1, 0.5, 2, 1, {}, [0.5, 0.6]),
    lambda: memory.step_time_estimate(1, 2, 1, 0.5, 2, 1, {}, [1.0]),
    lambda: memory.transformer_params(0, 4, 2, 1, 2, 8, 10),
])
def test_formulas_reject_bad_inputs(call):
    with pytest.raises(ValueError):
        call()


@pytest.mark.timeout(120)
def test_tp_traffic_with_sequence_parallelism_matches_the_bytes_chapter6_measures(tmp_path_factory) -> None:
    """The planner's TP formula against real collectives: sequence_parallel.py counts the bytes its ranks send in
    the forward and the backward with and without SP; the ratio SP / TP per step must be the formula's."""
    from conftest import run_json, scripts_dir

    measured = run_json(tmp_path_factory, scripts_dir(6) / "sequence_parallel.py", "--smoke")["tp"]["2"]
    sp = measured["SP_fwd_sent_B"] + measured["SP_bwd_sent_B"]
    tp = measured["TP_fwd_sent_B"] + measured["TP_bwd_sent_B"]
    with_sp = memory.tp_comm_bytes(1, 8, 16, 2, 1, 1, sequence_parallel=True)
    without = memory.tp_comm_bytes(1, 8, 16, 2, 1, 1)
    assert with_sp / without == pytest.approx(sp / tp)
    # full recomputation replays the forward's two all-reduces inside the backward
    assert memory.tp_comm_bytes(1, 8, 16, 2, 1, 1, recompute="full") / without == pytest.approx(6 / 4)
    assert memory.train_flops(10, 100, recompute="full") / memory.train_flops(10, 100) == pytest.approx(8 / 6)


# ----------------------------------------------------------------------------------------------- independent references
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("vocab", [97, 4001])  # 4001: the head outweighs a layer, so the last stage can be heaviest
def test_worst_stage_params_match_a_split_hf_llama(pp, tied, vocab):
    """Cut a random-init transformers Llama by modules (embedding + first layers | ... | last layers + norm + head)
    and count each stage's real parameters; the heaviest must equal worst_stage_dense_params. A tied head is
    counted once in the whole model, but the last stage of a split holds its own copy."""
    transformers = pytest.importorskip("transformers")

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=40, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg)
    count = lambda mod: sum(p.numel() for p in mod.parameters())
    total = count(model)  # parameters() yields a tied matrix once
    assert total == memory.transformer_params(6, 16, 4, 2, 4, 40, vocab, tied_embeddings=tied)["total"]
    sizes = [6 // pp + (s < 6 % pp) for s in range(pp)]  # split_gpt's even split: the first stages take the rest
    cuts = [sum(sizes[:s]) for s in range(pp + 1)]
    layers = model.model.layers
    stages = [sum(count(layers[i]) for i in range(cuts[s], cuts[s + 1])) for s in range(pp)]
    stages[0] += count(model.model.embed_tokens)
    if pp == 1:
        stages[-1] += count(model.model.norm) + (0 if tied else count(model.lm_head))
    else:
        stages[-1] += count(model.model.norm) + model.lm_head.weight.numel()  # its own copy even when tied
    assert max(stages) == pytest.approx(memory.worst_stage_dense_params(total, 6, pp, vocab, 16, tied_embeddings=tied))


def test_logits_bytes_match_what_cross_entropy_saves():
    """torch's cross-entropy on fp32 logits keeps the (b*s, V) log-probabilities for its backward: count the bytes
    autograd saves (saved_tensors_hooks) and compare with logits_bytes."""
    import torch

    b, s, vocab = 2, 8, 50
    logits = torch.randn(b * s, vocab, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.functional.cross_entropy(logits, torch.randint(vocab, (b * s,)))
    floats = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
              if t.is_floating_point() and t.numel() > 1  # (nll_loss also keeps a scalar total weight)
              and t.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr()}
    assert sum(floats.values()) == memory.logits_bytes(b, s, vocab)
    assert memory.logits_bytes(1, 4096, 128256, tp=1) / 2**30 == pytest.approx(1.957, abs=1e-3)  # ~2 GiB


def test_pipeline_activation_peak_first_or_last_stage():
    # 10 bytes per layer, 8 layers, p = 4: the first stage holds 4 micro-batches of 2 layers = 80;
    # the last holds one micro-batch (20) plus its logits
    assert memory.pipeline_activation_peak(10, 8, 4, 8, logits=30) == 80
    assert memory.pipeline_activation_peak(10, 8, 4, 8, logits=100) == 120
    assert memory.pipeline_activation_peak(10, 8, 1, 8, logits=30) == 80 + 30  # one stage holds both
    assert memory.pipeline_activation_peak(10, 8, 4, 8, logits=30, schedule="gpipe") == (20 + 30) * 8
