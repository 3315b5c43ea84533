"""mlsys.memory: every formula against a hand-computed case."""

from __future__ import annotations

import pytest

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
    assert memory.dp_comm_bytes(1000, 4, 1) == 1500  # 2 * 3/4 * 1000
    assert memory.dp_comm_bytes(1000, 4, 3) == 2250  # 3 * 3/4 * 1000
    assert memory.dp_comm_bytes(1000, 1, 0) == 0
    # b=1 s=2 h=4 bf16 -> 16 B per activation; 4 all-reduces * 2 * 1/2 = 4 per layer and micro-batch; 3 layers, m=2
    assert memory.tp_comm_bytes(1, 2, 4, 2, 3, 2) == 4 * 16 * 3 * 2
    assert memory.tp_comm_bytes(1, 2, 4, 1, 3, 2) == 0
    assert memory.pp_comm_bytes(1, 2, 4, 2, 3) == 2 * 16 * 3  # one activation + one gradient per micro-batch
    assert memory.pp_comm_bytes(1, 2, 4, 1, 3) == 0
    # 4 all-to-alls * 3/4 leaves * (1*2 tokens * k=2 * cf 1.5 * h 4 * 2 B = 48 B) * 3 layers * 2 micro-batches
    assert memory.ep_comm_bytes(1, 2, 4, 2, 4, 3, 2, 1.5) == pytest.approx(4 * 0.75 * 48 * 3 * 2)  # 864


def test_flops_and_step_time():
    assert memory.train_flops(10, 100) == 6000
    t = memory.step_time_estimate(1000, 2, 100, 0.5, pp=2, num_micro=4, comm={"tp": (100, 50), "dp": (0, 1)})
    # compute 1000 / (2 * 100 * 0.5) = 10, bubble 10 * (4 + 1)/4 - 10 = 2.5, tp 100/50 = 2
    assert t == pytest.approx({"compute": 10, "bubble": 2.5, "tp": 2, "dp": 0, "total": 14.5})


@pytest.mark.parametrize("call", [
    lambda: memory.activation_bytes_per_layer(0, 1, 4, 2),
    lambda: memory.activation_bytes_per_layer(2, 1, 4, 2, recompute="some"),
    lambda: memory.in_flight_micro_batches(0, 1),
    lambda: memory.kv_cache_bytes_per_gpu(1000, 1, 1, 0, 1, 1),
    lambda: memory.dp_comm_bytes(10, 0, 0),
    lambda: memory.step_time_estimate(1, 1, 0, 0.5, 1, 1, {}),
    lambda: memory.step_time_estimate(1, 1, 1, 0.0, 1, 1, {}),
    lambda: memory.step_time_estimate(1, 1, 1, 0.5, 1, 1, {"dp": (10, 0)}),
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


def test_zero_traffic_repeats_per_micro_batch_where_the_state_is_sharded() -> None:
    """Count the collectives one step runs, micro-batch by micro-batch, and compare with dp_comm_bytes."""
    G, d, r = 1000.0, 4, 3 / 4
    for m in (1, 4, 64):
        steps = {0: ["all-reduce"], 1: ["reduce-scatter", "all-gather"],
                 2: ["reduce-scatter"] * m + ["all-gather"],
                 3: ["all-gather", "all-gather", "reduce-scatter"] * m}  # per micro-batch: fwd, bwd gathers + RS
        cost = {"all-reduce": 2 * r * G, "reduce-scatter": r * G, "all-gather": r * G}
        for stage, calls in steps.items():
            assert memory.dp_comm_bytes(G, d, stage, m) == pytest.approx(sum(cost[c] for c in calls))


# ----------------------------------------------------------------------------------------------- independent references
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5])
def test_worst_stage_params_match_a_split_hf_llama(pp):
    """Cut a random-init transformers Llama by modules (embedding + first layers | ... | last layers + norm + head)
    and count each stage's real parameters; the heaviest must equal worst_stage_dense_params."""
    transformers = pytest.importorskip("transformers")

    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=40, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    count = lambda mod: sum(p.numel() for p in mod.parameters())
    total = count(model)
    assert total == memory.transformer_params(6, 16, 4, 2, 4, 40, 97)["total"]  # same shape, two counters
    sizes = [6 // pp + (s < 6 % pp) for s in range(pp)]  # split_gpt's even split: the first stages take the rest
    cuts = [sum(sizes[:s]) for s in range(pp + 1)]
    layers = model.model.layers
    stages = [sum(count(layers[i]) for i in range(cuts[s], cuts[s + 1])) for s in range(pp)]
    stages[0] += count(model.model.embed_tokens)
    stages[-1] += count(model.model.norm) + count(model.lm_head)
    assert max(stages) == pytest.approx(memory.worst_stage_dense_params(total, 6, pp, 97, 16))


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
