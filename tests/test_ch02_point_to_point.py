"""Chapter 2 oracles: chain and ring values against numpy, the deadlock demo, the pipeline against one process."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import load_script, run, scripts_dir

CH02 = scripts_dir(2)


def load(name: str):
    return load_script(CH02 / f"{name}.py")


def numpy_chain(world_size: int, numel: int) -> np.ndarray:
    """Row r: what rank r holds after the chain, by literally passing the value along in a loop."""
    value, rows = np.arange(numel, dtype=np.float32), []
    for rank in range(world_size):
        value = value + rank  # rank 0 adds 0
        rows.append(value.copy())
    return np.stack(rows)


def numpy_ring(world_size: int, numel: int) -> np.ndarray:
    own = 100.0 * np.arange(world_size, dtype=np.float32)[:, None] + np.arange(numel, dtype=np.float32)
    return np.roll(own, 1, axis=0)  # row r receives row r-1


@pytest.mark.parametrize("world_size, numel", [(2, 1), (3, 5), (7, 2)])
def test_expected_values_match_numpy(world_size: int, numel: int) -> None:
    sr = load("send_recv")
    chain, ring = numpy_chain(world_size, numel), numpy_ring(world_size, numel)
    for rank in range(world_size):
        np.testing.assert_array_equal(sr.expected_chain(rank, numel).numpy(), chain[rank])  # start + r(r+1)/2
        np.testing.assert_array_equal(sr.expected_ring(rank, world_size, numel).numpy(), ring[rank])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.sweep), 3])  # W=2: make sweep
def test_chain_and_ring_values_on_real_ranks(world_size: int, tmp_path) -> None:
    out = tmp_path / "r.json"
    proc = run([CH02 / "send_recv.py", "-w", world_size, "--numel", 4, "--repeats", 2, "--json", out])
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())["results"]
    chain, ring = numpy_chain(world_size, 4), numpy_ring(world_size, 4)
    assert [p["rank"] for p in result["per_rank"]] == list(range(world_size))
    for rank, held in enumerate(result["per_rank"]):
        for name, value in held["values"].items():
            np.testing.assert_array_equal(value, chain[rank] if name.startswith("chain") else ring[rank], err_msg=name)
        assert set(held["values"]) == set(held["times_us"]) and all(t > 0 for t in held["times_us"].values())
    assert len(result["per_rank"][0]["values"]) == 5  # 2 chain + 3 ring patterns


@pytest.mark.timeout(60)
def test_naive_swap_deadlocks_and_the_fixed_ones_complete(tmp_path) -> None:
    out = tmp_path / "d.json"
    # a hang would outlive run()'s timeout and fail the test; no assert on how fast the machine is
    proc = run([CH02 / "deadlock.py", "--numel", 1 << 18, "--deadlock-timeout", 1.0, "--json", out], timeout=50)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())["results"]
    for rank, held in enumerate(result["per_rank"]):
        assert [a["numel"] for a in held["naive"]] == [1, 1 << 18]
        for attempt in held["naive"]:  # gloo never buffers a send: even one element deadlocks
            assert attempt["outcome"] in ("timed out", "peer timed out"), attempt
            assert attempt["seconds"] >= 0.9, attempt  # it waited out its 1 s timeout: a real deadlock
        for info in held["fixed"].values():
            assert info["from_rank"] == rank ^ 1
    assert "deadlocked: timed out after 1.0 s" in proc.stdout


def test_stage_split_covers_every_block_once() -> None:
    pipe = load("pipeline_handoff")
    for num_blocks in range(1, 9):
        for stages in range(1, num_blocks + 1):
            split = [list(pipe.stage_blocks(num_blocks, s, stages)) for s in range(stages)]
            assert sum(split, []) == list(range(num_blocks))
            assert max(map(len, split)) - min(map(len, split)) <= 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size, num_blocks", [pytest.param(2, 3, marks=pytest.mark.sweep), (3, 5)])
def test_pipeline_matches_one_process(world_size: int, num_blocks: int, tmp_path) -> None:
    out = tmp_path / "p.json"
    proc = run([CH02 / "pipeline_handoff.py", "-w", world_size, "--num-blocks", num_blocks, "--json", out])
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())["results"]
    assert result["max_abs_diff_output"] <= 1e-6 and result["max_abs_diff_grad"] <= 1e-6
    assert result["num_params_checked"] == 2 * num_blocks  # a weight and a bias per Linear
    assert sum(result["stages"], []) == list(range(num_blocks))
    # the pitfalls really produced a wrong value, and the fixed versions the right one
    pit = result["pitfalls"]
    assert pit["buffer reuse"]["buggy_received"] == [7.0] * 4 and pit["buffer reuse"]["fixed_received"] == [1.0] * 4
    assert pit["missing wait"]["buggy_received"] == [0.0] * 4 and pit["missing wait"]["fixed_received"] == [5.0] * 4


def test_reference_is_the_plain_model_on_autograd() -> None:
    """The script's single-process reference equals an independent autograd run of the same builder."""
    pipe = load("pipeline_handoff")
    args = pipe.Settings(world_size=2, num_blocks=3, hidden=8, batch_size=5, seed=3)
    out, grads = pipe.reference(args)
    model = pipe.build_model(3, 8, 3)
    x, target = pipe.make_batch(5, 3)
    params = dict(model.named_parameters())
    y = model(x)
    want = torch.autograd.grad(((y - target) ** 2).mean(), list(params.values()))
    torch.testing.assert_close(out, y.detach(), rtol=0, atol=0)
    for (name, _), g in zip(params.items(), want):
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(120)
def test_ring_where_every_rank_sends_first_deadlocks_and_the_fixes_do_not(tmp_path) -> None:
    out = tmp_path / "d.json"
    proc = run([CH02 / "deadlock.py", "-w", 3, "--ring", "--numel", 64, "--deadlock-timeout", 1, "--json", out])
    assert proc.returncode == 0, proc.stderr
    for rank, held in enumerate(json.loads(out.read_text())["results"]["per_rank"]):
        assert all(a["outcome"] != "completed" for a in held["naive"])  # gloo never buffers a send
        assert all(info["from_rank"] == (rank - 1) % 3 for info in held["fixed"].values())
    odd_pairs = run([CH02 / "deadlock.py", "-w", 3])
    assert odd_pairs.returncode == 2 and "--ring" in odd_pairs.stderr


# ----------------------------------------------------------------------------------------------- debugging
@pytest.mark.timeout(120)
def test_debug_tools_name_the_mismatch_the_late_rank_and_the_waiting_line(tmp_path) -> None:
    out = tmp_path / "r.json"
    proc = run([CH02 / "debugging.py", "-w", 3, "--smoke", "--json", out], timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())["results"]
    assert "Ranks 2 failed to pass monitoredBarrier" in result["barrier_error_rank0"]  # rank 2 is the late one
    frames = result["stack_rank0"]
    assert " in recv" in frames[0] and any("debugging.py" in f and "in where_it_hangs" in f for f in frames)
    assert "TensorShape=[4]" in proc.stdout and "TensorShape=[5]" in proc.stdout  # both sides of the mismatch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.sweep), 3])  # W=2: make sweep
def test_an_unchecked_mismatch_fails_the_job_without_hanging(world_size: int) -> None:
    proc = run([CH02 / "debugging.py", "--unchecked", "--smoke", "-w", world_size], timeout=100)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "killed by SIGABRT" in proc.stderr or "self-check failed" in proc.stderr, proc.stderr[-3000:]
