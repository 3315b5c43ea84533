"""Chapter 14 oracles for weight sync: the bucket plan by hand, pack against torch's own flatten, pack/unpack round
trips, bitwise broadcasts on real ranks (per tensor and bucketed) against weights every rank rebuilds from the seed,
the script's results, and (on a GPU) the CUDA IPC hand-over."""

from __future__ import annotations

import json

import pytest
import torch
from torch._utils import _flatten_dense_tensors

from conftest import load_script, run, scripts_dir
from mlsys.weight_sync import (
    broadcast_bucketed,
    broadcast_per_tensor,
    named_meta,
    pack,
    plan_buckets,
    tensors_equal,
    unique_parameters,
    unpack,
)

CH14 = scripts_dir(14)


def mixed_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of three dtypes and awkward shapes, rebuilt identically from the seed on any rank."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, shape in enumerate([(3, 5), (7,), (1,), (4, 4, 2), (33,), (2, 9), (100,)]):
        dtype = [torch.float32, torch.bfloat16, torch.int64][i % 3]
        if dtype is torch.int64:
            out[f"t{i}"] = torch.randint(-1000, 1000, shape, generator=g)
        else:
            out[f"t{i}"] = torch.randn(shape, generator=g).to(dtype)
    return out


def test_plan_buckets_hand_case() -> None:
    f32 = torch.float32
    meta = [("a", (10,), f32), ("b", (4, 5), f32), ("c", (5,), f32), ("d", (100,), f32), ("e", (2,), torch.bfloat16)]
    plan = plan_buckets(meta, bucket_bytes=120)  # 30 fp32 elements
    # a + b = 30 elements = 120 B fits exactly; c would make 140 B: new bucket; d (400 B) alone; e: its own dtype
    assert [[s.name for s in b.slots] for b in plan] == [["a", "b"], ["c"], ["d"], ["e"]]
    assert [b.nbytes for b in plan] == [120, 20, 400, 4]
    assert [(s.offset, s.numel) for s in plan[0].slots] == [(0, 10), (10, 20)]
    with pytest.raises(ValueError):
        plan_buckets(meta, 0)


@pytest.mark.parametrize("bucket_bytes", [1, 64, 300, 1 << 20])
def test_plan_covers_every_tensor_once_within_the_cap(bucket_bytes: int) -> None:
    tensors = mixed_tensors(0)
    plan = plan_buckets(named_meta(tensors), bucket_bytes)
    names = [s.name for b in plan for s in b.slots]
    assert sorted(names) == sorted(tensors)
    for b in plan:
        assert all(tensors[s.name].dtype == b.dtype for s in b.slots)
        assert [s.offset for s in b.slots] == [sum(x.numel for x in b.slots[:i]) for i in range(len(b.slots))]
        assert b.nbytes <= bucket_bytes or len(b.slots) == 1  # only a lone oversized tensor may exceed the cap


@pytest.mark.parametrize("bucket_bytes", [1, 64, 300, 1 << 20])
def test_pack_equals_torch_flatten_and_unpack_round_trips(bucket_bytes: int) -> None:
    tensors = mixed_tensors(1)
    into = {n: torch.zeros_like(t) for n, t in tensors.items()}
    for bucket in plan_buckets(named_meta(tensors), bucket_bytes):
        flat = pack(bucket, tensors)
        assert torch.equal(flat, _flatten_dense_tensors([tensors[s.name] for s in bucket.slots]))
        unpack(bucket, flat, into)
    assert tensors_equal(into, tensors) == []
    with pytest.raises(ValueError):
        unpack(plan_buckets(named_meta(tensors), 64)[0], torch.zeros(3), into)


def test_unique_parameters_sends_the_tied_head_once() -> None:
    from mlsys.model import GPT, GPTConfig

    model = GPT(GPTConfig.preset("tiny"))
    params = unique_parameters(model)
    assert "lm_head.weight" not in params and "wte.weight" in params
    # 2 embeddings + 12 tensors per block (2 LayerNorms, qkv, proj, fc, proj, each weight + bias) x 2 + ln_f (2)
    assert len(params) == 2 + 12 * 2 + 2 == 28
    assert sum(t.numel() for t in params.values()) == sum(p.numel() for p in model.parameters())


