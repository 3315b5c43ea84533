"""Chapter 6 oracles: tensor-parallel layers, attention, block and GPT against the dense mlsys.model (outputs and
gradients, t = 1, 2, 4, on sub-groups); sequence parallelism against TP and the dense model; saved-activation bytes
against torch autograd's own saved tensors; collectives counted against layer_comm_volume and mlsys.collectives;
mlsys.tensor_parallel against torch's DTensor tensor parallelism; the conjugate pairs f/g and all-gather/
reduce-scatter as adjoint operators; one-line exit 2 for sizes that do not divide."""

from __future__ import annotations

import pytest
import torch

from conftest import load_script, run, run_json, scripts_dir
from mlsys.collectives import comm_volume
from mlsys.model import Block, GPTConfig
from mlsys.tensor_parallel import block_activation_bytes, check_divisible, layer_comm_volume, saved_activation_bytes

CH06 = scripts_dir(6)


# ----------------------------------------------------------------------------------------------- formulas, in-process
@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_layer_comm_volume_formula(t: int) -> None:
    b, s, h = 3, 16, 64
    n = b * s * h * 4
    tp, sp = layer_comm_volume(b, s, h, t), layer_comm_volume(b, s, h, t, sequence_parallel=True)
    assert tp["activation_bytes"] == n
    if t == 1:
        assert tp["forward"] == tp["backward"] == sp["forward"] == [] and tp["forward_sent_per_rank"] == 0
        return
    assert tp["forward"] == [("all_reduce", n)] * 2 and tp["backward"] == [("all_reduce", n)] * 2
    # ring all-reduce: each rank sends 2(t-1)/t of the buffer; two per layer forward
    assert tp["forward_sent_per_rank"] == pytest.approx(2 * 2 * (t - 1) / t * n)
    assert tp["forward_sent_per_rank"] == pytest.approx(2 * comm_volume("all_reduce", n, t)["sent"])
    # SP: all-gather + reduce-scatter of the same N move exactly what one all-reduce moves
    assert sorted(sp["forward"]) == sorted([("all_gather", n), ("reduce_scatter", n)] * 2)
    assert sp["forward_sent_per_rank"] == pytest.approx(tp["forward_sent_per_rank"])
    assert sp["backward_sent_per_rank"] == pytest.approx(1.5 * tp["backward_sent_per_rank"])  # re-gathered input


@pytest.mark.parametrize("b,s,h,a", [(2, 16, 32, 4), (1, 8, 48, 2), (3, 24, 64, 8)])
def test_dense_block_saved_bytes_match_formula(b: int, s: int, h: int, a: int) -> None:
    torch.manual_seed(0)
    block = Block(GPTConfig(n_embd=h, n_head=a, vocab_size=10))
    x = torch.randn(b, s, h, requires_grad=True)
    _, measured = saved_activation_bytes(lambda: block(x), list(block.parameters()))
    assert measured == block_activation_bytes(b, s, h, a, 1)["bytes"] == 4 * (16 * s * b * h + 4 * s * b + a * s * b)


def test_activation_formula_shapes() -> None:
    b, s, h, a = 2, 64, 128, 4
    dense = block_activation_bytes(b, s, h, a, 1)["bytes"]
    for t in (2, 4, 8):
        tp = block_activation_bytes(b, s, h, a, t)["bytes"]
        sp = block_activation_bytes(b, s, h, a, t, sequence_parallel=True)["bytes"]
        assert sp == pytest.approx(dense / t)  # SP shards every saved activation
        assert tp == pytest.approx(4 * (s * b * h * (4 + 12 / t) + 4 * s * b + a * s * b / t))
        assert dense / t < tp < dense
        assert tp / sp == pytest.approx((t + 3) / 4, rel=0.02)  # the lesson's saving of SP over TP, main term


