"""Chapter 5 recomputation: what autograd keeps, measured, against the Korthikanti et al. count and exact tensor
sizes; checkpointed gradients against the model's own forward and backward. Also mixed precision's runs, and local
SGD / DiLoCo: bytes per round, the outer step against torch's, and the replicas' drift (figure replica_drift.png)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import load_script, run, scripts_dir, smoke_run
from mlsys import memory
from mlsys.model import GPT, GPTConfig

SCRIPT = scripts_dir(5) / "recompute.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch, seq", [(2, 64), (3, 96)])
def test_kept_bytes_match_the_tensor_sizes_and_the_count(batch: int, seq: int, tmp_path) -> None:
    out = tmp_path / "r.json"
    proc = run([SCRIPT, "--batch", batch, "--seq", seq, "--layers", 1, "--repeats", 1, "--json", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    kept = json.loads(out.read_text())["results"]["kept_bytes"]
    h, a = 128, 4  # the "small" preset
    assert kept["full"] == batch * seq * h * 4  # the block's fp32 input, nothing else
    assert kept["none"] - kept["selective"] == a * seq * seq * batch * 4  # exactly the (s x s) probabilities
    assert kept["fused"] - kept["selective"] == a * seq * batch * 4  # the fused kernel's log-sum-exp per row
    for setting, recompute in (("none", "none"), ("selective", "selective")):
        count = memory.activation_bytes_per_layer(seq, batch, h, a, recompute=recompute, dtype_bytes=4,
                                                  dropout=False)
        assert kept[setting] == pytest.approx(count, rel=0.01), setting  # LayerNorm's statistics are the rest


@pytest.mark.timeout(120)
def test_the_load_average_quoted_is_the_one_printed(monkeypatch, capsys, tmp_path) -> None:
    """The lesson quotes --json's load_average beside the printed listing: both must be the same reading. Every
    call of the load average here returns a new value, so a script that reads it once per line fails."""
    import sys

    rc = load_script(SCRIPT)
    readings = iter(range(1000))
    monkeypatch.setattr(rc.bench, "load_average", lambda: f"load average {next(readings)}.00 on 2 cores")
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--smoke", "--json", str(out)])
    assert rc.main() == 0
    quoted = json.loads(out.read_text())["results"]["load_average"]
    printed = [line for line in capsys.readouterr().out.splitlines() if "load average" in line]
    assert len(printed) == 2 and all(f"({quoted})" in line for line in printed), (quoted, printed)


def test_the_count_at_the_papers_defaults_is_table_2() -> None:
    s, b, h, a = 2048, 1, 4096, 32
    assert memory.activation_bytes_per_layer(s, b, h, a) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert memory.activation_bytes_per_layer(s, b, h, a, tp=8) == pytest.approx(
        s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8)))


@pytest.mark.parametrize("setting", ["none", "fused", "selective", "full"])
def test_recomputation_leaves_the_gradients_of_the_plain_model(setting: str) -> None:
    mod = load_script(SCRIPT)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny")).train()
    idx = torch.randint(model.config.vocab_size, (2, 32))
    targets = torch.randint(model.config.vocab_size, (2, 32))
    _, loss = model(idx, targets)  # the model's own forward, no recomputation
    loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    _, grads = mod.one_step(model, setting, idx, targets)
    for name, g in grads.items():
        torch.testing.assert_close(g, plain[name], rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------- mixed precision
MIXED = scripts_dir(5) / "mixed_precision.py"


def test_underflow_shares_match_numpy_float16() -> None:
    import numpy as np

    mod = load_script(MIXED)
    values = torch.tensor([1e-9, -2e-8, 4e-8, 1e-7, -3e-6, 5e-5, 1e-3, 0.5, 300.0, 0.0, 7e4], dtype=torch.float32)
    for scale in (1.0, 2.0**8, 2.0**16):
        got = mod.underflow(values, torch.float16, scale)
        scaled = values.numpy().astype(np.float64)[values.numpy() != 0] * scale
        with np.errstate(over="ignore"):
            cast = scaled.astype(np.float16)
        tiny = np.finfo(np.float16).smallest_normal
        assert got["zero"] == pytest.approx(np.mean(cast == 0))
        assert got["subnormal"] == pytest.approx(np.mean((cast != 0) & (np.abs(cast) < tiny)))
        assert got["inf"] == pytest.approx(np.mean(np.isinf(cast)))


@pytest.mark.timeout(150)
def test_fsdp2_bf16_policies_halve_the_bytes_and_track_fp32(smoke_cache) -> None:
    proc = smoke_run(smoke_cache, MIXED)  # the smoke test's run: 2 ranks, the default
    assert proc["code"] == 0, proc["stderr"][-3000:]
    assert proc["json"]["settings"]["world_size"] == 2
    result = proc["json"]["results"]
    runs = {r["run"]: r for r in result["runs"]}
    assert runs["fsdp-bf16"]["all_gather MiB"] * 2 == runs["fp32"]["all_gather MiB"] > 0
    assert runs["fsdp-bf16"]["reduce_scatter MiB"] == runs["fp32"]["reduce_scatter MiB"] > 0
    assert result["fsdp_bf16_all_bytes_ratio"] == 0.5
    assert result["max_gap"] <= 0.05
    assert result["bf16_zero"] == 0.0  # bf16 has fp32's exponent range
    # GradScaler starts at its default init_scale and, far fewer steps than its growth_interval (2000) in, can only
    # have halved once per skipped step: the line the lesson reads gives both ends
    assert result["fp16_scale_start"] == torch.amp.GradScaler("cpu").get_scale() == 2.0**16
    assert result["fp16_scale_end"] == result["fp16_scale_start"] / 2 ** len(result["fp16_skipped_steps"])


# ----------------------------------------------------------------------------------------------- local SGD, DiLoCo
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.sweep), 3])  # W=2: make sweep
def test_local_sgd_and_diloco_send_one_model_per_round(world_size: int, tmp_path) -> None:
    from mlsys.model import num_params

    out = tmp_path / "r.json"
    proc = run([scripts_dir(5) / "local_sgd.py", "-w", world_size, "--steps", 12, "--sync-every", 4, "--json", out,
                "--plot-dir", tmp_path], timeout=140)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())["results"]
    model_bytes = 4 * num_params(GPT(GPTConfig.preset("tiny", n_layer=2)))  # tied embedding counted once
    rows = {r["run"]: r for r in result["rows"]}
    assert rows["sync"]["MiB all-reduced per rank"] * 2**20 == pytest.approx(12 * model_bytes)
    for run_name in ("local", "diloco"):
        assert rows[run_name]["MiB all-reduced per rank"] * 2**20 == pytest.approx(3 * model_bytes)
    assert result["identity_gap"] < 1e-5
    assert (tmp_path / "loss_vs_bytes.png").exists()


def _one_rank_local_sgd(steps: int = 12, sync_every: int = 4):
    from types import SimpleNamespace

    from mlsys.data import load_splits, shard

    ls = load_script(scripts_dir(5) / "local_sgd.py")
    args = ls.Settings(steps=steps, sync_every=sync_every, batch_size=2, seq_len=16)
    train_tokens, val = load_splits(400)
    return ls, args, shard(train_tokens, 0, 1), val, SimpleNamespace(rank=0, world_size=1)


@pytest.mark.timeout(60)
def test_local_sgd_bytes_counted_at_the_collective(monkeypatch) -> None:
    """Count the bytes another way than the script's own counter: every tensor handed to
    torch.distributed.all_reduce, recorded by a wrapper around it. sync sends one model per step, local and diloco
    one model per round of H steps, and the script's counter agrees."""
    import torch.distributed as dist

    from mlsys.model import num_params

    ls, args, tokens, val, ctx = _one_rank_local_sgd()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        handed: list[int] = []
        real = dist.all_reduce

        def counting(tensor, *a, **k):
            handed.append(tensor.numel() * tensor.element_size())
            return real(tensor, *a, **k)

        monkeypatch.setattr(dist, "all_reduce", counting)
        model_bytes = 4 * num_params(GPT(GPTConfig.preset("tiny", n_layer=2)))
        for run_name, messages in (("sync", 12), ("local", 3), ("diloco", 3)):
            handed.clear()
            r = ls.train(ctx, args, tokens, val, run_name)
            assert handed == [model_bytes] * messages, run_name
            assert r["bytes"] == sum(handed)
    finally:
        dist.destroy_process_group()


