"""mlsys.memory, the cases tests/test_memory.py leaves open (issue 29: the mutants that survived it).

Every expected number is counted by hand in the comment beside it, from the quantity's meaning (bytes kept, bytes
sent, flops done), not from the module's formula; the error tests check that each rejected input is named in its
message, since the planner's users read those messages to find which flag was wrong.
"""

from __future__ import annotations

import pytest

from mlsys import memory

INT_MSG = "must be an integer >= 1"
POS_MSG = "must be a finite number > 0"


# ----------------------------------------------------------------------------------------------- the validators
@pytest.mark.parametrize("bad", [0, -3, True, 1.0, "2"])
def test_pos_int_rejects_what_is_not_a_positive_int(bad):
    with pytest.raises(ValueError, match=rf"^width {INT_MSG}, got {bad!r}$".replace("(", r"\(")):
        memory._pos_int("width", bad)


@pytest.mark.parametrize("ok", [1, 2, 7])
def test_pos_int_accepts_positive_ints(ok):
    assert memory._pos_int("width", ok) == ok


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, True, "2", float("inf"), float("nan")])
def test_pos_rejects_what_is_not_a_finite_positive_number(bad):
    with pytest.raises(ValueError, match=rf"^rate {POS_MSG}, got "):
        memory._pos("rate", bad)


@pytest.mark.parametrize("ok", [0.5, 1, 3, 1e300])
def test_pos_accepts_finite_positive_numbers(ok):
    assert memory._pos("rate", ok) == ok


# ----------------------------------------------------------------------------------------------- ZeRO
def test_zero_bytes_of_no_parameters_is_zero():
    assert memory.zero_bytes_per_rank(0, 4, 3) == {"params": 0, "grads": 0, "optimizer": 0, "total": 0}
    assert memory.zero_bytes_per_rank(1, 1, 0)["total"] == 16  # one parameter, mixed precision: 2 + 2 + 12


@pytest.mark.parametrize("kwargs, message", [
    (dict(stage=4), r"^ZeRO stage must be 0, 1, 2 or 3, got 4$"),
    (dict(world_size=0), r"^world_size must be an integer >= 1, got 0$"),
    (dict(precision="fp8"), r"^precision must be one of \['fp32', 'mixed'\], got 'fp8'$"),
    (dict(num_params=-1), r"^num_params must be >= 0, got -1$"),
])
def test_zero_bytes_per_rank_says_what_is_wrong(kwargs, message):
    args = dict(num_params=10, world_size=2, stage=1, precision="mixed") | kwargs
    with pytest.raises(ValueError, match=message):
        memory.zero_bytes_per_rank(**args)


# ----------------------------------------------------------------------------------------------- activations
# s=8, b=2, h=16, a=4: s*b*h = 256 values per (b, s, h) tensor, a*s*s*b = 512 attention-score values
KW = dict(seq=8, micro_batch=2, hidden=16, num_heads=4)


def test_activations_with_a_micro_batch_of_two_korthikanti_table2():
    # paper, t=1: sbh * (34 + 5as/h) = 256 * (34 + 10) = 11264
    assert memory.activation_bytes_per_layer(**KW) == 11264
    # t=2: sbh * (10 + 24/2 + 5as/(2h)) = 256 * 27; with sequence parallelism sbh/2 * 44
    assert memory.activation_bytes_per_layer(**KW, tp=2) == 6912
    assert memory.activation_bytes_per_layer(**KW, tp=2, sequence_parallel=True) == 5632


def test_activations_without_dropout_counted_item_by_item():
    # bf16, t=2, no dropout masks and no dropped-out copies:
    #   whole: 2 LayerNorm inputs + QKV input + MLP input = 4 * 256 values * 2 B          = 2048
    #   split: q, k, v, attention output, MLP hidden before and after GELU (4h each):
    #          (4 + 8) * 256 * 2 B / 2                                                     = 3072
    #   scores: the softmax output, 512 values * 2 B / 2                                  =  512
    assert memory.activation_bytes_per_layer(**KW, tp=2, dropout=False) == 2048 + 3072 + 512
    assert memory.activation_bytes_per_layer(**KW, tp=2, dropout=False, recompute="selective") == 2048 + 3072
    assert memory.activation_bytes_per_layer(**KW, tp=2, dropout=False, recompute="full") == 256 * 2


