"""Chapter 9 oracles: paged attention against the contiguous GPT, the engine's bookkeeping, preemption and prefix
caching against uncached / unconstrained runs (each script's --json), and the calculator's arithmetic by hand."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import ROOT, load_script, run
from mlsys import kv_memory as kvm
from mlsys.model import GPT, GPTConfig

CH09 = ROOT / "tutorial" / "part3-inference" / "chapter09-kv-cache" / "scripts"


def run_json(tmp_path_factory, script: str, *flags: str) -> dict:
    out = tmp_path_factory.mktemp(script.split(".")[0]) / "r.json"
    proc = run([CH09 / script, "--json", out, *flags], timeout=170)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())["results"]


@pytest.fixture(scope="module")
def paged(tmp_path_factory) -> dict:
    return run_json(tmp_path_factory, "paged_kv.py", "--smoke")


@pytest.fixture(scope="module")
def preempt(tmp_path_factory) -> dict:
    return run_json(tmp_path_factory, "preemption.py", "--smoke")


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> dict:
    return run_json(tmp_path_factory, "prefix_cache.py", "--smoke")


# ------------------------------------------------------------------------------------------ paged attention
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_paged_attention_equals_contiguous_gpt(block_size: int) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny")).eval()
    mod = load_script(CH09 / "paged_kv.py")
    # lengths ending before, on and after block boundaries; decode steps cross into new blocks
    worst = mod.paged_vs_contiguous(model, [1, 2, 3, 4, 5, 15, 16, 17, 33], block_size, decode_steps=4, seed=1)
    assert worst < 1e-5


def test_bookkeeping_demo_counts_blocks() -> None:
    mod = load_script(CH09 / "paged_kv.py")
    out = mod.bookkeeping_demo(block_size=4, num_blocks=10)
    # A: 10 prompt + 3 decoded = 13 tokens -> 4 blocks; B: 4 + 3 = 7 tokens -> 2 blocks; A freed -> 8 free
    assert out == {"blocks_A": 4, "blocks_B": 2, "free_after": 8}


@pytest.mark.timeout(180)
def test_paged_kv_script(paged: dict) -> None:
    assert paged["paged_vs_contiguous_max_abs_diff"] < 1e-4
    rows = {r["block_size"]: r for r in paged["computed_waste"]}
    assert rows[1]["paged waste %"] == 0 and rows[1]["paged slots"] == rows[1]["tokens used"]
    for r in rows.values():  # paged never holds more than a reservation of the longest, and waste grows with bs
        assert r["paged slots"] <= r["reserved slots"] or r["block_size"] > 16
    assert [rows[b]["paged waste %"] for b in sorted(rows)] == sorted(rows[b]["paged waste %"] for b in rows)
    p, r = paged["runs"]["paged"], paged["runs"]["reserved"]
    assert r["peak_running"] == paged["reserved_seats"] and p["peak_running"] > r["peak_running"]
    assert paged["paged_waste"] < paged["reserved_waste"]
    assert paged["concurrency_gain"] == pytest.approx(p["mean_running"] / r["mean_running"])
    assert p["steps"] < r["steps"]


# ------------------------------------------------------------------------------------------ preemption
@pytest.mark.timeout(180)
def test_preemption_script(preempt: dict) -> None:
    tight, roomy = preempt["tight"], preempt["roomy"]
    assert roomy["num_preemptions"] == 0 and tight["num_preemptions"] > 0
    assert sum(tight["preemptions_per_request"]) == tight["num_preemptions"]
    assert tight["reasons"] == ["length"] * len(tight["reasons"])  # outputs equal: checked by the script (exit 0)
    assert preempt["recomputed_tokens"] == tight["prefill_tokens"] - roomy["prefill_tokens"] > 0


def test_recompute_vs_swap_formulas() -> None:
    mod = load_script(CH09 / "preemption.py")
    args = mod.Settings(gpu_tflops=989.0, mfu=0.5, pcie_gbps=50.0)
    s = kvm.MODEL_SHAPES["llama-3-8b"]
    out = mod.computed_recompute_vs_swap(s, 2048, args)
    assert out["kv_bytes"] == 2048 * 131072  # 256 MiB
    assert out["swap_s"] == pytest.approx(2 * 2048 * 131072 / 50e9)
    assert out["recompute_s"] == pytest.approx(2 * 8_030_261_248 * 2048 / (989e12 * 0.5))
    ratio = out["recompute_s"] / out["swap_s"]  # = params * bw / (flops * kv_bytes_per_token), for any n
    assert ratio == pytest.approx(8_030_261_248 * 50e9 / (989e12 * 0.5 * 131072))
    other = mod.computed_recompute_vs_swap(s, 64, args)
    assert other["recompute_s"] / other["swap_s"] == pytest.approx(ratio)


def test_measured_swap_restores_the_cache() -> None:
    mod = load_script(CH09 / "preemption.py")
    out = mod.measure_recompute_vs_swap(GPT(GPTConfig.preset("tiny")).eval(), 20, 8, "cpu", repeats=1)
    # 3 blocks of 8 x 2 layers x 2 heads x 16 dims x 4 B, for K and V
    assert out["kv_bytes"] == 2 * 2 * 3 * 8 * 2 * 16 * 4 and out["recompute_s"] > 0 and out["swap_s"] > 0


# ------------------------------------------------------------------------------------------ prefix caching
@pytest.mark.timeout(180)
def test_prefix_cache_script(prefix: dict) -> None:
    off, on = prefix["no cache"], prefix["prefix cache"]
    assert off["stats"]["prefix_hit_rate"] == 0 and off["prefilled_tokens"] == off["prompt_tokens"]
    hits = on["stats"]["prefix_hit_tokens"]
    assert hits > 0 and on["prefilled_tokens"] == on["prompt_tokens"] - hits
    assert on["stats"]["prefix_hit_rate"] == pytest.approx(hits / on["prompt_tokens"])
    assert prefix["prefill_tokens_saved"] == pytest.approx(hits / on["prompt_tokens"])
    assert prefix["full_hit_cached_tokens"] % 16 == 0 and prefix["full_hit_cached_tokens"] > 0
    assert prefix["freed_on_reset"] > 0
    assert on["stats"]["num_used_blocks"] == 0 and off["stats"]["num_used_blocks"] == 0


def test_prefix_workload_shares_the_system_prompt() -> None:
    mod = load_script(CH09 / "prefix_cache.py")
    system, prompts = mod.make_prompts(5, 2, seed=0)
    assert all(p[: len(system)] == system for p in prompts) and len({tuple(p) for p in prompts}) > 1
    assert system.count(1) == 2 and system.count(2) == 2  # two <bos> ... <eos> records


# ------------------------------------------------------------------------------------------ calculator
def test_calculator_row_by_hand() -> None:
    mod = load_script(CH09 / "kv_calculator.py")
    args = mod.Settings(prompt_len=1024, max_new_tokens=1024, block_size=16, reserve_fraction=0.1)
    row = mod.model_row(kvm.MODEL_SHAPES["llama-3-8b"], args, 80 * kvm.GIB)
    b = row["_bytes"]
    assert b["per_token"] == 131072 and b["per_token_mha"] == 4 * 131072
    assert b["per_request"] == 2048 * 131072  # 256 MiB
    assert b["weights"] == 2 * 8_030_261_248
    budget = 0.9 * 80 * kvm.GIB - 2 * 8_030_261_248
    assert b["kv_budget"] == pytest.approx(budget)
    assert row["max tokens"] == int(budget // (131072 * 16)) * 16
    assert row["max requests"] == int(budget // (131072 * 16)) // 128  # 2048 tokens = 128 blocks
    mqa = mod.model_row(kvm.MODEL_SHAPES["llama-3-8b"], mod.Settings(kv_heads=1), 80 * kvm.GIB)
    assert mqa["_bytes"]["per_token"] == 131072 // 8


def test_calculator_weights_too_big_and_bad_flags(tmp_path, monkeypatch, capsys) -> None:
    from mlsys import cli

    mod = load_script(CH09 / "kv_calculator.py")
    out = tmp_path / "r.json"
    monkeypatch.setattr("sys.argv", ["kv_calculator.py", "--model", "llama-3-70b", "--gpu-mem-gib", "24",
                                     "--json", str(out)])
    assert mod.main() == 0 and "do not fit" in capsys.readouterr().out
    assert json.loads(out.read_text())["results"]["models"]["llama-3-70b"]["max requests"] == 0
    for flags in (["--reserve-fraction", "1"], ["--gpu-mem-gib", "-1"], ["--gpu-mem-gib", "nan"],
                  ["--model", "gpt-5"], ["--block-size", "0"], ["--dtype", "fp7"], ["--prompt-len", "0"]):
        with pytest.raises(SystemExit) as exc:
            cli.parse(mod.Settings, argv=flags)
        assert exc.value.code == 2, flags
        assert len(capsys.readouterr().err.strip().splitlines()) == 1, flags
