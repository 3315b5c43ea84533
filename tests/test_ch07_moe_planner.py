"""Chapter 7, expert parallelism and the planner: routing, capacity and the aux loss on hand cases; the dense MoE
against a plain per-token loop; the expert-parallel run against the dense MoE (its own self-checks, plus the drop
counts recomputed here); and the parallel-strategy calculator: its bytes by hand, its step time against a 1F1B
simulation of flops counted on a transformers model of the same shape."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from conftest import load_script, run, scripts_dir

CH07 = scripts_dir(7)
moe = load_script(CH07 / "moe_expert_parallel.py")
planner = load_script(CH07 / "parallel_planner.py")
GIB = 1024**3


# ----------------------------------------------------------------------------------------------- routing, by hand
def test_route_topk_and_renormalize():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    probs, w, e = moe.route(logits, 2, renormalize=True)
    assert torch.allclose(probs, torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    assert e.tolist() == [[3, 2]]
    assert torch.allclose(w, torch.tensor([[4 / 7, 3 / 7]]))
    _, w_raw, _ = moe.route(logits, 2, renormalize=False)
    assert torch.allclose(w_raw, torch.tensor([[0.4, 0.3]]))
    _, w1, _ = moe.route(logits, 1, renormalize=True)  # k=1 renormalized: always 1, no task gradient to the router
    assert w1.tolist() == [[1.0]]


def test_capacity_and_keep_mask():
    assert moe.expert_capacity(10, 4, 2, 1.0) == 5
    assert moe.expert_capacity(10, 4, 2, 1.25) == 7  # ceil(6.25)
    assert moe.expert_capacity(3, 4, 1, 1.0) == 1
    # first choices in token order, then second choices: expert 0 gets t0, t1 (t2 and t3's second choice dropped),
    # expert 1 gets t3 then t0 (t2's second choice dropped), expert 2 gets t1
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    keep = moe.keep_mask(experts, 3, capacity=2)
    assert keep.tolist() == [[True, True], [True, True], [False, False], [True, False]]


def test_load_balancing_loss_hand_cases():
    E, N = 4, 8
    uniform = torch.full((N, E), 1 / E)
    balanced = torch.arange(N).remainder(E)[:, None]  # two tokens per expert
    assert moe.load_balancing_loss(uniform, balanced).item() == pytest.approx(1.0)
    # E=2, all on expert 0 with probability 0.75: f = (1, 0), P = (0.75, 0.25) -> 2 * 0.75
    probs = torch.tensor([[0.75, 0.25]]).repeat(5, 1)
    assert moe.load_balancing_loss(probs, torch.zeros(5, 1, dtype=torch.long)).item() == pytest.approx(1.5)
    # top-2 of 2 experts: f = (1/2, 1/2) whatever P is -> exactly 1
    assert moe.load_balancing_loss(probs, torch.tensor([[0, 1]] * 5)).item() == pytest.approx(1.0)
    # the gradient flows only through P: d/dP_i = E * f_i
    p = probs.clone().requires_grad_(True)
    moe.load_balancing_loss(p, torch.zeros(5, 1, dtype=torch.long)).backward()
    assert torch.allclose(p.grad, torch.tensor([[2 / 5, 0.0]]).repeat(5, 1))


def naive_moe(layer, x, groups, factor):
    """A per-token Python loop with explicit slot counters: the oracle for dense_forward."""
    a = layer.args
    out = torch.zeros_like(x)
    for xg, start in zip(x.chunk(groups), range(0, len(x), len(x) // groups)):
        cap = math.ceil(factor * len(xg) * a.top_k / a.num_experts)
        probs = torch.softmax(xg @ layer.gate.weight.t(), dim=-1)
        top = [sorted(range(a.num_experts), key=lambda e: -probs[t, e].item())[:a.top_k] for t in range(len(xg))]
        used = [0] * a.num_experts
        for j in range(a.top_k):  # choice-major priority
            for t in range(len(xg)):
                e = top[t][j]
                if used[e] < cap:
                    used[e] += 1
                    w = probs[t, e] / sum(probs[t, c] for c in top[t]) if a.renormalize else probs[t, e]
                    out[start + t] += w * layer.experts.expert(e, xg[t:t + 1])[0]
    return out


@pytest.mark.parametrize("top_k, renormalize, factor", [(2, True, 0.75), (1, False, 1.0), (2, False, 8.0)])
def test_dense_moe_matches_per_token_loop(top_k, renormalize, factor):
    args = moe.Settings(num_experts=4, top_k=top_k, renormalize=renormalize, tokens=12, hidden=8, skew=1.0)
    layer = moe.MoE(args)
    x = torch.cat([moe.make_data(args, r)[0] for r in range(2)])
    with torch.no_grad():
        y, info = moe.dense_forward(layer, x, 2, factor)
        assert torch.allclose(y, naive_moe(layer, x, 2, factor), atol=1e-5)
    if factor >= 4 / top_k:  # capacity >= every token: nothing dropped
        assert bool(info["keep"].all())


# ----------------------------------------------------------------------------------------------- expert parallelism
@pytest.fixture(scope="module")
def ep_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("moe") / "moe.json"
    proc = run([CH07 / "moe_expert_parallel.py", "-w", "4", "--top-k", "1", "--no-renormalize", "--tokens", "48",
                "--hidden", "16", "--train-steps", "0", "--factors", "0.5", "1.0", "2.0",
                "--json", out, "--plot-dir", out.parent], timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: expert-parallel output" in proc.stdout
    assert (out.parent / "dispatch.png").exists()
    return json.loads(out.read_text())


@pytest.mark.timeout(120)
def test_expert_parallel_equals_dense(ep_run):
    r = ep_run["results"]
    c = r["check"]
    assert c["loss"] == pytest.approx(c["loss_dense"], rel=1e-5)
    assert sum(c["tokens_per_expert"]) == 4 * 48 * 1 == c["assignments"]
    assert sum(c["kept_per_expert"]) == c["assignments"] - c["dropped"]
    assert sum(c["received_rows"]) == c["kept_per_expert"][0]  # rank 0 owns expert 0 alone (E=4 on 4 ranks)


@pytest.mark.timeout(120)
def test_drop_table_recomputed_in_process(ep_run):
    settings = ep_run["settings"]
    args = moe.Settings(**{k: v for k, v in settings.items()})
    layer = moe.MoE(args)
    x = torch.cat([moe.make_data(args, r)[0] for r in range(args.world_size)])
    rates = []
    for row in ep_run["results"]["drop_table"]:
        with torch.no_grad():
            _, info = moe.dense_forward(layer, x, args.world_size, row["capacity_factor"])
        assert row["dropped_assignments"] == int((~info["keep"]).sum())
        # what a capacity means, counted per (rank's group, expert): never more kept than it, and an assignment
        # dropped only where the expert was full
        for experts, keep in zip(info["experts"].chunk(args.world_size), info["keep"].chunk(args.world_size)):
            for e in range(args.num_experts):
                kept, dropped = int(((experts == e) & keep).sum()), int(((experts == e) & ~keep).sum())
                assert kept <= row["capacity"] and (dropped == 0 or kept == row["capacity"])
        rates.append(row["drop_rate"])
    assert rates == sorted(rates, reverse=True)  # more capacity never drops more


@pytest.mark.timeout(120)
def test_dispatch_picture_send_counts_are_a_bincount_of_the_routing(ep_run):
    """dispatch.png is drawn from the real routing of a tiny batch: the rows it says each rank sends to each rank
    are a numpy bincount of the owners of the kept choices, and the all-to-all sent exactly those rows."""
    d = ep_run["results"]["dispatch"]
    W, E = ep_run["results"]["world_size"], ep_run["settings"]["num_experts"]
    experts, keep = np.array(d["experts"]), np.array(d["keep"], dtype=bool)  # (W, n, k) each
    assert experts.shape == (W, d["tokens_per_rank"], ep_run["settings"]["top_k"])
    want = [np.bincount(experts[r][keep[r]] // (E // W), minlength=W).tolist() for r in range(W)]
    assert d["drawn"]["send_counts"] == want
    assert d["sent_rows"] == want  # what the all-to-all really carried
    lines = d["drawn"]["lines"]  # one per (rank, token, choice), kept or dropped
    assert sorted((r, t, c, e, k) for r, t, c, e, _, k in lines) == sorted(
        (r, t, c, int(experts[r, t, c]), bool(keep[r, t, c])) for r, t, c in np.ndindex(*experts.shape))


# ----------------------------------------------------------------------------------------------- the planner
def hf_matmul_weights(model) -> tuple[float, float]:
    """(weights one token multiplies in one decoder layer, in the output head), counted on a transformers model of
    the same shape built on the meta device with one layer: every 2-D weight but the embedding (a lookup), and of
    each fused (E, out, in) expert tensor the k matrices a token is routed to. Norms are 1-D: not matmuls."""
    transformers = pytest.importorskip("transformers")
    s = model.shape
    common = dict(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                  num_hidden_layers=1, num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
                  head_dim=s.head_dim, tie_word_embeddings=False)
    with torch.device("meta"):
        if model.experts > 1:
            hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
                **common, num_local_experts=model.experts, num_experts_per_tok=model.top_k))
        else:
            hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    layer = 0.0
    for w in hf.model.layers[0].parameters():
        if w.dim() == 2:
            layer += w.numel()
        elif w.dim() == 3:  # (experts, out, in): a token goes through top_k of them
            layer += w[0].numel() * model.top_k
    return layer, float(hf.lm_head.weight.numel())


def oracle_pipeline_seconds(model, args, row: dict) -> tuple[float, int]:
    """The pipeline's time for one step, stage by stage: each stage's layers (split ceil/floor from the first
    stage), the head on the last, 2 flops per weight and token forward and 4 backward per matmul, on tp GPUs at
    mfu of peak; walked through the 1F1B schedule on an event clock. Returns (seconds, slowest stage)."""
    from conftest import simulate_1f1b

    layer_w, head_w = hf_matmul_weights(model)
    tokens, rate = args.micro_batch * args.seq, row["tp"] * args.peak_tflops * 1e12 * args.mfu
    L, p = model.shape.num_layers, row["pp"]
    n = [L // p + (i < L % p) for i in range(p)]
    fwd = [(2 * tokens * layer_w * n[i] + (2 * tokens * head_w if i == p - 1 else 0)) / rate for i in range(p)]
    return simulate_1f1b(fwd, [2 * f for f in fwd], row["micro"]), max(range(p), key=lambda i: fwd[i])


def test_planner_cost_by_hand():
    args = planner.Settings(model="llama-3-70b", gpus=64, global_batch=512, seq=4096, zero_stage=1)
    model = planner.load_model(args)
    assert model.dense_params == 70_553_706_496 and model.expert_params == 0
    row = planner.cost(model, args, dp=8, tp=8, pp=1, ep=1)
    P = 70_553_706_496 / 8  # parameters per GPU after tp = 8
    assert row["params_GiB"] * GIB == pytest.approx(2 * P)
    assert row["optimizer_GiB"] * GIB == pytest.approx(12 * P / 8)  # ZeRO-1 over dp = 8
    assert row["micro"] == 512 // 8
    # selective recompute + sequence parallelism: 34 s b h / t per layer, 80 layers, 1F1B with p = 1 -> 1 in flight
    # plus the last layer's logits as fp32 log-probabilities, split over the vocabulary: 4 * s * V / t
    assert row["act_GiB"] * GIB == pytest.approx(34 * 4096 * 8192 / 8 * 80 + 4 * 4096 * 128256 / 8)
    # sequence parallelism: 2 all-reduce volumes forward, 3 backward (the re-gather of the sharded inputs)
    assert row["tp_GB_sent"] * 1e9 == pytest.approx(10 * 7 / 8 * 4096 * 8192 * 2 * 80 * 64)
    assert row["dp_GB_sent"] * 1e9 == pytest.approx(2 * 7 / 8 * 2 * P)
    assert row["pp_GB_sent"] == 0 and row["ep_GB_sent"] == 0
    assert row["total_GiB"] == pytest.approx(row["params_GiB"] + row["grads_GiB"] + row["optimizer_GiB"]
                                             + row["act_GiB"])
    # compute: the weights a token multiplies, counted on a transformers model of the same shape, 6 flops each
    layer_w, head_w = hf_matmul_weights(model)
    assert row["t_compute"] == pytest.approx(6 * (80 * layer_w + head_w) * 512 * 4096 / (64 * 989e12 * 0.4))
    # tp = 8 stays in a node (NVLink); dp spans 64 ranks -> network
    assert row["t_tp"] == pytest.approx(row["tp_GB_sent"] / 450)
    assert row["t_dp"] == pytest.approx(row["dp_GB_sent"] / 50)
    # pipelined, sequence-parallel: each of the 2 TP ranks sends its half of every activation and gradient
    piped = planner.cost(model, args, dp=2, tp=2, pp=16, ep=1)
    assert piped["pp_GB_sent"] * 1e9 == pytest.approx(2 * 4096 * 8192 * 2 * 256 / 2)
    with pytest.raises(ValueError):
        planner.cost(model, args, dp=4, tp=16, pp=1, ep=1)  # tp beyond a node


def test_planner_expert_gradients_reduce_over_their_replicas_only():
    """With ep = dp every expert lives on one rank of the data-parallel group: its gradient has no replica to be
    reduced with, so DP traffic is the dense part's alone (a dense-only model of the same layout sends the same)."""
    args = planner.Settings(model="mixtral-8x7b", gpus=64)
    moe = planner.load_model(args)
    dense_only = planner.Model(moe.shape, 1, 1, moe.dense_params, 0, moe.tied)
    for dp, ep in ((8, 8), (16, 8)):
        tp, pp = 4, 64 // (4 * dp)
        with_experts = planner.cost(moe, args, dp, tp, pp, ep)["dp_GB_sent"]
        without = planner.cost(dense_only, args, dp, tp, pp, 1)["dp_GB_sent"]
        if ep == dp:
            assert with_experts == pytest.approx(without)
        else:  # two replicas of each expert: one all-reduce over 2 ranks, 2 * (1/2) * expert grad bytes
            expert_grad = 2 * moe.expert_params / (tp * pp * ep)
            assert with_experts - without == pytest.approx(2 * 0.5 * expert_grad / 1e9)