def sync_worker(ctx, bucket_sizes: list[int]) -> list:
    """Rank 0 holds the seeded tensors, the others zeros; after each sync every rank compares with the tensors it
    rebuilds itself from the seed (a single-process reference) and reports the names that differ."""
    expected = mixed_tensors(7)
    results = []
    for how in ["per_tensor", *bucket_sizes]:
        mine = {n: (t.clone() if ctx.rank == 0 else torch.zeros_like(t)) for n, t in expected.items()}
        objects = dict(mine)
        if how == "per_tensor":
            calls = broadcast_per_tensor(mine, src=0)
        else:
            calls = broadcast_bucketed(mine, plan_buckets(named_meta(mine), how), src=0)
        same_objects = all(mine[n] is objects[n] for n in mine)  # updated in place
        results.append((how, calls, tensors_equal(mine, expected), same_objects))
    gathered = [None] * ctx.world_size
    torch.distributed.all_gather_object(gathered, results)
    return gathered


@pytest.mark.timeout(120)
def test_broadcasts_are_bitwise_on_every_rank() -> None:
    from mlsys.launch import launch

    sizes = [8, 256, 1 << 20]
    gathered = launch(sync_worker, sizes, world_size=3, backend="gloo", timeout=60)
    expected_calls = [len(mixed_tensors(7))] + [len(plan_buckets(named_meta(mixed_tensors(7)), b)) for b in sizes]
    for rank, results in enumerate(gathered):
        for (how, calls, bad, same), want_calls in zip(results, expected_calls):
            assert bad == [], f"rank {rank}, {how}: tensors {bad} differ"
            assert same, f"rank {rank}, {how}: tensors replaced instead of updated in place"
            assert calls == want_calls


def test_sweep_mb_zero_alone_skips_the_sweep() -> None:
    """--help says `--sweep-mb 0` skips the sweep (the flag takes at least one value): 0 alone gives no sizes; a 0
    beside other sizes, or a negative size, is still bad usage (exit 2)."""
    from mlsys import cli

    mod = load_script(CH14 / "weight_sync.py")
    assert cli.parse(mod.Settings, mod.__doc__, argv=["--sweep-mb", "0"]).sweep_mb == []
    assert cli.parse(mod.Settings, mod.__doc__, argv=["--sweep-mb", "0.5", "2"]).sweep_mb == [0.5, 2.0]
    for bad in (["0", "1"], ["-1"]):
        with pytest.raises(SystemExit) as exc:
            cli.parse(mod.Settings, mod.__doc__, argv=["--sweep-mb", *bad])
        assert exc.value.code == 2


def test_reading_flags_rows_that_break_the_bytes_and_calls_order() -> None:
    """The generated sentences: a table row slower than the larger model below it is flagged as disturbed (the
    sync_time caption's rule); a sweep row with fewer calls that took longer than its neighbour is named."""
    mod = load_script(CH14 / "weight_sync.py")
    rows = [{"model": "tiny", "per-tensor ms": 2.91, "bucketed ms": 0.46},
            {"model": "draft", "per-tensor ms": 2.22, "bucketed ms": 0.57},
            {"model": "small", "per-tensor ms": 5.99, "bucketed ms": 1.84}]
    assert mod.disturbed_rows(rows, "per-tensor ms") == ["tiny"]
    assert mod.disturbed_rows(rows, "bucketed ms") == []
    assert mod.disturbed_text(rows) == "tiny per-tensor (slower than draft)"
    rows[0]["per-tensor ms"] = 1.0
    assert mod.disturbed_text(rows) == "none"
    rows[1]["bucketed ms"] = 2.0  # draft's bucketed time is above small's
    assert mod.disturbed_text(rows) == "draft bucketed (slower than small)"
    rows[0]["bucketed ms"] = 3.0  # tiny's too, above draft's 2.0; per-tensor rows come first
    rows[0]["per-tensor ms"] = 2.5
    assert mod.disturbed_text(rows) == ("tiny per-tensor (slower than draft), tiny bucketed (slower than draft), "
                                        "draft bucketed (slower than small)")