def test_activations_with_fp32_and_expert_copies():
    # fp32 (4 B), dropout, t=1, two copies of the MLP's input and hidden:
    #   whole: 3 * 256 * 4 (LN, LN, QKV input) + 2 * 256 (masks, 1 B) + 2 copies * 256 * 4 (MLP input) = 5632
    #   split: 4 * 256 * 4 (q, k, v, attn out) + 2 copies * 8 * 256 * 4 (MLP hidden)                  = 20480
    #   scores: 512 * (4 softmax + 1 mask + 4 dropped-out)                                            = 4608
    got = memory.activation_bytes_per_layer(**KW, dtype_bytes=4, mlp_copies=2)
    assert got == 5632 + 20480 + 4608


@pytest.mark.parametrize("bad, message", [
    (dict(seq=0), rf"^seq {INT_MSG}"), (dict(micro_batch=0), rf"^micro_batch {INT_MSG}"),
    (dict(hidden=0), rf"^hidden {INT_MSG}"), (dict(num_heads=0), rf"^num_heads {INT_MSG}"),
    (dict(tp=0), rf"^tp {INT_MSG}"), (dict(dtype_bytes=0), rf"^dtype_bytes {POS_MSG}"),
    (dict(mlp_copies=0), rf"^mlp_copies {POS_MSG}"),
    (dict(recompute="some"), r"^recompute must be one of \('none', 'selective', 'full'\), got 'some'$"),
])
def test_activation_bytes_per_layer_names_the_bad_argument(bad, message):
    with pytest.raises(ValueError, match=message):
        memory.activation_bytes_per_layer(**(KW | bad))


# ----------------------------------------------------------------------------------------------- pipeline
def test_in_flight_and_per_gpu_activations_under_gpipe():
    # GPipe: the first stage holds every micro-batch; 8 layers over 4 stages = 2 layers each, 10 B per layer
    assert memory.activation_bytes_per_gpu(10, 8, 4, 6, schedule="gpipe") == 2 * 6 * 10
    assert memory.activation_bytes_per_gpu(10, 8, 4, 6) == 2 * 4 * 10  # 1F1B: 4 in flight


@pytest.mark.parametrize("call, message", [
    (lambda: memory.in_flight_micro_batches(0, 4), rf"^pp {INT_MSG}"),
    (lambda: memory.in_flight_micro_batches(2, 0), rf"^num_micro {INT_MSG}"),
    (lambda: memory.in_flight_micro_batches(2, 4, "zb"), r"^schedule must be 'gpipe' or '1f1b', got 'zb'$"),
    (lambda: memory.activation_bytes_per_gpu(10, 0, 2, 4), rf"^num_layers {INT_MSG}"),
    (lambda: memory.pipeline_activation_peak(10, 0, 2, 4), rf"^num_layers {INT_MSG}"),
    (lambda: memory.pipeline_activation_peak(10, 4, 0, 4), rf"^pp {INT_MSG}"),
    (lambda: memory.stage_flops(1.0, 0, 1), rf"^num_layers {INT_MSG}"),
    (lambda: memory.stage_flops(1.0, 4, 0), rf"^pp {INT_MSG}"),
    (lambda: memory.stage_flops(1.0, 3, 4), r"^pp=4 stages need at least as many layers, got 3$"),
])
def test_pipeline_formulas_name_the_bad_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_pipeline_activation_peak_edge_cases():
    # one stage, one micro-batch, no logits given: the 4 layers of 10 B
    assert memory.pipeline_activation_peak(10, 4, 1, 1) == 40
    # one stage under GPipe: 2 micro-batches, each with its 4 layers and 5 B of logits
    assert memory.pipeline_activation_peak(10, 4, 1, 2, logits=5, schedule="gpipe") == 2 * (40 + 5)
    # two stages: the last holds one micro-batch's 2 layers + 100 B of logits = 120, the first 2 * 20 = 40
    assert memory.pipeline_activation_peak(10, 4, 2, 4, logits=100) == 120
    # two stages, small logits: the first stage's 2 micro-batches of 2 layers win
    assert memory.pipeline_activation_peak(10, 4, 2, 4, logits=1) == 40


def test_stage_flops_one_layer_per_stage_and_default_extras():
    assert memory.stage_flops(2.0, 3, 3) == [2.0, 2.0, 2.0]
    assert memory.stage_flops(1.0, 5, 2) == [3.0, 2.0]  # no embedding or head flops unless given


# ----------------------------------------------------------------------------------------------- serving and state
def test_kv_cache_bytes_hand_case():
    # 100 B/token * 2 sequences * 10 tokens = 2000 B; 4 KV heads over tp 8 -> split 4 ways; 2 stages
    assert memory.kv_cache_bytes_per_gpu(100, 2, 10, 8, 2, 4) == 250