@pytest.mark.parametrize("model_name, gpus, batch", [("llama-3-70b", 64, 512), ("mixtral-8x7b", 64, 512),
                                                     ("llama-3-8b", 8, 64)])
def test_planner_pipeline_time_is_the_simulated_1f1b_schedule(model_name, gpus, batch):
    """Every layout's compute + bubble + imbalance against the oracle: flops per stage from a transformers model's
    weights, walked through 1F1B on an event clock; and the stage the planner names as the slowest."""
    args = planner.Settings(model=model_name, gpus=gpus, global_batch=batch)
    model = planner.load_model(args)
    rows, _ = planner.candidates(model, args)
    assert any(r["pp"] > 1 for r in rows)
    for row in rows:
        seconds, slowest = oracle_pipeline_seconds(model, args, row)
        assert row["t_compute"] + row["t_bubble"] + row["t_imbalance"] == pytest.approx(seconds, rel=1e-9), row
        assert row["slowest_stage"] == slowest


@pytest.mark.parametrize("model_name", ["llama-3-70b", "mixtral-8x7b"])
def test_planner_recommendation_is_the_fastest_fitting_layout(model_name, tmp_path, monkeypatch, capsys):
    """Brute force: every (dp, tp, pp, ep) whose product is the 64 GPUs, each costed; its step time re-added from
    the simulated pipeline and the communication seconds; the fastest that fits must be the recommendation."""
    out = tmp_path / "plan.json"
    monkeypatch.setattr("sys.argv", ["parallel_planner.py", "--model", model_name, "--json", str(out)])
    assert planner.main() == 0
    printed = capsys.readouterr().out
    assert "recommended:" in printed and "step-time assumptions: 989 TFLOP/s" in printed
    results = json.loads(out.read_text())["results"]
    best = results["recommended"]
    assert best is not None and best["fits"] and best["total_GiB"] <= 80 * 0.9
    args = planner.Settings(model=model_name)
    model = planner.load_model(args)
    timed = []
    for tp, pp, ep in itertools.product(range(1, 65), repeat=3):
        if 64 % (tp * pp) or (64 // (tp * pp)) % ep:
            continue
        try:
            row = planner.cost(model, args, 64 // (tp * pp), tp, pp, ep)
        except ValueError:  # a divisibility rule (layers, experts, batch) or tp beyond a node
            continue
        if row["fits"]:
            comm = sum(row[f"t_{k}"] for k in ("dp", "tp", "pp", "ep"))
            timed.append((oracle_pipeline_seconds(model, args, row)[0] + comm, (row["dp"], tp, pp, ep)))
    assert min(timed)[1] == (best["dp"], best["tp"], best["pp"], best["ep"])
    if model_name == "mixtral-8x7b":
        assert results["params"] == 46_702_792_704
        assert any(r["ep"] > 1 and r["ep_GB_sent"] > 0 for r in results["candidates"])  # EP considered, costed


@pytest.mark.parametrize("zero, fits", [("1", True), ("0", False)])
def test_planner_with_one_layout_recommends_nothing(zero, fits, tmp_path, monkeypatch, capsys):
    """--layout costs one layout: the verdict line names it as the one given (never "recommended", which would
    claim a comparison), and says whether it fits, as the JSON's total_GiB against the usable memory decides."""
    out = tmp_path / "plan.json"
    monkeypatch.setattr("sys.argv", ["parallel_planner.py", "--model", "llama-3-8b", "--gpus", "8", "--global-batch",
                                     "64", "--layout", "8", "1", "1", "1", "--zero-stage", zero, "--json", str(out)])
    assert planner.main() == 0
    printed = capsys.readouterr().out
    (row,) = json.loads(out.read_text())["results"]["candidates"]
    assert (row["total_GiB"] <= 80 * 0.9) == fits
    assert "recommended" not in printed and "closest:" not in printed, printed
    if fits:
        assert "\nthe one layout given: dp=8 tp=1 pp=1 ep=1" in printed, printed
    else:
        assert "\nthe one layout given does not fit in 72.0 GiB per GPU" in printed, printed
        assert "\nit: dp=8 tp=1 pp=1 ep=1" in printed, printed


@pytest.mark.parametrize("argv", [
    ["--gpus", "0"], ["--model", "gpt-5"], ["--layout", "3", "3", "3", "3"], ["--model", "custom"],
    ["--mfu", "0"], ["--gpus", "7", "--model", "llama-3-8b"], ["--model", "custom", "--layers", "2", "--hidden", "10",
                                                               "--heads", "3", "--ffn", "8"],
])
def test_planner_bad_inputs_are_usage_errors(argv, monkeypatch, capsys):
    """Bad flags and impossible clusters (7 GPUs: no valid layout) end as usage errors, never a ZeroDivisionError."""
    monkeypatch.setattr("sys.argv", ["parallel_planner.py", *argv])
    with pytest.raises((SystemExit, planner.cli.UsageError)) as err:
        planner.main()
    if err.type is SystemExit:
        assert err.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------------------------- its pictures
# Published shapes (the models' config.json), typed here rather than read from the planner:
# (layers, hidden, heads, kv heads, head dim, MLP size, vocab, experts, top-k)
SHAPES = {"llama-3-70b": (80, 8192, 64, 8, 128, 28672, 128256, 1, 1),
          "mixtral-8x7b": (32, 4096, 32, 8, 128, 14336, 32000, 8, 2)}


def planner_results(argv: list[str]) -> tuple[dict, str]:
    """The planner's main() in this process with `argv`: (its --json results, what it printed)."""
    import contextlib
    import io
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        out, printed = f"{tmp}/plan.json", io.StringIO()
        mp.setattr("sys.argv", ["parallel_planner.py", *argv, "--json", out])
        with contextlib.redirect_stdout(printed):
            assert planner.main() == 0
        return json.loads(open(out).read())["results"], printed.getvalue()


@pytest.fixture(scope="module")
def default_plan(tmp_path_factory) -> tuple[dict, str, object]:
    """The lesson's run (Llama-3-70B on 64 GPUs), with its figures."""
    plots = tmp_path_factory.mktemp("planner_figures")
    results, printed = planner_results(["--plot-dir", str(plots)])
    return results, printed, plots


def accepted_layouts(model_name: str, gpus=64, per_node=8, batch=512, micro=1) -> set[tuple[int, int, int, int]]:
    """Brute force over every (dp, tp, pp, ep) with dp*tp*pp = gpus, kept when the planner's rules (as its lesson
    states them) accept it: tp divides the heads and tiles a node, pp divides the layers, ep divides dp and the
    experts (ep = 1 without experts), and dp micro-batches of `micro` sequences divide the global batch."""
    layers, _, heads, *_, experts, _ = SHAPES[model_name]
    return {(dp, tp, pp, ep) for dp in range(1, gpus + 1) for tp in range(1, gpus + 1) for pp in range(1, gpus + 1)
            for ep in range(1, gpus + 1)
            if dp * tp * pp == gpus and heads % tp == 0 and per_node % tp == 0 and layers % pp == 0
            and dp % ep == 0 and experts % ep == 0 and batch % (dp * micro) == 0}


@pytest.mark.parametrize("model_name", ["llama-3-70b", "mixtral-8x7b"])
def test_layouts_picture_draws_every_accepted_layout_split_into_its_times(model_name, default_plan):
    """layouts.png: one bar per layout the rules accept (brute force above), fastest first; each bar's pieces add
    up to its step time, and that time is the oracle's: the 1F1B pipeline walked on an event clock with flops
    from a transformers model of the shape (oracle_pipeline_seconds), plus each dimension's bytes over NVLink
    when its group of consecutive ranks fits in a node, else the network. The recommended bar is the fastest that
    fits."""
    results = default_plan[0] if model_name == "llama-3-70b" else planner_results(["--model", model_name])[0]
    bars = results["picture"]["layouts"]
    assert {(b["dp"], b["tp"], b["pp"], b["ep"]) for b in bars} == accepted_layouts(model_name)
    assert len(bars) == len({(b["dp"], b["tp"], b["pp"], b["ep"]) for b in bars})
    assert [b["t_total"] for b in bars] == sorted(b["t_total"] for b in bars)
    args = planner.Settings(model=model_name)
    model = planner.load_model(args)
    sent = {(r["dp"], r["tp"], r["pp"], r["ep"]): r for r in results["candidates"]}
    for b in bars:
        parts, row = b["components"], sent[(b["dp"], b["tp"], b["pp"], b["ep"])]
        span = {"tp": b["tp"], "dp": b["tp"] * b["dp"], "pp": 64, "ep": b["tp"] * b["ep"]}
        comm = {d: row[f"{d}_GB_sent"] * 1e9 / (450e9 if span[d] <= 8 else 50e9) for d in span}
        pipeline, _ = oracle_pipeline_seconds(model, args, {"tp": b["tp"], "pp": b["pp"], "micro": 512 // b["dp"]})
        assert sum(parts.values()) == pytest.approx(pipeline + sum(comm.values()), rel=1e-9), b
        assert b["t_total"] == pytest.approx(sum(parts.values()), rel=1e-12), b
        assert parts["compute"] + parts["bubble"] + parts["imbalance"] == pytest.approx(pipeline, rel=1e-9), b
        assert {d: parts.get(d, 0.0) for d in span} == pytest.approx(comm, rel=1e-9), b
    (best,) = [b for b in bars if b["recommended"]]
    assert best == min((b for b in bars if b["total_GiB"] <= 80 * 0.9), key=lambda b: b["t_total"])


def test_stages_picture_is_paced_by_the_head_and_ends_at_the_closed_form(default_plan):
    """stages.png: the lesson's pp = 16 layout (the fastest that fits). Its stage times against flops counted here
    from the published shape (6 per weight and token; 5 layers a stage, the V x h head on the last), and its 1F1B
    timeline against the closed form sum(t) + (m - 1) max(t) for the slowest stage last; every op as long as its
    stage's forward (1/3) or backward (2/3) and after the op it depends on."""
    results, printed, plots = default_plan
    pic = results["picture"]["stages"]
    fitting16 = [b for b in results["picture"]["layouts"] if b["pp"] == 16 and b["total_GiB"] <= 72.0]
    fastest16 = min(fitting16, key=lambda b: b["t_total"])
    assert pic["layout"] == fastest16["layout"] == "dp=2 tp=2 pp=16" and pic["pp"] == 16
    layers, h, heads, kv, hd, ffn, vocab, _, _ = SHAPES["llama-3-70b"]
    layer_w = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * ffn  # q, k, v, o; gate, up, down
    tokens, rate = 4096, 2 * 989e12 * 0.4  # one sequence per micro-batch; tp = 2 GPUs a stage
    want = [6 * tokens * (layer_w * layers // 16 + (h * vocab if i == 15 else 0)) / rate * 1e3 for i in range(16)]
    assert pic["stage_ms"] == pytest.approx(want, rel=1e-9)
    ratio = 16 * (layer_w * 5 + h * vocab) / (layer_w * layers + h * vocab)  # last stage over the mean
    assert pic["last_over_mean"] == pytest.approx(ratio, rel=1e-9) and ratio > 1.2
    m, t = pic["timeline_m"], pic["stage_ms"]
    assert m == 6 and pic["end_ms"] == pytest.approx(sum(t) + (m - 1) * max(t), rel=1e-12)
    end = {}
    for s, events in enumerate(pic["events"]):
        assert sorted((e["kind"], e["mb"]) for e in events) == sorted((k, i) for k in "FB" for i in range(m))
        for e, nxt in zip(events, events[1:]):
            assert nxt["start"] >= e["end"] - 1e-9  # one op at a time on a stage
        for e in events:
            assert e["end"] - e["start"] == pytest.approx(t[s] / 3 if e["kind"] == "F" else 2 * t[s] / 3)
            end[(e["kind"], e["mb"], s)] = e["end"]
        assert pic["idle_ms"][s] == pytest.approx(pic["end_ms"] - m * t[s])
    for kind, i, s in end:
        start = next(e["start"] for e in pic["events"][s] if (e["kind"], e["mb"]) == (kind, i))
        dep = ("F", i, s - 1) if kind == "F" else ("B", i, s + 1) if s < 15 else ("F", i, s)
        assert start >= end.get(dep, 0.0) - 1e-9
    for name in ("layouts", "stages"):
        assert (plots / f"{name}.png").is_file() and f"figure: {plots / f'{name}.png'}" in printed


# ----------------------------------------------------------------------------------------------- the 3-D mesh
@pytest.mark.parametrize("dp, tp, pp", [(2, 2, 2), (3, 1, 2), (1, 4, 1), (2, 3, 4)])
def test_mesh_coordinates_match_a_numpy_array_of_ranks(dp, tp, pp):
    """The oracle: np.arange(world).reshape(pp, dp, tp); a group along a dim is a 1-D slice through it."""
    import numpy as np

    from mlsys.mesh import ParallelMesh

    grid = np.arange(dp * tp * pp).reshape(pp, dp, tp)
    mesh = ParallelMesh(dp, tp, pp)
    for (i, j, k), rank in np.ndenumerate(grid):
        assert mesh.coords(int(rank)) == {"pp": i, "dp": j, "tp": k}
        assert mesh.rank_of(i, j, k) == rank
        assert mesh.group_ranks("pp", int(rank)) == grid[:, j, k].tolist()
        assert mesh.group_ranks("dp", int(rank)) == grid[i, :, k].tolist()
        assert mesh.group_ranks("tp", int(rank)) == grid[i, j, :].tolist()
    for dim, axis in (("pp", 0), ("dp", 1), ("tp", 2)):
        slices = sorted(np.moveaxis(grid, axis, -1).reshape(-1, grid.shape[axis]).tolist())
        assert sorted(mesh.all_groups(dim)) == slices
    with pytest.raises(ValueError):
        ParallelMesh(0, 1, 1)
    with pytest.raises(ValueError):
        mesh.coords(dp * tp * pp)


def assert_picture_is_the_mesh(picture: dict, dp: int, tp: int, pp: int) -> None:
    """mesh.png against the oracle np.arange(world).reshape(pp, dp, tp): every rank drawn where the picture's own
    labels (its panel's stage, the nearest tp column tick and dp row tick) give its coordinates; the ranks inside
    each solid outline are a TP group, inside each dashed one a DP group; one fill colour per PP group."""
    grid = np.arange(dp * tp * pp).reshape(pp, dp, tp)
    assert sorted(c["rank"] for c in picture["cells"]) == list(range(dp * tp * pp))

    def nearest(ticks: list[dict], at: float) -> int:
        return int(min(ticks, key=lambda t: abs(t["at"] - at))["label"].split()[1])

    for c in picture["cells"]:
        (stage,) = [pn["stage"] for pn in picture["panels"] if pn["x0"] < c["x"] < pn["x1"]]
        assert grid[stage, nearest(picture["yticks"], c["y"]), nearest(picture["xticks"], c["x"])] == c["rank"], c

    def inside(o: dict) -> list[int]:
        return sorted(c["rank"] for c in picture["cells"] if o["x0"] < c["x"] < o["x1"] and o["y0"] < c["y"] < o["y1"])

    for dim, axis in (("tp", 2), ("dp", 1)):
        want = sorted(np.moveaxis(grid, axis, -1).reshape(-1, grid.shape[axis]).tolist())
        assert sorted(inside(o) for o in picture["outlines"] if o["dim"] == dim) == want, dim
    fills: dict[str, list[int]] = {}  # the colour each cell was filled with -> its ranks
    for c in picture["cells"]:
        fills.setdefault(c["fill"], []).append(c["rank"])
    assert sorted(sorted(v) for v in fills.values()) == sorted(grid.reshape(pp, -1).T.tolist())


@pytest.mark.parametrize("dp, tp, pp", [(2, 3, 2), (3, 1, 2), (1, 2, 3)])
def test_mesh_picture_places_every_rank_by_its_coordinates(dp, tp, pp, tmp_path):
    """The drawing alone, for shapes the test run does not use (no dimension twice the same size)."""
    from mlsys.mesh import ParallelMesh

    mesh3d = load_script(CH07 / "mesh_3d.py")
    mesh = ParallelMesh(dp, tp, pp)
    args = mesh3d.Settings(world_size=dp * tp * pp, dp=dp, tp=tp, pp=pp, plot_dir=str(tmp_path))
    picture = mesh3d.draw(args, {dim: mesh.all_groups(dim) for dim in ("dp", "tp", "pp")})
    assert (tmp_path / "mesh.png").is_file()
    assert_picture_is_the_mesh(picture, dp, tp, pp)


@pytest.mark.timeout(120)
def test_mesh_3d_run_equals_single_process(tmp_path):
    """4 ranks as dp=1 x tp=2 x pp=2 (the suite's smoke run covers 2x2x2): groups checked against
    init_device_mesh inside the run, loss and every gradient/parameter shard against one process, and the
    picture the run recorded in its JSON against the numpy oracle."""
    out = tmp_path / "mesh.json"
    proc = run([CH07 / "mesh_3d.py", "-w", "4", "--dp", "1", "--tp", "2", "--pp", "2", "--steps", "1",
                "--seq-len", "8", "--json", out, "--plot-dir", tmp_path], timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "mesh.png").is_file() and f"figure: {tmp_path / 'mesh.png'}" in proc.stdout
    r = json.loads(out.read_text())["results"]
    assert r["groups"]["tp"] == [[0, 1], [2, 3]] and r["groups"]["pp"] == [[0, 2], [1, 3]]
    assert_picture_is_the_mesh(r["picture"], 1, 2, 2)
    step = r["steps"][0]
    assert step["loss_3d"] == pytest.approx(step["loss_single"], rel=1e-5)
    assert step["max_grad_diff"] < 1e-5 and step["max_param_diff"] < 1e-5
