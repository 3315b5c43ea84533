"""Chapter 6 oracles: tensor-parallel layers, attention, block and GPT against the dense mlsys.model (outputs and
gradients, t = 1, 2, 4, on sub-groups); sequence parallelism against TP and the dense model; saved-activation bytes
against torch autograd's own saved tensors; collectives counted against layer_comm_volume and mlsys.collectives;
mlsys.tensor_parallel against torch's DTensor tensor parallelism; the conjugate pairs f/g and all-gather/
reduce-scatter as adjoint operators; one-line exit 2 for sizes that do not divide."""

from __future__ import annotations

import pytest
import torch

from conftest import load_script, run, run_json, scripts_dir, smoke_run
from mlsys.collectives import comm_volume
from mlsys.model import GPT, Block, GPTConfig
from mlsys.tensor_parallel import block_activation_bytes, check_divisible, saved_activation_bytes

CH06 = scripts_dir(6)


# ----------------------------------------------------------------------------------------------- formulas, in-process
@pytest.mark.parametrize("b,s,h,a", [(2, 16, 32, 4), (1, 8, 48, 2), (3, 24, 64, 8)])
def test_dense_block_saved_bytes_match_formula(b: int, s: int, h: int, a: int) -> None:
    torch.manual_seed(0)
    block = Block(GPTConfig(n_embd=h, n_head=a, vocab_size=10))
    x = torch.randn(b, s, h, requires_grad=True)
    _, measured = saved_activation_bytes(lambda: block(x), list(block.parameters()))
    assert measured == block_activation_bytes(b, s, h, a, 1)["bytes"] == 4 * (16 * s * b * h + 4 * s * b + a * s * b)


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
    out["qkv_full"] = model.h[0].attn.c_attn.weight.tolist()  # (3C, C): q rows, k rows, v rows (unsharded)
    out["qkv_shard"] = tp.h[0].attn.c_attn.weight.tolist()  # what this rank holds; compared in the test
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
        w, C = torch.tensor(out["qkv_full"]), 16
        rows = C // len(per_rank)
        want = torch.cat([w[j * C + r * rows: j * C + (r + 1) * rows] for j in range(3)])
        assert torch.equal(torch.tensor(out["qkv_shard"]), want), f"rank {r}: qkv rows not its heads"
        assert out["vocab_rows"] == [12 * r, 12, 48]  # V=47 padded to 48, 12 rows per rank


@pytest.fixture(scope="module")
def transformer(tmp_path_factory) -> dict:
    return run_json(tmp_path_factory, CH06 / "tp_transformer.py", "-w", "4", "--tp-sizes", "1", "2", "4", "--seq", "16",
                    "--n-embd", "32")


@pytest.fixture(scope="module")
def shards_t2(tmp_path_factory) -> dict:
    """tp_shards.py on 2 ranks: two heads per rank, 47 token ids padded to 48."""
    return run_json(tmp_path_factory, CH06 / "tp_shards.py", "-w", "2", "--n-layer", "1", "--seq", "8",
                    "--plot-dir", tmp_path_factory.mktemp("shards_t2"))


@pytest.fixture(scope="module")
def shards_t5(tmp_path_factory) -> dict:
    """tp_shards.py on 5 ranks: one head per rank, 47 token ids padded to 50 (three zero rows on the last rank)."""
    return run_json(tmp_path_factory, CH06 / "tp_shards.py", "-w", "5", "--n-head", "5", "--n-embd", "40",
                    "--batch", "1", "--seq", "8", "--plot-dir", tmp_path_factory.mktemp("shards_t5"))


def collectives_from_definition(model, batch: int, seq: int, t: int) -> dict:
    """The collectives of one training step, per layer and direction, from the dense model's definition and the
    lesson's plan: in attention and the MLP, c_proj is row-parallel (g: all-reduce forward) and every other linear
    layer column-parallel (f: all-reduce backward); the tied embedding/head is split by vocabulary rows (the
    embedding sums its partial lookups forward; the head all-gathers the padded logits forward and, being a column
    layer, all-reduces its input gradient backward). Backward visits the layers in reverse."""
    import math

    import torch.nn as nn

    C, V = model.config.n_embd, model.config.vocab_size
    n = batch * seq * C * 4
    layers = [("embedding", [("all_reduce", n)], [])]
    for i, block in enumerate(model.h):
        for part in ("attn", "mlp"):
            linears = [name for name, m in getattr(block, part).named_children() if isinstance(m, nn.Linear)]
            layers.append((f"block {i} {part}", [("all_reduce", n) for name in linears if name == "c_proj"],
                           [("all_reduce", n) for name in linears if name != "c_proj"]))
    layers.append(("head", [("all_gather", batch * seq * math.ceil(V / t) * t * 4)], [("all_reduce", n)]))
    return {"forward": [(name, op, b) for name, fwd, _ in layers for op, b in fwd],
            "backward": [(name, op, b) for name, _, bwd in reversed(layers) for op, b in bwd]}