def test_check_divisible_messages() -> None:
    check_divisible(GPTConfig(n_head=4, n_embd=64), 4)
    with pytest.raises(ValueError, match="n_head=3 is not divisible by tensor-parallel size 2"):
        check_divisible(GPTConfig(n_head=3, n_embd=48), 2)
    with pytest.raises(ValueError, match="not divisible"):
        check_divisible(GPTConfig(n_head=1, n_embd=18), 4)


def test_not_divisible_exits_2_with_one_line() -> None:
    proc = run([CH06 / "tp_transformer.py", "-w", "2", "--tp-sizes", "2", "--n-head", "3", "--n-embd", "48"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["tp_transformer.py: error: n_head=3 is not divisible by "
                                                "tensor-parallel size 2"]



def test_sequence_not_divisible_is_a_usage_error(capsys) -> None:
    from mlsys import cli

    sp = load_script(CH06 / "sequence_parallel.py")
    with pytest.raises(SystemExit) as exit_info:
        cli.parse(sp.Settings, argv=["-w", "2", "--tp-sizes", "2", "--seq", "15", "--backend", "gloo"])
    assert exit_info.value.code == 2
    assert "--seq 15 is not divisible by tensor-parallel size 2" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- on real ranks
def adjoint_worker(ctx) -> dict:
    """<A x, y> = <x, A^T y> summed over ranks, for f/g and for the sequence-parallel pair; and the head layout."""
    import torch.distributed as dist

    from mlsys.model import GPT
    from mlsys.tensor_parallel import gather_from_sp, reduce_scatter_to_sp, shard_gpt

    group, r, t = dist.group.WORLD, ctx.rank, ctx.world_size
    gen = torch.Generator().manual_seed(100 + r)
    out = {}
    for name, fn, in_shape, out_shape in (("gather_from_sp", gather_from_sp, (2, 3, 5), (2, 3 * t, 5)),
                                          ("reduce_scatter_to_sp", reduce_scatter_to_sp, (2, 3 * t, 5), (2, 3, 5))):
        x = torch.randn(*in_shape, generator=gen, requires_grad=True)
        y = torch.randn(*out_shape, generator=gen)
        fx = fn(x, group)
        (fx * y).sum().backward()  # x.grad = A^T y
        both = torch.tensor([(fx * y).sum().item(), (x * x.grad).sum().item()], dtype=torch.float64)
        dist.all_reduce(both)
        out[name] = both.tolist()
    # the fused qkv layout: rank r's c_attn rows are q, k and v of heads [r*H/t, (r+1)*H/t), in that order
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=16, block_size=8))
    tp = shard_gpt(model, group)
    w = model.h[0].attn.c_attn.weight  # (3C, C): q rows, k rows, v rows
    C, rows = 16, 16 // t
    want = torch.cat([w[j * C + r * rows: j * C + (r + 1) * rows] for j in range(3)])
    out["qkv_layout_ok"] = bool(torch.equal(tp.h[0].attn.c_attn.weight, want))
    out["vocab_rows"] = [tp.wte.start, tp.wte.per_rank, tp.wte.padded_vocab]
    gathered = [None] * t
    dist.all_gather_object(gathered, out)
    return gathered


@pytest.mark.timeout(60)
def test_sp_pair_is_adjoint_and_layouts() -> None:
    from mlsys.launch import launch

    per_rank = launch(adjoint_worker, world_size=4, backend="gloo", timeout=50)
    for r, out in enumerate(per_rank):
        for name in ("gather_from_sp", "reduce_scatter_to_sp"):
            lhs, rhs = out[name]
            assert lhs == pytest.approx(rhs, rel=1e-6), f"{name} backward is not its adjoint on rank {r}"
        assert out["qkv_layout_ok"], f"rank {r}: fused qkv rows are not q, k, v of its own heads"
        assert out["vocab_rows"] == [12 * r, 12, 48]  # V=47 padded to 48, 12 rows per rank