def test_sweep_order_names_the_rows_where_fewer_calls_took_longer() -> None:
    """The 'Bucket sweep, calls against time' line: the neighbouring rows, found here by hand, where the row with
    fewer calls took longer; equal call counts never count."""
    mod = load_script(CH14 / "weight_sync.py")
    sweep = [{"bucket MiB": 0.0625, "buckets": 67, "ms": 29.4}, {"bucket MiB": 0.25, "buckets": 67, "ms": 26.7},
             {"bucket MiB": 4.0, "buckets": 17, "ms": 20.3}, {"bucket MiB": 16.0, "buckets": 4, "ms": 33.9}]
    assert [(a["bucket MiB"], b["bucket MiB"]) for a, b in mod.sweep_order_breaks(sweep)] == [(4.0, 16.0)]
    assert mod.sweep_order_text(sweep) == ("fewer calls took longer at 16 MiB (4 calls, 33.9 ms) against 4 MiB "
                                           "(17 calls, 20.3 ms)")
    sweep[-1]["ms"] = 15.0  # the order holds; equal call counts (67, 67) never count as a break
    assert mod.sweep_order_breaks(sweep) == [] and mod.sweep_order_text(sweep) == "fewer calls always took less time"


def test_ratio_evidence_is_the_largest_ratio_of_the_unflagged_rows() -> None:
    """The lesson quotes this as the evidence that bucketing gains most on small models, so a row the Disturbed line
    flags must not supply it: here tiny's per-tensor time is above draft's (flagged, ratio too high), and the
    quoted ratio is the largest among the other rows, found here by hand."""
    mod = load_script(CH14 / "weight_sync.py")
    rows = [{"model": "tiny", "MiB": 0.11, "per-tensor ms": 2.91, "bucketed ms": 0.46},  # 6.33, flagged
            {"model": "draft", "MiB": 0.9, "per-tensor ms": 2.22, "bucketed ms": 0.57},  # 3.89
            {"model": "small", "MiB": 3.17, "per-tensor ms": 5.99, "bucketed ms": 1.84}]  # 3.26
    ev = mod.ratio_evidence(rows)
    assert (ev["model"], round(ev["speedup"], 2)) == ("draft", 3.89)
    assert ev["text"] == "draft (0.90 MiB) 3.89, bucketing faster"
    rows[1]["bucketed ms"] = 2.0  # now draft's bucketed time is flagged (above small's 1.84) and tiny is not:
    rows[0]["per-tensor ms"] = 1.8  # tiny 3.91 against small 3.26
    ev = mod.ratio_evidence(rows)
    assert ev["model"] == "tiny" and ev["text"] == "tiny (0.11 MiB) 3.91, bucketing faster"


def test_verdict_direction_follows_the_ratio() -> None:
    """The verdict printed first on the ratio line: bucketing faster above 1, slower below 1 (per-tensor time over
    bucketed time)."""
    mod = load_script(CH14 / "weight_sync.py")
    for per, buck in [(9.0, 1.0), (1.0, 1.1), (2.0, 2.0)]:
        want = "faster" if per > buck else "slower" if per < buck else "no faster"
        assert mod.verdict(per / buck) == f"{per / buck:.2f}, bucketing {want}"