def dense_gpt_step(seed: int, batch: int, seq: int, n_embd: int) -> tuple:
    """The tp_transformer.py run's model and first group's batch, in one process with no tensor parallelism:
    (logits, loss, {LayerNorm parameter name: grad}) of one forward and backward."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=n_embd, block_size=256))
    gen = torch.Generator().manual_seed(seed * 1000)  # group 0's batch
    idx = torch.randint(0, model.config.vocab_size, (batch, seq + 1), generator=gen)
    logits, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    return logits.detach(), loss.item(), {n: p.grad for n, p in model.named_parameters() if "ln_" in n}


@pytest.mark.timeout(120)
def test_tp_equals_dense_for_1_2_4(transformer: dict) -> None:
    """What rank 0's TP GPT produced at t = 1, 2, 4 (its logits, loss and the LayerNorm gradients, which the whole
    TP backward feeds) against the dense GPT run here in one process; the collectives it logged against the plan."""
    n = 2 * 16 * 32 * 4  # batch * seq * hidden * float32
    assert transformer["activation_bytes"] == n
    logits, loss, ln_grads = dense_gpt_step(0, batch=2, seq=16, n_embd=32)
    for t in ("1", "2", "4"):
        res = transformer["tp"][t]
        seen = res["observed"]
        torch.testing.assert_close(torch.tensor(seen["logits"]), logits, rtol=1e-4, atol=2e-5)
        assert seen["loss"] == pytest.approx(loss, rel=1e-5)
        assert set(seen["layer_norm_grads"]) == set(ln_grads) and len(ln_grads) == 2 * 2 * 2 + 2
        for name, grad in ln_grads.items():
            torch.testing.assert_close(torch.tensor(seen["layer_norm_grads"][name]), grad, rtol=1e-4, atol=2e-5)
        assert res["n_params_checked"] == 2 + 12 * 2 + 2  # wte, wpe; 12 per block (2 LayerNorms, 4 linears); ln_f
        want = [] if t == "1" else [["all_reduce", n]] * 2
        assert res["block_forward"] == want and res["block_backward"] == want
        if t != "1":  # whole step: embedding g + 2 per block forward, head gather; f per column, embedding none
            assert res["gpt_events"] == {"forward all_reduce": 1 + 2 * 2, "forward all_gather": 1,
                                         "backward all_reduce": 2 * 2 + 1}
            # the ring bytes the table prints, from the all-reduces the block logged (not from the script's formula)
            logged = sum(comm_volume(op, b, int(t))["sent"] for op, b in res["block_forward"])
            assert res["forward_sent_per_rank"] == pytest.approx(logged)


@pytest.fixture(scope="module")
def seqpar(tmp_path_factory) -> dict:
    return run_json(tmp_path_factory, CH06 / "sequence_parallel.py", "-w", "4", "--tp-sizes", "1", "2", "4",
                    "--n-layer", "1", "--n-embd", "64", "--seq", "32", "--batch", "2",
                    "--plot-dir", tmp_path_factory.mktemp("sp_figures"))


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
        # the collectives the ranks really ran (logged as they were called), against the lesson's list per block:
        # TP all-reduces the (b, s, h) activation twice each way; SP turns each into all-gather + reduce-scatter,
        # and its backward re-gathers the two sequence-sharded inputs it did not keep
        n = b * s * h * 4
        counted = {k: {ph: [tuple(e) for e in v] for ph, v in d.items()} for k, d in res["counted"].items()}
        if t == 1:
            assert all(not v for d in counted.values() for v in d.values())
            continue
        assert counted["TP"] == {"forward": [("all_reduce", n)] * 2, "backward": [("all_reduce", n)] * 2}
        assert sorted(counted["TP+SP"]["forward"]) == sorted([("all_gather", n), ("reduce_scatter", n)] * 2)
        assert sorted(counted["TP+SP"]["backward"]) == sorted([("all_gather", n)] * 4 + [("reduce_scatter", n)] * 2)
        # bytes a ring moves for what was counted (mlsys.collectives, tested against chapter 4's ring)
        sent = {k: {ph: sum(comm_volume(op, nb, t)["sent"] for op, nb in v) for ph, v in d.items()}
                for k, d in counted.items()}
        assert sent["TP+SP"]["forward"] == pytest.approx(sent["TP"]["forward"]) == res["SP_fwd_sent_B"]
        assert sent["TP+SP"]["backward"] == pytest.approx(1.5 * sent["TP"]["backward"])
        # the lesson's saving of SP over TP, (t + 3) / 4 from the main term, against the measured bytes
        assert res["saving_tp_over_sp"] == pytest.approx((t + 3) / 4, rel=0.05)


@pytest.mark.timeout(120)
def test_block_picture_is_the_order_the_collectives_ran(seqpar: dict) -> None:
    """one_block_tensor_parallel.png / one_block_tensor_plus_sequence_parallel.png draw, left to right, the regions of
    one block and the collectives at each linear layer. Read left to right, the drawn forward collectives must be those
    a separate real forward of the same block logged, in that order (res["counted"], recorded by block_memory, not by
    the drawing code); read right to left, the backward ones. The regions' shapes are the paper's: (B, T, C) or
    (B, T/t, C) outside the linear pairs, the whole sequence inside: attention's output C/t (this rank's heads,
    what the row layer reads), GELU's 4C/t."""
    b, s, h = 2, 32, 64
    for t in (2, 4):
        res = seqpar["tp"][str(t)]
        for label, sp in (("TP", False), ("TP+SP", True)):
            drawn = res["drawn"][label]
            assert [i["type"] for i in drawn] == ["region", "comm", "layer", "region", "layer", "comm"] * 2 + ["region"]
            comms = [i for i in drawn if i["type"] == "comm"]
            assert [c["at"] for c in comms] == ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
            counted = res["counted"][label]
            assert [op for c in comms for op in c["forward"]] == [op for op, _ in counted["forward"]]
            assert [op for c in reversed(comms) for op in c["backward"]] == [op for op, _ in counted["backward"]]
            regions = [i["shape"] for i in drawn if i["type"] == "region"]
            outside = [b, s // t if sp else s, h]
            assert regions == [outside, [b, s, h // t], outside, [b, s, 4 * h // t], outside]  # attention: its heads
        # Megatron's f and g: identity/all-reduce at each column layer's input, all-reduce/identity after each row
        tp = [(c["forward"], c["backward"]) for c in res["drawn"]["TP"] if c["type"] == "comm"]
        assert tp == [([], ["all_reduce"]), (["all_reduce"], [])] * 2


@pytest.mark.timeout(120)
def test_matches_torch_dtensor(tmp_path_factory) -> None:
    res = run_json(tmp_path_factory, CH06 / "tp_dtensor.py", "-w", "2", "--seq", "8", "--hidden", "32", "--vocab", "10")
    assert len(res["checks"]) == 15 and res["max_abs_diff"] < 1e-5
    assert {c["case"] for c in res["checks"]} == {"MLP", "MLP + SP", "head"}


@pytest.mark.timeout(120)
def test_layers_count_one_all_reduce_each_way(tmp_path_factory) -> None:
    """The collectives the MLP logged as they ran: one all-reduce of the (batch 4, seq 4, hidden 16) float32
    activation each way; and what it computed, against the dense MLP run here in one process (same seed)."""
    from mlsys.model import MLP

    res = run_json(tmp_path_factory, CH06 / "tp_layers.py", "-w", "2", "--hidden", "16", "--seq", "4")
    assert res["logged"] == {"forward": [["all_reduce", 4 * 4 * 16 * 4]], "backward": [["all_reduce", 4 * 4 * 16 * 4]]}
    assert res["forward_all_reduces"] == res["backward_all_reduces"] == 1
    assert res["all_reduce_bytes"] == 4 * 4 * 16 * 4
    torch.manual_seed(0 + 1)  # the script's --seed 0, plus one for the MLP
    dense = MLP(GPTConfig(n_embd=16, n_head=1, vocab_size=8))
    x = torch.randn(4, 4, 16).requires_grad_(True)
    y = dense(x)
    y.square().sum().backward()
    torch.testing.assert_close(torch.tensor(res["observed"]["output"]), y.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(res["observed"]["input_grad"]), x.grad, rtol=1e-5, atol=1e-5)
    assert len(res["checks"]) == 13


@pytest.mark.timeout(120)
def test_layers_figure_blocks_tile_a_in_rank_order(tmp_path_factory) -> None:
    """The split tp_layers.py draws is read from the real shards: rank r owns the r-th block of A's columns
    (column-parallel) and of A's rows (row-parallel), and the blocks tile A. The f and g it marks are the
    collectives each layer logged: f, the column layer's backward all-reduce of dX (its forward all-gather only
    gathers Y for the check); g, the row layer's forward all-reduce of Y, with nothing in its backward."""
    plots = tmp_path_factory.mktemp("tp_split")
    res = run_json(tmp_path_factory, CH06 / "tp_layers.py", "-w", "2", "--hidden", "16", "--seq", "4",
                   "--plot-dir", plots)
    # the shapes drawn are the real tensors': X (batch 4, seq 4, 16 features) -> Y (4, 4, 32), and back
    x_bytes, y_bytes = 4 * 4 * 16 * 4, 4 * 4 * 32 * 4  # float32 (B, T, C) and (B, T, 2C)
    assert res["split"]["column"] == {"X": [4, 4, 16], "A": [16, 32], "Y": [4, 4, 32], "blocks": [[0, 16], [16, 32]],
                                      "logged": {"forward": [["all_gather", y_bytes]],
                                                 "backward": [["all_reduce", x_bytes]]}}
    assert res["split"]["row"] == {"X": [4, 4, 32], "A": [32, 16], "Y": [4, 4, 16], "blocks": [[0, 16], [16, 32]],
                                   "logged": {"forward": [["all_reduce", x_bytes]], "backward": []}}
    assert (plots / "column_and_row_parallel_linear.png").is_file()


# ----------------------------------------------------------------------------------------------- the three pictures
@pytest.mark.timeout(180)
@pytest.mark.parametrize("which", ["shards_t2", "shards_t5"])
def test_heads_figure_gives_rank_r_heads_r_times_h_over_t(which: str, request) -> None:
    """heads.png colours each (q|k|v, head) of c_attn and each head's c_proj columns by the rank whose shard held
    those rows, located by matching them in the dense weights. Rank r must hold heads r*H/t .. (r+1)*H/t - 1 of q,
    of k and of v, and the same heads' columns of c_proj (D = C/H rows or columns per head)."""
    drawn = request.getfixturevalue(which)
    t, H, C = drawn["t"], drawn["n_head"], drawn["n_embd"]
    D, per = C // H, H // t
    for r, rank in enumerate(drawn["ranks"]):
        heads = range(r * per, (r + 1) * per)
        rows = sorted(part * C + h * D + d for part in range(3) for h in heads for d in range(D))
        cols = sorted(h * D + d for h in heads for d in range(D))
        got_rows = [i for lo, hi in rank["heads"]["c_attn_rows"] for i in range(lo, hi)]
        got_cols = [i for lo, hi in rank["heads"]["c_proj_cols"] for i in range(lo, hi)]
        assert got_rows == rows and got_cols == cols, (which, r)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("which", ["shards_t2", "shards_t5"])
def test_vocab_figure_owner_of_each_token_is_id_over_rows_per_rank(which: str, request) -> None:
    """vocab_parallel_embedding_lookup.png: rank r holds rows r*ceil(V/t) .. of the table padded to t*ceil(V/t) (the
    padding on the last rank), and in its masked lookup of the batch exactly the token ids in its rows come out
    non-zero: each token of the batch is looked up by one rank, id // ceil(V/t)."""
    import math

    drawn = request.getfixturevalue(which)
    t, V, idx = drawn["t"], drawn["vocab_size"], drawn["idx"]
    per = math.ceil(V / t)
    for r, rank in enumerate(drawn["ranks"]):
        assert rank["vocab_rows"] == [r * per, (r + 1) * per]
        assert rank["padding_rows"] == (t * per - V if r == t - 1 else 0)
        assert rank["looked_up"] == [[int(i // per == r) for i in row] for row in idx], (which, r)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("which", ["shards_t2", "shards_t5"])
def test_comm_figure_is_the_collectives_of_the_model_definition(which: str, request) -> None:
    """collectives_per_layer_one_step.png draws, per layer and direction, the collectives comm_log recorded in one
    training step. They must be those the dense model's definition implies (collectives_from_definition), with their
    bytes."""
    from mlsys.model import GPT

    drawn = request.getfixturevalue(which)
    model = GPT(GPTConfig(n_layer=drawn["n_layer"], n_head=drawn["n_head"], n_embd=drawn["n_embd"], block_size=256))
    want = collectives_from_definition(model, drawn["batch"], drawn["seq"], drawn["t"])
    for phase in ("forward", "backward"):
        got = [(e["layer"], e["op"], e["bytes"]) for e in drawn["comm_by_layer"] if e["phase"] == phase]
        assert got == want[phase], (which, phase)


@pytest.mark.timeout(180)
def test_trace_puts_each_collective_inside_the_layer_that_issues_it(smoke_cache) -> None:
    """tp_trace.py's smoke run (2 ranks, 1 layer). In the raw Chrome trace rank 0 wrote: the gloo collectives, in
    time order, each inside the profiler range of the layer that issues it (a range enclosing its midpoint), are
    those the dense model's definition implies; and the figure's communication rows are those very events."""
    import json
    from pathlib import Path

    from mlsys.model import GPT

    proc = smoke_run(smoke_cache, CH06 / "tp_trace.py")
    assert proc["code"] == 0, proc["stderr"][-3000:]
    doc = proc["json"]
    settings, res = doc["settings"], doc["results"]
    trace = Path(proc["plot_dir"]) / "tp_step.trace.json"
    assert trace.is_file() and res["trace"].endswith("tp_step.trace.json")
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    gloo = sorted((e for e in events if e["name"] in ("gloo:all_reduce", "gloo:all_gather")), key=lambda e: e["ts"])
    ranges = [e for e in events if e["name"].startswith(("forward ", "backward "))]
    seen = []
    for e in gloo:
        mid = e["ts"] + e["dur"] / 2
        inside = [r for r in ranges if r["ts"] <= mid <= r["ts"] + r["dur"]]
        assert len(inside) == 1, (e, inside)
        direction, layer = inside[0]["name"].split(" ", 1)
        seen.append((direction, layer, e["name"].removeprefix("gloo:")))
    model = GPT(GPTConfig(n_layer=settings["n_layer"], n_head=settings["n_head"], n_embd=settings["n_embd"],
                          block_size=256))
    want = collectives_from_definition(model, settings["batch"], settings["seq"], settings["world_size"])
    assert seen == [(ph, layer, op) for ph in ("forward", "backward") for layer, op, _ in want[ph]]
    drawn = sorted((s for s in res["spans"] if s["lane"].startswith("gloo thread")), key=lambda s: s["start"])
    assert [s["end"] - s["start"] for s in drawn] == pytest.approx([e["dur"] / 1000 for e in gloo], abs=1e-6)
    assert [s["kind"] for s in drawn] == [e["name"].removeprefix("gloo:").replace("_", "-") for e in gloo]


# ----------------------------------------------------------------------------------------------- FSDP2 x TP and HSDP
@pytest.mark.parametrize("H,D,tp", [(4, 16, 2), (4, 16, 4), (6, 8, 3), (4, 16, 1)])
def test_head_order_gives_each_rank_its_own_heads_q_k_v(H: int, D: int, tp: int) -> None:
    """After the permutation, rank r's contiguous block of the fused (3C, C) weight is, row for row, the q rows,
    then the k rows, then the v rows of heads r*H/tp .. (r+1)*H/tp - 1, read from the dense weight by head."""
    C = H * D
    w = torch.randn(3 * C, C)
    permuted = w[load_script(CH06 / "fsdp_tp.py").head_order(C, tp)]
    by_head = w.view(3, H, D, C)  # (q|k|v, head, row within head, in)
    per = H // tp
    for r, block in enumerate(permuted.chunk(tp)):
        want = torch.cat([by_head[part, r * per:(r + 1) * per].reshape(-1, C) for part in range(3)])
        assert torch.equal(block, want)


@pytest.mark.timeout(120)
def test_fsdp_tp_and_hsdp_equal_one_process(smoke_cache) -> None:
    proc = smoke_run(smoke_cache, CH06 / "fsdp_tp.py")  # the smoke test's run: 4 ranks, the default
    assert proc["code"] == 0, proc["stderr"][-3000:]
    res = proc["json"]["results"]
    assert proc["json"]["settings"]["world_size"] == 4
    assert res["fsdp_tp"]["mesh"] == {"dp": 2, "tp": 2} and res["hsdp"]["mesh"] == {"replicate": 2, "shard": 2}
    for run_ in res.values():
        assert run_["max_abs_diff"] < 2e-5 and run_["full_shape"] == [256, 64]
    assert res["fsdp_tp"]["local_shape"] == [64, 64]  # a quarter: split by tp, then by dp
    assert res["hsdp"]["local_shape"] == [128, 64]  # a half: sharded in a group of 2, replicated across groups


def reassemble(held: list[dict], shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The full matrix put back from every rank's recorded block at its recorded offset, and how many ranks
    wrote each element."""
    import base64

    import numpy as np

    full, cover = torch.zeros(shape), torch.zeros(shape, dtype=torch.int64)
    for h in held:
        (r0, c0), (nr, nc) = h["offset"], h["shape"]
        block = np.frombuffer(base64.b64decode(h["local_float32_base64"]), dtype=np.float32).reshape(nr, nc)
        full[r0:r0 + nr, c0:c0 + nc] = torch.from_numpy(block.copy())
        cover[r0:r0 + nr, c0:c0 + nc] += 1
    return full, cover


@pytest.mark.timeout(120)
def test_fsdp_tp_mesh_picture_blocks_rebuild_the_dense_weights(smoke_cache) -> None:
    """mesh.png's blocks: every rank's recorded shard, placed at its recorded offset, covers each element of the
    weight exactly once and gives back the weight of one process that builds the same GPT from the same seed
    (the picture is of the initial weights, before any step). The TP cut comes first: in a mesh row (one TP
    group) the ranks hold different halves of the TP-split dimension."""
    proc = smoke_run(smoke_cache, CH06 / "fsdp_tp.py")
    assert proc["code"] == 0, proc["stderr"][-3000:]
    doc = proc["json"]
    shards = doc["results"]["fsdp_tp"]["shards"]
    torch.manual_seed(doc["settings"]["seed"])
    dense = dict(GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64)).named_parameters())
    assert set(shards) == {"h.0.mlp.c_fc.weight", "h.0.mlp.c_proj.weight"}
    for name, held in shards.items():
        want = dense[name].detach()
        full, cover = reassemble(held, tuple(want.shape))
        assert torch.equal(cover, torch.ones_like(cover)), f"{name}: an element held by {cover.max()} or 0 ranks"
        assert torch.equal(full, want), name
        assert sorted(h["rank"] for h in held) == list(range(doc["settings"]["world_size"]))
        tp_dim = 0 if "c_fc" in name else 1  # ColwiseParallel cuts the output rows, RowwiseParallel the inputs
        piece = want.shape[tp_dim] // doc["results"]["fsdp_tp"]["mesh"]["tp"]
        for h in held:  # tp coordinate j: inside the j-th TP piece of the split dimension, whatever dp is
            lo, j = h["offset"][tp_dim], h["coordinate"][1]
            assert j * piece <= lo and lo + h["shape"][tp_dim] <= (j + 1) * piece


# ----------------------------------------------------------------------------------------------- ring attention's merge
def test_merge_example_equals_one_softmax_over_the_joined_scores() -> None:
    """context_parallel.py's worked merge (the lesson's table): each block's o and lse, the merge weights and the
    merged result, against softmax and log-sum-exp computed here by hand in plain Python."""
    import math

    ex = load_script(CH06 / "context_parallel.py").merge_example()

    def attend(scores, values):
        z = sum(math.exp(s) for s in scores)
        return sum(math.exp(s) * v for s, v in zip(scores, values, strict=True)) / z, math.log(z)

    for b in ex["blocks"]:
        o, lse = attend(b["scores"], b["values"])
        assert b["o"] == pytest.approx(o, abs=1e-12) and b["lse"] == pytest.approx(lse, abs=1e-12)
    joined = [sum((b[key] for b in ex["blocks"]), []) for key in ("scores", "values")]
    o, lse = attend(*joined)
    for got in (ex["merged"], ex["one_softmax"]):
        assert got["o"] == pytest.approx(o, abs=1e-12) and got["lse"] == pytest.approx(lse, abs=1e-12)
    l1, l2 = (b["lse"] for b in ex["blocks"])
    assert ex["merged"]["w1"] == pytest.approx(math.exp(l1 - lse)) and ex["merged"]["w2"] == pytest.approx(
        math.exp(l2 - lse))
    assert ex["merged"]["w1"] + ex["merged"]["w2"] == pytest.approx(1.0)