def test_diloco_outer_step_is_torch_nesterov_sgd_and_the_planted_bug_is_not(monkeypatch) -> None:
    """outer_step against torch.optim.SGD(nesterov=True) over several rounds of random outer gradients; the planted
    bug (plain momentum: drop the Nesterov term) fails both here and in the script's own per-round check."""
    import torch.distributed as dist

    from mlsys.cli import SelfCheckFailed

    ls, args, tokens, val, ctx = _one_rank_local_sgd(steps=8, sync_every=4)

    def planted(global_params, buffer, delta):
        buffer.mul_(ls.OUTER_MOMENTUM).add_(delta)
        global_params -= ls.OUTER_LR * buffer  # heavy-ball momentum: the Nesterov look-ahead is gone

    gen = torch.Generator().manual_seed(0)
    deltas = [torch.randn(1000, generator=gen) * 1e-2 for _ in range(4)]
    for step_fn, should_match in ((ls.outer_step, True), (planted, False)):
        params, buffer = torch.randn(1000, generator=gen), torch.zeros(1000)
        copy, opt = ls.torch_outer_optimizer(params)
        gap = 0.0
        for delta in deltas:
            step_fn(params, buffer, delta)
            copy.grad = delta.clone()
            opt.step()
            gap = max(gap, (params - copy.detach()).abs().max().item())
        assert (gap < 1e-6) == should_match, (step_fn, gap)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr(ls, "outer_step", planted)
        with pytest.raises(SelfCheckFailed, match="outer step"):
            ls.train(ctx, args, tokens, val, "diloco")
    finally:
        dist.destroy_process_group()