@pytest.mark.parametrize("i, name", list(enumerate(["batch", "seq", "tp", "pp", "num_kv_heads"])))
def test_kv_cache_bytes_names_the_bad_argument(i, name):
    args = [2, 10, 8, 2, 4]
    args[i] = 0
    with pytest.raises(ValueError, match=rf"^{name} {INT_MSG}, got 0$"):
        memory.kv_cache_bytes_per_gpu(100, *args)
    with pytest.raises(ValueError, match=rf"^bytes_per_token {POS_MSG}"):
        memory.kv_cache_bytes_per_gpu(0, 2, 10, 8, 2, 4)


def test_model_state_fp32_with_pipeline_and_expert_split():
    # fp32 (4 + 4 + 8 B/param), ZeRO-1. dense 1200 over pp 3 * tp 2 = 200 params: 800 + 800 + 8*200/dp4 = 400
    # experts 2400 over tp 2 * pp 3 * ep 2 = 200 params, ZeRO over dp/ep = 2: 800 + 800 + 1600/2 = 800
    got = memory.model_state_bytes_per_gpu(1200, 2400, dp=4, tp=2, pp=3, ep=2, zero_stage=1, precision="fp32")
    assert got == pytest.approx({"params": 1600, "grads": 1600, "optimizer": 1200, "total": 4400})
    # the stage of interest holds 600 dense params (not 1200/3): 300 per tp rank -> 1200 + 1200 + 600
    got = memory.model_state_bytes_per_gpu(1200, 2400, dp=4, tp=2, pp=3, ep=2, zero_stage=1, precision="fp32",
                                           dense_on_stage=600)
    assert got == pytest.approx({"params": 2000, "grads": 2000, "optimizer": 1400, "total": 5400})
    # nothing to hold
    assert memory.model_state_bytes_per_gpu(0, 0, dp=2, tp=1, pp=1, ep=1, zero_stage=3)["total"] == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp=0), rf"^dp {INT_MSG}"), (dict(tp=0), rf"^tp {INT_MSG}"), (dict(pp=0), rf"^pp {INT_MSG}"),
    (dict(ep=0), rf"^ep {INT_MSG}"),
    (dict(dp=3, ep=2), r"^ep=2 must divide dp=3 \(expert-parallel groups are carved out of data parallelism\)$"),
    (dict(dense_params=-1), r"^parameter counts must be >= 0$"),
    (dict(expert_params=-1), r"^parameter counts must be >= 0$"),
])
def test_model_state_names_the_bad_argument(kwargs, message):
    args = dict(dense_params=100, expert_params=0, dp=2, tp=1, pp=1, ep=1, zero_stage=1) | kwargs
    with pytest.raises(ValueError, match=message):
        memory.model_state_bytes_per_gpu(**args)


# ----------------------------------------------------------------------------------------------- communication
def test_ring_factor_hand_values():
    assert memory.ring_factor(1) == 0.0  # a ring of one sends nothing
    assert memory.ring_factor(4) == 0.75  # each rank sends 3 of the 4 chunks
    with pytest.raises(ValueError, match=rf"^group size {INT_MSG}"):
        memory.ring_factor(0)


def test_dp_comm_default_is_one_micro_batch():
    # 100 B of gradient, 4 ranks (3/4 per pass). ZeRO-2, one micro-batch: a reduce-scatter + an all-gather = 150
    assert memory.dp_comm_bytes(100, 4, 2) == 150
    # ZeRO-3 with 2 micro-batches: 2 all-gathers + 1 reduce-scatter per micro-batch = 6 passes = 450
    assert memory.dp_comm_bytes(100, 4, 3, num_micro=2) == 450
    with pytest.raises(ValueError, match=rf"^num_micro {INT_MSG}"):
        memory.dp_comm_bytes(100, 4, 2, num_micro=0)
    with pytest.raises(ValueError, match=r"^zero_stage must be 0..3, got 4$"):
        memory.dp_comm_bytes(100, 4, 4)