def test_formula_estimate_names_the_larger_term_per_model() -> None:
    """Section 1's worked estimate: alpha = the smallest model's per-tensor ms / its tensors (no row is flagged
    here), 1/bw = the largest model's bucketed ms/MiB; each model is named by the larger of N*alpha and S/bw,
    computed here by hand."""
    mod = load_script(CH14 / "weight_sync.py")
    rows = [{"model": "tiny", "MiB": 0.111, "tensors": 28, "per-tensor ms": 5.6, "bucketed ms": 1.0},
            {"model": "small", "MiB": 3.17, "tensors": 52, "per-tensor ms": 60.0, "bucketed ms": 2.0},
            {"model": "medium", "MiB": 18.4, "tensors": 76, "per-tensor ms": 70.0, "bucketed ms": 3.0},
            {"model": "large", "MiB": 54.6, "tensors": 100, "per-tensor ms": 80.0, "bucketed ms": 41.0,
             "bucketed ms/MiB": 0.75}]
    est = mod.formula_estimate(rows)
    assert est["alpha_ms"] == pytest.approx(0.2) and est["ms_per_mib"] == 0.75 and est["alpha_model"] == "tiny"
    # by hand: tiny 5.6 vs 0.083, small 10.4 vs 2.38, medium 15.2 vs 13.8 (calls); large 20.0 vs 40.95 (bytes)
    assert [t["larger"] for t in est["terms"]] == ["calls", "calls", "calls", "bytes"]
    assert est["calls_larger"] == "tiny, small, medium" and est["bytes_larger"] == "large"
    t = {x["model"]: x for x in est["terms"]}
    assert (t["medium"]["N*alpha ms"], t["medium"]["S/bw ms"]) == pytest.approx((15.2, 13.8))
    assert (t["large"]["N*alpha ms"], t["large"]["S/bw ms"]) == pytest.approx((20.0, 40.95))
    rows[0]["per-tensor ms"] = 56.0  # alpha 2 ms: every model's calls outweigh its bytes
    assert mod.formula_estimate(rows)["bytes_larger"] == "no model"


def test_formula_alpha_skips_rows_flagged_as_disturbed() -> None:
    """alpha must not come from a row the Disturbed line flags (a disturbed time is too slow): it is the per-tensor
    ms / tensors of the first row whose times are both at or below the next row's, found here by hand."""
    mod = load_script(CH14 / "weight_sync.py")
    rows = [{"model": "tiny", "MiB": 0.11, "tensors": 28, "per-tensor ms": 6.0, "bucketed ms": 0.5},  # > draft's
            {"model": "draft", "MiB": 0.46, "tensors": 28, "per-tensor ms": 5.6, "bucketed ms": 2.0},  # > small's
            {"model": "small", "MiB": 3.17, "tensors": 52, "per-tensor ms": 10.4, "bucketed ms": 1.5},
            {"model": "large", "MiB": 54.6, "tensors": 100, "per-tensor ms": 40.0, "bucketed ms": 30.0,
             "bucketed ms/MiB": 0.55}]
    clean = [a for a, b in zip(rows, rows[1:])
             if a["per-tensor ms"] <= b["per-tensor ms"] and a["bucketed ms"] <= b["bucketed ms"]] + rows[-1:]
    assert clean[0]["model"] == "small"  # tiny flagged for per-tensor, draft for bucketed
    est = mod.formula_estimate(rows)
    assert est["alpha_model"] == "small" and est["alpha_ms"] == pytest.approx(10.4 / 52)
    assert est["text"].startswith("alpha ~ 0.200 ms per call (small, the smallest unflagged model)")


def test_formula_estimate_against_the_measured_time_per_row() -> None:
    """The constants are not upper bounds: a row's measured per-tensor time can come out above the estimate
    N*alpha + S/bw or below it. Per made-up row the estimate and the side are worked out here, and the printed
    sentence must name each row on the side its own values put it."""
    mod = load_script(CH14 / "weight_sync.py")
    rows = [{"model": "tiny", "MiB": 0.1, "tensors": 28, "per-tensor ms": 2.8, "bucketed ms": 0.5},
            {"model": "small", "MiB": 3.0, "tensors": 52, "per-tensor ms": 20.0, "bucketed ms": 2.0},
            {"model": "medium", "MiB": 18.0, "tensors": 76, "per-tensor ms": 15.0, "bucketed ms": 13.0},
            {"model": "large", "MiB": 50.0, "tensors": 100, "per-tensor ms": 55.0, "bucketed ms": 35.0,
             "bucketed ms/MiB": 0.7}]
    alpha, per_mib = 2.8 / 28, 0.7
    est = {r["model"]: r["tensors"] * alpha + r["MiB"] * per_mib for r in rows}
    # by hand: tiny 2.87 (measured 2.8, below), small 7.3 (20, above), medium 20.2 (15, below), large 45 (55, above)
    above = [r["model"] for r in rows if r["per-tensor ms"] > est[r["model"]]]
    below = [r["model"] for r in rows if r["per-tensor ms"] < est[r["model"]]]
    assert above == ["small", "large"] and below == ["tiny", "medium"]
    got = mod.formula_estimate(rows)
    for t in got["terms"]:
        assert t["estimate ms"] == pytest.approx(est[t["model"]])
        assert t["measured / estimate"] == pytest.approx(t["measured ms"] / est[t["model"]])
    assert got["compare_text"] == f"above for {', '.join(above)}; below for {', '.join(below)}"