DRIFT_ROUNDING = 1e-5  # float32 weights of norm about 3: a distance this small is rounding, not drift


def test_replicas_drift_between_averagings_and_agree_after_each(smoke_cache) -> None:
    """The smoke run (two ranks, H = 4 of 8 steps): sync's replicas never differ; local's and diloco's differ after
    every step and agree again right after each averaging, at steps H, 2H. At W = 2, theta_r - mean is
    +-(theta_0 - theta_1) / 2, so both ranks are the same distance from the mean."""
    proc = smoke_run(smoke_cache, scripts_dir(5) / "local_sgd.py")
    assert proc["code"] == 0, proc["stderr"][-3000:]
    settings, drift = proc["json"]["settings"], proc["json"]["results"]["drift"]
    steps, h = settings["steps"], settings["sync_every"]
    assert settings["world_size"] == 2 and steps > h
    for run_name, d in drift.items():
        after_step, after_sync = np.array(d["after_step"]), np.array(d["after_sync"])
        assert after_step.shape == (steps, 2)
        both = np.concatenate([after_step, after_sync.reshape(-1, 2)])
        np.testing.assert_allclose(both[:, 0], both[:, 1], rtol=1e-6, atol=DRIFT_ROUNDING)  # W = 2: equal
        if run_name == "sync":  # gradients averaged before every step: identical replicas throughout
            assert d["sync_steps"] == [] and after_step.max() < DRIFT_ROUNDING
            continue
        assert d["sync_steps"] == list(range(h, steps + 1, h))
        assert after_sync.shape == (steps // h, 2) and after_sync.max() < DRIFT_ROUNDING  # agree after averaging
        assert after_step.min() > 1000 * DRIFT_ROUNDING, run_name  # apart after every local step, sync steps too
    figure = Path(proc["plot_dir"]) / "replica_drift.png"
    assert figure.exists() and f"figure: {figure}" in proc["stdout"]


def test_one_rank_has_nothing_to_drift() -> None:
    """At W = 1 every rank is the mean: every distance is exactly 0, in every run."""
    import torch.distributed as dist

    ls, args, tokens, val, ctx = _one_rank_local_sgd(steps=8, sync_every=4)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for run_name in ("sync", "local", "diloco"):
            d = ls.train(ctx, args, tokens, val, run_name)["drift"]
            assert len(d["after_step"]) == 8 and len(d["after_sync"]) == (0 if run_name == "sync" else 2)
            assert all(v == 0.0 for row in d["after_step"] + d["after_sync"] for v in row)
    finally:
        dist.destroy_process_group()