def test_tp_comm_hand_cases():
    # b=2 s=3 h=5 bf16: a 60 B activation; a ring all-reduce over 4 ranks sends 2 * 3/4 * 60 = 90 B of it.
    # 2 all-reduces forward + 2 backward, 2 layers, 3 micro-batches: 4 * 90 * 6 = 2160
    assert memory.tp_comm_bytes(2, 3, 5, 4, 2, 3) == 2160
    assert memory.tp_comm_bytes(2, 3, 5, 4, 2, 3, dtype_bytes=1) == 1080  # fp8: half
    # sequence parallelism: the backward re-gathers the layer input, 5 all-reduce volumes
    assert memory.tp_comm_bytes(2, 3, 5, 4, 2, 3, sequence_parallel=True) == 5 * 90 * 6
    # full recomputation replays the forward's 2 all-reduces: 6, and 7 with sequence parallelism
    assert memory.tp_comm_bytes(2, 3, 5, 4, 2, 3, recompute="full") == 6 * 90 * 6
    assert memory.tp_comm_bytes(2, 3, 5, 4, 2, 3, sequence_parallel=True, recompute="full") == 7 * 90 * 6
    assert memory.tp_comm_bytes(2, 3, 5, 4, 2, 3, recompute="selective") == 2160  # recomputes no all-reduce


@pytest.mark.parametrize("kwargs, message", [
    (dict(layers_per_stage=0), rf"^layers_per_stage {INT_MSG}"), (dict(num_micro=0), rf"^num_micro {INT_MSG}"),
    (dict(tp=0), rf"^group size {INT_MSG}"),
    (dict(recompute="most"), r"^recompute must be one of \('none', 'selective', 'full'\), got 'most'$"),
])
def test_tp_comm_names_the_bad_argument(kwargs, message):
    args = dict(micro_batch=2, seq=3, hidden=5, tp=4, layers_per_stage=2, num_micro=3) | kwargs
    with pytest.raises(ValueError, match=message):
        memory.tp_comm_bytes(**args)


def test_pp_comm_hand_cases():
    # b=2 s=3 h=5 bf16 = 60 B, one activation + one gradient per micro-batch, 4 micro-batches = 480
    assert memory.pp_comm_bytes(2, 3, 5, 2, 4) == 480
    assert memory.pp_comm_bytes(2, 3, 5, 2, 4, sequence_parallel=True) == 480  # tp defaults to 1: no split
    assert memory.pp_comm_bytes(2, 3, 5, 2, 4, tp=3, sequence_parallel=True) == 160
    with pytest.raises(ValueError, match=rf"^tp {INT_MSG}"):
        memory.pp_comm_bytes(2, 3, 5, 2, 4, tp=0, sequence_parallel=True)
    with pytest.raises(ValueError, match=rf"^pp {INT_MSG}"):
        memory.pp_comm_bytes(2, 3, 5, 0, 4)


def test_ep_comm_hand_case():
    # b=2 s=3 tokens, top-2: 12 routed copies of h=5 bf16 values = 120 B per all-to-all; 3/4 of them leave the
    # GPU with ep=4; dispatch + combine, forward and backward: 4 * 90 = 360 (capacity factor defaults to 1)
    assert memory.ep_comm_bytes(2, 3, 5, 2, 4, 1, 1) == 360
    assert memory.ep_comm_bytes(2, 3, 5, 2, 4, 2, 3, capacity_factor=1.5, dtype_bytes=1) == 360 * 2 * 3 * 1.5 / 2
    with pytest.raises(ValueError, match=rf"^capacity_factor {POS_MSG}"):
        memory.ep_comm_bytes(2, 3, 5, 2, 4, 1, 1, capacity_factor=0)
    with pytest.raises(ValueError, match=rf"^top_k {INT_MSG}"):
        memory.ep_comm_bytes(2, 3, 5, 0, 4, 1, 1)


def test_logits_bytes_hand_case():
    # (b=2, s=3, V=10) = 60 fp32 log-probabilities = 240 B, split over the vocabulary by tp=5: 48
    assert memory.logits_bytes(2, 3, 10, tp=5) == 48
    assert memory.logits_bytes(2, 3, 10, tp=5, dtype_bytes=2) == 24
    for i, name in enumerate(["micro_batch", "seq", "vocab", "tp"]):
        args = [2, 3, 10, 5]
        args[i] = 0
        with pytest.raises(ValueError, match=rf"^{name} {INT_MSG}, got 0$"):
            memory.logits_bytes(*args)
    with pytest.raises(ValueError, match=rf"^dtype_bytes {POS_MSG}"):
        memory.logits_bytes(2, 3, 10, dtype_bytes=0)