def test_smallest_buckets_against_per_tensor_reason_and_direction() -> None:
    """The lesson quotes this sentence for the sweep's first row against the table's per-tensor sync of the same
    model: the reason (tensors larger than a bucket travel alone) from the real plan, the direction from the times."""
    from mlsys.model import GPT, GPTConfig

    mod = load_script(CH14 / "weight_sync.py")
    params = unique_parameters(GPT(GPTConfig(**mod.SIZES["large"])))
    cap = int(0.0625 * mod.MB)
    plan = plan_buckets(named_meta(params), cap)
    sizes = [t.numel() * t.element_size() for t in params.values()]
    alone = [n for n in sizes if n > cap]  # by hand: every tensor over the capacity gets a bucket of its own
    assert sum(b.nbytes > cap for b in plan) == len(alone)
    first = {"bucket MiB": 0.0625, "buckets": len(plan), "alone": len(alone), "MiB alone": sum(alone) / mod.MB,
             "ms": 76.0}
    big = {"tensors": len(params), "MiB": sum(sizes) / mod.MB, "per-tensor ms": 44.3}
    saved = len(params) - len(plan)
    text = mod.sweep_vs_per_tensor_text(first, big)
    assert f"{len(alone)} of the {len(params)} tensors" in text and f"saves just {saved} calls" in text
    slower = first["ms"] > big["per-tensor ms"]
    assert text.startswith("slower (76.0 ms against 44.3 ms)") == slower
    first["ms"] = 30.0  # the other direction
    text = mod.sweep_vs_per_tensor_text(first, big)
    assert text.startswith("faster (30.0 ms against 44.3 ms)")
    first.update({"alone": 0, "MiB alone": 0.0})  # every tensor fits: no 'travel alone' clause
    assert "at 0.0625 MiB every tensor fits in a bucket" in mod.sweep_vs_per_tensor_text(first, big)


@pytest.mark.timeout(150)
def test_script_syncs_gpt_weights_and_the_engine_serves_them(tmp_path) -> None:
    from mlsys.model import GPT, GPTConfig

    out = tmp_path / "r.json"
    proc = run([CH14 / "weight_sync.py", "--smoke", "-w", "3", "--models", "tiny", "small", "--sweep-mb", "4",
                "--iters", "1", "--json", out, "--plot-dir", tmp_path], timeout=140)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())["results"]
    served = res["served"]  # the engine's greedy tokens on the last rank vs the trainer's generate() on rank 0
    assert served["engine_tokens"] == served["trainer_tokens"]
    assert [len(t) for t in served["engine_tokens"]] == [12, 12]  # two prompts, 12 tokens each
    script = {r["model"]: r for r in res["rows"]}
    for name in ("tiny", "small"):
        params = unique_parameters(GPT(GPTConfig.preset(name)))
        assert script[name]["tensors"] == len(params)
        assert script[name]["MiB"] == pytest.approx(sum(t.numel() * 4 for t in params.values()) / 2**20)
        assert script[name]["buckets"] == len(plan_buckets(named_meta(params), 4 << 20))
    assert (tmp_path / "sync_time.png").stat().st_size > 0
    reading = res["reading"]  # the generated sentences the output prints
    assert reading["disturbed_text"] and reading["sweep_text"] and reading["sweep_vs_per_tensor_text"]
    flagged = {m for models in reading["disturbed"].values() for m in models}
    assert res["summary"]["unflagged"]["model"] not in flagged