@pytest.fixture(scope="module")
def transformer(tmp_path_factory) -> dict:
    return run_json(tmp_path_factory, CH06 / "tp_transformer.py", "-w", "4", "--tp-sizes", "1", "2", "4", "--seq", "16",
                    "--n-embd", "32")


@pytest.mark.timeout(120)
def test_tp_equals_dense_for_1_2_4(transformer: dict) -> None:
    n = 2 * 16 * 32 * 4  # batch * seq * hidden * float32
    assert transformer["activation_bytes"] == n
    for t in ("1", "2", "4"):
        res = transformer["tp"][t]
        for key in ("attention", "block_output", "block_input_grad", "logits", "loss", "param_grads"):
            assert res[key] < 2e-5, (t, key, res[key])
        assert res["n_params_checked"] == 2 + 12 * 2 + 2  # wte, wpe; 12 per block (2 LayerNorms, 4 linears); ln_f
        want = [] if t == "1" else [["all_reduce", n]] * 2
        assert res["block_forward"] == want and res["block_backward"] == want
        if t != "1":  # whole step: embedding g + 2 per block forward, head gather; f per column, embedding none
            assert res["gpt_events"] == {"forward all_reduce": 1 + 2 * 2, "forward all_gather": 1,
                                         "backward all_reduce": 2 * 2 + 1}
            assert res["forward_sent_per_rank"] == pytest.approx(2 * comm_volume("all_reduce", n, int(t))["sent"])


@pytest.fixture(scope="module")
def seqpar(tmp_path_factory) -> dict:
    return run_json(tmp_path_factory, CH06 / "sequence_parallel.py", "-w", "4", "--tp-sizes", "1", "2", "4",
                    "--n-layer", "1", "--n-embd", "64", "--seq", "32", "--batch", "2")


@pytest.mark.timeout(120)
def test_sequence_parallel_equals_tp_and_saves_memory(seqpar: dict) -> None:
    b, s, h, a = 2, 32, 64, 4
    for t in (1, 2, 4):
        res = seqpar["tp"][str(t)]
        for key in ("logits_sp_vs_tp", "loss_sp_vs_tp", "logits_sp_vs_dense", "grads_sp_vs_tp", "grads_sp_vs_dense"):
            assert res[key] < 2e-5, (t, key, res[key])
        # measured by saved_tensors_hooks in the ranks == the stated formula
        assert res["saved_bytes_tp"] == block_activation_bytes(b, s, h, a, t)["bytes"]
        assert res["saved_bytes_tp_sp"] == block_activation_bytes(b, s, h, a, t, sequence_parallel=True)["bytes"]
        assert res["saved_bytes_dense"] == res["saved_bytes_tp_sp"] * t
        assert res["SP_fwd_sent_B"] == res["TP_fwd_sent_B"]
    assert seqpar["tp"]["4"]["saving_tp_over_sp"] > seqpar["tp"]["2"]["saving_tp_over_sp"] > 1


@pytest.mark.timeout(120)
def test_matches_torch_dtensor(tmp_path_factory) -> None:
    res = run_json(tmp_path_factory, CH06 / "tp_dtensor.py", "-w", "2", "--seq", "8", "--hidden", "32", "--vocab", "10")
    assert len(res["checks"]) == 15 and res["max_abs_diff"] < 1e-5
    assert {c["case"] for c in res["checks"]} == {"MLP", "MLP + SP", "head"}


@pytest.mark.timeout(120)
def test_layers_count_one_all_reduce_each_way(tmp_path_factory) -> None:
    res = run_json(tmp_path_factory, CH06 / "tp_layers.py", "-w", "2", "--hidden", "16", "--seq", "4")
    assert res["forward_all_reduces"] == res["backward_all_reduces"] == 1
    assert res["all_reduce_bytes"] == 4 * 4 * 16 * 4 and res["max_abs_err"] < 1e-5
    assert len(res["checks"]) == 13