# ----------------------------------------------------------------------------------------------- flops and time
def test_train_flops_hand_cases():
    assert memory.train_flops(10, 7) == 420  # 2 (forward) + 4 (backward) flops per parameter and token
    assert memory.train_flops(10, 7, recompute="selective") == 420
    assert memory.train_flops(10, 7, recompute="full") == 560  # the forward twice: 8
    with pytest.raises(ValueError, match=r"^recompute must be one of \('none', 'selective', 'full'\), got 'x'$"):
        memory.train_flops(10, 7, recompute="x")
    with pytest.raises(ValueError, match=rf"^active_params {POS_MSG}"):
        memory.train_flops(0, 7)
    with pytest.raises(ValueError, match=rf"^tokens {POS_MSG}"):
        memory.train_flops(10, 0)


def test_step_time_hand_case():
    # 8e12 flops on 4 GPUs of 1e12 at 50%: 4 s of compute. 2 equal stages, 4 micro-batches: each micro-batch
    # takes 1 s on a stage, and 1F1B ends after m + p - 1 = 5 such slots: compute 4 + bubble 1.
    # dp sends 200 B at 100 B/s = 2 s; a link with nothing to send costs nothing, whatever its bandwidth.
    got = memory.step_time_estimate(8e12, 4, 1e12, 0.5, pp=2, num_micro=4,
                                    comm={"dp": (200, 100), "tp": (0, 0), "ep": (1, 4)})
    assert got == pytest.approx({"compute": 4, "bubble": 1, "imbalance": 0, "dp": 2, "tp": 0, "ep": 0.25,
                                 "total": 7.25})
    # mfu = 1 is allowed: 2 s of compute, one stage
    assert memory.step_time_estimate(8e12, 4, 1e12, 1.0, pp=1, num_micro=1, comm={})["total"] == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_gpus=0), rf"^num_gpus {INT_MSG}"), (dict(pp=0), rf"^pp {INT_MSG}"),
    (dict(num_micro=0), rf"^num_micro {INT_MSG}"), (dict(mfu=1.5), r"^mfu must be in \(0, 1\], got 1.5$"),
    (dict(mfu=0), r"^mfu must be in \(0, 1\], got 0$"), (dict(peak_flops=0), rf"^peak_flops {POS_MSG}"),
    (dict(stage_shares=[1.0, 0.0]), rf"^stage share {POS_MSG}"),
    (dict(stage_shares=[0.5, 0.4]), r"^stage_shares must be 2 positive numbers adding up to 1, got \[0.5, 0.4\]$"),
    (dict(comm={"dp": (10, 0)}), rf"^dp bandwidth {POS_MSG}"),
])
def test_step_time_names_the_bad_argument(kwargs, message):
    args = dict(flops=8e12, num_gpus=4, peak_flops=1e12, mfu=0.5, pp=2, num_micro=4, comm={}) | kwargs
    with pytest.raises(ValueError, match=message):
        memory.step_time_estimate(**args)


# ------------------------------------------------------------------------------- which argument an error names
SHAPE = dict(num_layers=2, hidden=4, num_heads=2, num_kv_heads=1, head_dim=2, intermediate=8, vocab=10, num_experts=1)


@pytest.mark.parametrize("name", list(SHAPE))
def test_transformer_params_names_the_bad_argument(name):
    with pytest.raises(ValueError, match=rf"^{name} {INT_MSG}, got 0$"):
        memory.transformer_params(**{**SHAPE, name: 0})


@pytest.mark.parametrize("name", ["num_layers", "pp"])
def test_worst_stage_dense_params_names_the_bad_argument(name):
    args = {"dense_params": 1000, "num_layers": 4, "pp": 2, "vocab": 10, "hidden": 4, name: 0}
    with pytest.raises(ValueError, match=rf"^{name} {INT_MSG}, got 0$"):
        memory.worst_stage_dense_params(**args)


def test_worst_stage_dense_params_assumes_an_untied_head_by_default():
    """Llama-style models have their own output head unless told otherwise. By hand, L=4, h=4, 2 heads of 2, one KV
    head, MLP 8, V=10: a layer holds 2*4*2*2 + 2*4*1*2 (attention) + 3*4*8 (MLP) + 2*4 (norms) = 152; the model
    4*152 + 2*10*4 (embedding and head) + 4 (final norm) = 692. Over 2 stages the last holds 2 layers, the head and
    the norm: 2*152 + 40 + 4 = 348, the first 2*152 + 40 = 344."""
    dense = memory.transformer_params(4, 4, 2, 1, 2, 8, 10)["dense"]
    assert dense == 692
    assert memory.worst_stage_dense_params(dense, 4, 2, 10, 4) == 348