# ------------------------------------------------------------------------------------------------ GPU only
def _ipc_child(handles, reference: bytes, conn) -> None:
    """Open the trainer's CUDA memory through the handles, compare it with a reference sent as plain bytes, then
    write a marker through each handle (tensor i filled with i + 7) for the trainer to find in its own memory."""
    import io

    from mlsys.weight_sync import open_cuda_ipc_handles

    opened = open_cuda_ipc_handles(handles)
    expected = torch.load(io.BytesIO(reference), weights_only=True)
    bad = tensors_equal({n: t.cpu() for n, t in opened.items()}, expected)
    for i, name in enumerate(sorted(opened)):
        opened[name].fill_(i + 7)
    torch.cuda.synchronize()
    conn.send(bad)  # plain Python
    conn.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_ipc_handles_show_the_trainers_memory_in_another_process() -> None:
    import io

    import torch.multiprocessing as tmp

    from mlsys.weight_sync import cuda_ipc_handles

    tensors = {n: t.cuda() for n, t in mixed_tensors(3).items()}
    buf = io.BytesIO()
    torch.save({n: t.cpu() for n, t in tensors.items()}, buf)
    ctx = tmp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_ipc_child, args=(cuda_ipc_handles(tensors), buf.getvalue(), theirs))
    child.start()
    bad = ours.recv()
    child.join(60)
    assert child.exitcode == 0
    assert bad == []
    # the oracle is the trainer's own memory: a receiver that got a copy (even on the GPU) leaves it untouched
    torch.cuda.synchronize()
    for i, name in enumerate(sorted(tensors)):
        assert torch.equal(tensors[name].cpu(), torch.full_like(tensors[name].cpu(), i + 7)), name


@pytest.mark.gpu
def test_bucket_round_trip_on_cuda() -> None:
    tensors = {n: t.cuda() for n, t in mixed_tensors(4).items()}
    into = {n: torch.zeros_like(t) for n, t in tensors.items()}
    for bucket in plan_buckets(named_meta(tensors), 64):
        flat = pack(bucket, tensors)
        assert flat.is_cuda
        unpack(bucket, flat, into)
    assert tensors_equal(into, tensors) == []


@pytest.mark.gpu
@pytest.mark.timeout(150)
def test_script_over_nccl(tmp_path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL between ranks needs one GPU per rank: 2 or more GPUs")
    out = tmp_path / "r.json"
    proc = run([CH14 / "weight_sync.py", "--smoke", "--backend", "nccl", "--json", out, "--plot-dir", tmp_path],
               timeout=140)
    assert proc.returncode == 0, proc.stderr[-2000:]
    served = json.loads(out.read_text())["results"]["served"]
    assert served["engine_tokens"] == served["trainer_tokens"]



def test_drawn_buckets_hold_every_parameter_once_within_capacity(tmp_path) -> None:
    """buckets.png, by brute force over what was drawn: every parameter of the model appears in exactly one
    bucket, once, in parameter order; each box sits at the running byte offset of its bucket with its tensor's
    own size (numel x 4 bytes, from the model itself); a bucket stays within the capacity unless it holds a single
    larger tensor; and no bucket was closed early (its first tensor would not have fitted in the bucket before)."""
    from types import SimpleNamespace

    from conftest import load_script
    from mlsys.model import GPT, GPTConfig

    script = load_script(CH14 / "weight_sync.py")
    for kb in (96.0, 48.0, 1024.0):
        drawn = script.draw_buckets(SimpleNamespace(plot_dir=str(tmp_path), figure_bucket_kb=kb))
        model = GPT(GPTConfig(**script.SIZES[drawn["model"]]))
        sizes = {n: p.numel() * p.element_size() for n, p in unique_parameters(model).items()}
        cap = drawn["capacity"]
        assert cap == int(kb * 1024)
        names = [name for b in drawn["buckets"] for name, _, _ in b["slots"]]
        assert names == list(sizes) and len(set(names)) == len(names)  # each exactly once, in order
        for i, b in enumerate(drawn["buckets"]):
            offset = 0
            for name, start, nbytes in b["slots"]:
                assert (start, nbytes) == (offset, sizes[name])
                offset += nbytes
            assert b["nbytes"] == offset
            assert offset <= cap or len(b["slots"]) == 1
            if i > 0:  # greedy: the previous bucket could not take this bucket's first tensor
                assert drawn["buckets"][i - 1]["nbytes"] + b["slots"][0][2] > cap
