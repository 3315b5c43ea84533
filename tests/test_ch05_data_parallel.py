"""Chapter 5 (data parallel, DDP half) oracles.

- the gradient-averaging identity: the mean of per-shard gradients is the full-batch gradient (equal shards), the
  n_r/N-weighted mean is (unequal shards), the plain mean is not -- all in one process, no communication;
- bucket assignment against torch's own DDP helper;
- the three hand-written DDP versions (mlsys.ddp) on real ranks against single-process training on the global batch
  AND against torch.nn.parallel.DistributedDataParallel, after several SGD steps, with and without no_sync
  gradient accumulation; their all-reduce counts and bytes; the comm-volume formula 2(W-1)/W x bytes;
- the profiled overlapped step (ddp_from_scratch.profile_overlap, in one process): torch's bucket assignment, one
  gloo all-reduce per bucket in the raw trace, each launch inside the backward of the block that completes it, and
  the printed launch table's fractions equal to the raw trace's launch-call events over its backward;
- the overlap share: all-reduce time during the backward minus the whole launch calls (the clock's windows placed
  on the trace), not only minus the trace's shorter c10d::allreduce_ events;
- the ideal-overlap model (ddp_from_scratch.ideal_schedule) against a recomputation from assign_buckets' plan: each
  all-reduce starts at max(its bucket ready, the previous one done); with one bucket, none before the backward ends;
- the chapter's scripts' JSON: loss really falls in dp_training, grad_sync's computed proof; dp_training's step-1
  record (its figure dp_step.png): each rank's own gradient recomputed here from the rank's rebuilt first batch,
  the averaged gradient equal to their mean, identical post-step parameters, the windows where the batch lies;
- the plain PyTorch recipe (ddp_recipe.py): DistributedSampler gives every rank an equal share with the padding
  counted, and forgetting set_epoch is caught.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from conftest import load_script, run, scripts_dir
from mlsys.collectives import comm_volume, ring_all_reduce
from mlsys.data import load_splits, shard
from mlsys.ddp import BucketedDDP, OverlappedDDP, assign_buckets, rank_batches, wrap
from mlsys.model import GPT, GPTConfig, num_params

CH05 = scripts_dir(5)
dfs = load_script(CH05 / "ddp_from_scratch.py")
STEPS, BATCH, LR = 4, 2, 0.5


# ----------------------------------------------------------------------------------------------- the identity
def _grads(model: GPT) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _grad_of(model: GPT, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x, y)[1].backward()
    return _grads(model)


def test_mean_of_shard_gradients_is_the_full_batch_gradient() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    x = torch.randint(0, model.config.vocab_size, (12, 16))
    y = torch.randint(0, model.config.vocab_size, (12, 16))
    full = _grad_of(model, x, y)
    # equal shards (W = 3, n = 4): (1/W) sum_r g_r == g
    shards = [_grad_of(model, x[i:i + 4], y[i:i + 4]) for i in (0, 4, 8)]
    for k, g in enumerate(full):
        torch.testing.assert_close(sum(s[k] for s in shards) / 3, g, rtol=1e-4, atol=1e-7)
    # unequal shards 2, 3, 7: sum_r (n_r / N) g_r == g, while the plain mean is off
    bounds = [(0, 2), (2, 5), (5, 12)]
    uneven = [_grad_of(model, x[a:b], y[a:b]) for a, b in bounds]
    plain_err = 0.0
    for k, g in enumerate(full):
        weighted = sum((b - a) / 12 * s[k] for (a, b), s in zip(bounds, uneven))
        torch.testing.assert_close(weighted, g, rtol=1e-4, atol=1e-7)
        plain_err = max(plain_err, (sum(s[k] for s in uneven) / 3 - g).abs().max().item())
    assert plain_err > 1e-4


# ----------------------------------------------------------------------------------------------- buckets
@pytest.mark.parametrize("numels,cap", [([10, 300, 5, 700, 20], 1000), ([250] * 4, 1000), ([5000, 1, 1], 1000),
                                        ([3, 7, 11, 13, 17, 19, 23, 29], 64), ([1], 1 << 20)])
def test_assign_buckets_matches_torch_ddp(numels: list[int], cap: int) -> None:
    import torch.distributed as dist

    want, _ = dist._compute_bucket_assignment_by_size([torch.empty(n) for n in numels], [cap], [False] * len(numels))
    assert assign_buckets(numels, 4, cap) == [list(b) for b in want]
    with pytest.raises(ValueError):
        assign_buckets(numels, 4, 0)


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_buckets_follow_reverse_parameter_order_and_cover_every_parameter(one_rank_group) -> None:
    model = GPT(GPTConfig.preset("tiny"))
    ddp = BucketedDDP(model, bucket_mb=0.02)
    flat = [p for bucket in ddp.buckets for p in bucket]
    assert [id(p) for p in flat] == [id(p) for p in list(model.parameters())[::-1]]
    assert len(ddp.buckets) > 2
    assert sum(b.numel() for b in ddp.buffers) == num_params(model)


def test_overlapped_ddp_reports_a_parameter_without_gradient(one_rank_group) -> None:
    model = GPT(GPTConfig.preset("tiny"))
    model.extra = torch.nn.Linear(3, 3)  # never used in forward: the bucket holding it never fills
    ddp = OverlappedDDP(model, bucket_mb=0.02)
    x = torch.randint(0, model.config.vocab_size, (2, 8))
    ddp(x, x)[1].backward()
    with pytest.raises(RuntimeError, match="extra"):
        ddp.finish_gradient_synchronization()


def _segment_of(name: str, num_blocks: int) -> str:
    """The part of the backward in which a parameter's gradient becomes final (the lesson's figure names)."""
    if name.startswith("h."):
        return f"block {name.split('.')[1]}"
    return "emb." if name.startswith(("wte", "wpe")) else "head"  # wte is tied to the head: final only at the end


@pytest.mark.timeout(60)
def test_overlap_trace_launches_each_torch_bucket_inside_the_backward_that_fills_it(one_rank_group, tmp_path) -> None:
    """The profiled overlapped step, in one process: its buckets are torch's own assignment, every bucket has one
    gloo all-reduce in the raw trace file, and each launch falls inside the backward segment of the block whose
    gradients complete the bucket (autograd runs head, last block ... first block, embeddings); the launch table
    (launch_timeline) gives each launch call's start and end as a share of the trace's own "backward" event."""
    from types import SimpleNamespace

    import torch.distributed as dist

    args = SimpleNamespace(seed=0, preset="tiny", batch_size=2, bucket_mb=0.03)
    ctx = SimpleNamespace(rank=0, world_size=1, is_main=True)
    tokens, _ = load_splits(300, 0)
    trace = tmp_path / "overlap.trace.json"
    names = dfs.profile_overlap(ctx, args, tokens, trace)
    spans = dfs.overlap_spans(trace)

    model = GPT(GPTConfig.preset("tiny"))
    named = list(model.named_parameters())[::-1]  # backward order, as torch's DDP buckets them
    want, _ = dist._compute_bucket_assignment_by_size([p for _, p in named], [int(0.03 * 2**20)],
                                                      [False] * len(named))
    want_names = [[named[i][0] for i in bucket] for bucket in want]
    assert names == want_names and len(want) >= 3

    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    gloo = sorted((e for e in events if e["name"] == "gloo:all_reduce"), key=lambda e: e["ts"])
    comm = sorted((s for s in spans if s.kind == dfs.ALL_REDUCE), key=lambda s: s.start)
    assert len(gloo) == len(comm) == len(want)
    assert [s.end - s.start for s in comm] == pytest.approx([e["dur"] / 1000 for e in gloo])

    n = model.config.n_layer
    order = ["head"] + [f"block {i}" for i in reversed(range(n))] + ["emb."]
    segments = {s.label: s for s in spans if s.kind == "backward"}
    assert sorted(segments) == sorted(order)
    launches = sorted((s for s in spans if s.lane == "launch"), key=lambda s: s.start)
    assert len(launches) == len(want)
    for bucket, launch in zip(want_names, launches):
        last = max((_segment_of(p, n) for p in bucket), key=order.index)  # the last part of backward it needs
        seg = segments[last]
        assert seg.start - 0.05 <= launch.start <= seg.end + 0.05, (bucket, last, launch, seg)

    # the printed "bucket launches" table comes from this same step: read it off the raw events, not the spans
    backward = next(e for e in events if e["name"] == "backward")
    calls = sorted((e for e in events if e["name"] == "c10d::allreduce_" and e["tid"] == backward["tid"]),
                   key=lambda e: e["ts"])
    table = dfs.launch_timeline(spans)
    assert len(table) == len(calls) == len(want)
    for row, call in zip(table, calls):
        began = 100 * (call["ts"] - backward["ts"]) / backward["dur"]
        returned = 100 * (call["ts"] + call["dur"] - backward["ts"]) / backward["dur"]
        assert row["launch began (% of backward)"] == pytest.approx(began, abs=1e-3), (row, began)
        assert row["returned (%)"] == pytest.approx(returned, abs=1e-3), (row, returned)
        assert 0 <= began <= returned <= 100.5


# ----------------------------------------------------------------------------------------------- DDP on real ranks
def ddp_worker(ctx, bucket_mb: float) -> dict:
    import contextlib

    import torch.distributed as dist

    tokens, _ = load_splits(300, 0)
    out = {}
    for kind, accum in [("naive", 1), ("bucketed", 1), ("overlapped", 1), ("torch", 1), ("overlapped", 2),
                        ("torch", 2), ("bucketed", 2)]:
        torch.manual_seed(100 + ctx.rank)  # a different init per rank: the wrapper must broadcast rank 0's
        model = GPT(GPTConfig.preset("tiny"))
        ddp = wrap(kind, model, bucket_mb)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        batches = rank_batches(tokens, ctx.rank, ctx.world_size, BATCH, 64, 0, STEPS * accum)
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            for m in range(accum):
                skip = m < accum - 1 and hasattr(ddp, "no_sync")
                with ddp.no_sync() if skip else contextlib.nullcontext():
                    (ddp(*batches[step * accum + m])[1] / accum).backward()
            ddp.finish_gradient_synchronization()
            opt.step()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(ctx.world_size)]
        dist.all_gather(everyone, flat)
        out[f"{kind}/{accum}"] = {
            "params": flat.numpy().copy(),
            "rank_spread": max((e - flat).abs().max().item() for e in everyone),
            "calls": getattr(ddp, "allreduce_calls", None), "bytes": getattr(ddp, "allreduce_bytes", None),
            "buckets": len(getattr(ddp, "buckets", [])),
        }
        if kind == "bucketed" and accum == 1:  # the bytes a ring all-reduce of these buckets puts on the link,
            sent = [0]                          # counted message by message (mlsys.collectives.ring_all_reduce)
            for buf in ddp.buffers:
                ring_all_reduce(buf.clone(), on_step=lambda *a, sent=sent: sent.__setitem__(0, sent[0] + a[4]))
            out[f"{kind}/{accum}"]["ring_sent_per_step"] = sent[0]
    return out


def reference(world_size: int, accum: int) -> np.ndarray:
    """One process on the global batch: all ranks' micro-batches of a step concatenated."""
    tokens, _ = load_splits(300, 0)
    torch.manual_seed(100)  # rank 0's init
    model = GPT(GPTConfig.preset("tiny"))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    per_rank = [rank_batches(tokens, r, world_size, BATCH, 64, 0, STEPS * accum) for r in range(world_size)]
    for step in range(STEPS):
        micro = [per_rank[r][step * accum + m] for r in range(world_size) for m in range(accum)]
        opt.zero_grad(set_to_none=True)
        model(torch.cat([b[0] for b in micro]), torch.cat([b[1] for b in micro]))[1].backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.sweep), 3])  # W=2: make sweep
def test_hand_written_ddp_equals_single_process_and_torch_ddp(world_size: int) -> None:
    from mlsys.launch import launch

    results = launch(ddp_worker, 0.03, world_size=world_size, backend="gloo", timeout=60)
    n = num_params(GPT(GPTConfig.preset("tiny")))
    for accum in (1, 2):
        want = reference(world_size, accum)
        torch_ddp = results[f"torch/{accum}"]["params"]
        for key, res in results.items():
            if not key.endswith(f"/{accum}"):
                continue
            assert res["rank_spread"] == 0.0, f"{key}: ranks disagree"
            np.testing.assert_allclose(res["params"], want, rtol=0, atol=2e-6, err_msg=f"{key} vs global batch")
            np.testing.assert_allclose(res["params"], torch_ddp, rtol=0, atol=2e-6, err_msg=f"{key} vs torch DDP")
    # what each version hands to all_reduce: every gradient byte once per step, in 1 call/param or 1 call/bucket
    assert results["naive/1"]["calls"] == STEPS * len(list(GPT(GPTConfig.preset("tiny")).parameters()))
    for key in ("bucketed/1", "overlapped/1", "overlapped/2"):
        assert results[key]["calls"] == STEPS * results[key]["buckets"] and results[key]["buckets"] >= 3
    for key in ("naive/1", "bucketed/1", "overlapped/1", "overlapped/2", "bucketed/2"):
        assert results[key]["bytes"] == STEPS * 4 * n
    # and what a ring all-reduce of those buckets puts on rank 0's link, counted from its messages: comm_volume's
    # 2(W-1)/W of the bytes, up to the uneven chunks (W does not always divide a bucket: one element per message)
    ring = results["bucketed/1"]["ring_sent_per_step"]
    messages = 2 * (world_size - 1) * results["bucketed/1"]["buckets"]
    assert abs(ring - comm_volume("all_reduce", 4 * n, world_size)["sent"]) <= 4 * messages
    assert abs(ring - 2 * (world_size - 1) / world_size * 4 * n) <= 4 * messages


PROFILER_LINES = ("profiled one more overlapped step", "bucket launches in that step", "the hooks' launch calls",
                  "inside the launch calls the training thread", "what most kept the all-reduces", "figure:")


@pytest.mark.long  # a full 2-rank training run, about 14 s: make sweep (and CI) run it
@pytest.mark.timeout(120)
def test_no_profile_prints_the_tables_without_the_profiled_step() -> None:
    """The lesson's opening run (--no-profile) shows only the tables, bytes and self-check; the default run adds
    the profiled step's lines."""
    quiet = run([CH05 / "ddp_from_scratch.py", "--smoke", "--no-profile"], timeout=110)
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert "vs global batch" in quiet.stdout and "self-check passed" in quiet.stdout
    assert not [line for line in PROFILER_LINES if line in quiet.stdout], quiet.stdout
    full = run([CH05 / "ddp_from_scratch.py", "--smoke"], timeout=110)
    assert full.returncode == 0, full.stdout + full.stderr
    assert all(line in full.stdout for line in PROFILER_LINES), full.stdout
    bad = run([CH05 / "ddp_from_scratch.py", "--no-profile=yes"], timeout=60)
    assert bad.returncode == 2, bad.stdout + bad.stderr


@pytest.mark.long  # a profiled 2-rank run, about 14 s: make sweep (and CI) run it
@pytest.mark.timeout(120)
def test_no_tables_prints_the_profiled_step_without_the_tables() -> None:
    """The lesson's second run (--no-tables) shows the tables of the first one no second time: only the ideal model
    and the profiled step; --no-tables with --no-profile is a usage error."""
    prof = run([CH05 / "ddp_from_scratch.py", "--smoke", "--no-tables"], timeout=110)
    assert prof.returncode == 0, prof.stdout + prof.stderr
    assert all(line in prof.stdout for line in PROFILER_LINES + ("ideal overlap",)), prof.stdout
    assert not [t for t in ("vs global batch", "filled in reverse parameter order", "a ring sends") if t in prof.stdout]
    assert prof.stdout.lstrip().startswith("ideal overlap"), prof.stdout
    both = run([CH05 / "ddp_from_scratch.py", "--no-tables", "--no-profile"], timeout=60)
    assert both.returncode == 2, both.stdout + both.stderr


# ------------------------------------------------------------------------------ the profiled step, read and drawn
def _step_spans(launch_ms: float = 0.05) -> list:
    """A profiled step as overlap_spans returns it: forward 0-2 ms, backward 2-6 (head, block 1, block 0, emb.),
    two launch calls inside it, two all-reduces on a gloo thread that outlast it, the wait 6-40."""
    S = dfs.plot.Span
    spans = [S("compute", 0, 2, "forward", "forward"), S("compute", 2, 3, "head", "backward"),
             S("compute", 3, 4, "block 1", "backward"), S("compute", 4, 5, "block 0", "backward"),
             S("compute", 5, 6, "emb.", "backward"),
             S("compute", 6, 40, "wait for all-reduces", "wait for all-reduces")]
    spans += [S("launch", t, t + launch_ms, f"bucket {k}", "launch") for k, t in enumerate((3.5, 5.5))]
    return spans + [S("gloo thread 1", 3.6, 30, "0", dfs.ALL_REDUCE), S("gloo thread 1", 30, 40, "1", dfs.ALL_REDUCE)]


def test_drawn_launch_calls_are_as_wide_as_measured(monkeypatch) -> None:
    """The figure's pink boxes add up to the launch calls' measured time: none is widened to be seen (a 1%-of-axis
    minimum drew 0.2 ms of launches as most of a 3.6 ms backward)."""
    drawn = {}
    monkeypatch.setattr(dfs.plot, "save", lambda fig, args, name: drawn.setdefault("fig", fig))
    spans = _step_spans(launch_ms=0.05)
    dfs.draw_overlap(None, spans)
    ax = drawn["fig"].axes[0]
    pink = dfs.plot.colours(["forward", "backward", dfs.ALL_REDUCE, "wait for all-reduces", dfs.LAUNCH])[dfs.LAUNCH]
    from matplotlib.colors import to_rgba
    widths = [p.get_width() for p in ax.patches if p.get_facecolor() == to_rgba(pink)]
    assert sum(widths) == pytest.approx(sum(s.end - s.start for s in spans if s.lane == "launch"), abs=1e-9)
    dfs.plot.pyplot().close(drawn["fig"])


def test_summed_all_reduce_time_counts_concurrent_gloo_threads_twice_and_the_union_does_not() -> None:
    """The totals line's "busy" adds the all-reduces' durations, so two running at once on different gloo threads
    count twice and the sum can exceed the whole step; "at least one ran" is the union, checked on a 1 us grid."""
    S = dfs.plot.Span
    spans = _step_spans() + [S("gloo thread 2", 5.0, 38.0, "2", dfs.ALL_REDUCE)]  # beside thread 1's two
    o = dfs.overlap_summary(spans)
    comm = [s for s in spans if s.kind == dfs.ALL_REDUCE]
    grid = np.arange(0, 40, 1e-3) + 5e-4  # midpoints of 1 us cells
    running = np.zeros_like(grid, dtype=bool)
    for s in comm:
        running |= (grid >= s.start) & (grid < s.end)
    assert o["allreduce_ms"] == pytest.approx(sum(s.end - s.start for s in comm))
    assert o["allreduce_any_ms"] == pytest.approx(running.sum() * 1e-3, abs=2e-3)
    assert o["gloo_threads"] == 2 and o["step_ms"] == pytest.approx(40.0)
    assert o["allreduce_ms"] > o["step_ms"] > o["allreduce_any_ms"]  # 69.4 ms "busy" in a 40 ms step


def test_final_wait_splits_into_all_reduce_running_copying_back_and_neither() -> None:
    """The wait (6-40 ms) is not all all-reduce: here the last box ends at 33, and the training thread copies sums
    back into .grad at 31-31.5 (under an open box: counts as running), 33.5-34 and 36-36.2. Each part is counted
    here on a 1 us grid; labelling the whole wait "for the last all-reduces" (running = wait) fails."""
    S = dfs.plot.Span
    spans = [s for s in _step_spans() if s.label != "1"] + [S("gloo thread 1", 30, 33, "1", dfs.ALL_REDUCE)]
    copies = [(31, 31.5), (33.5, 34), (36, 36.2)]
    spans += [S("copy back", a, b, "", "copy back") for a, b in copies]
    o = dfs.overlap_summary(spans)
    grid = np.arange(6, 40, 1e-3) + 5e-4
    running = np.zeros_like(grid, dtype=bool)
    for s in spans:
        if s.kind == dfs.ALL_REDUCE:
            running |= (grid >= s.start) & (grid < s.end)
    copying = np.zeros_like(grid, dtype=bool)
    for a, b in copies:
        copying |= (grid >= a) & (grid < b)
    expect = {"wait_running_ms": running.sum() * 1e-3, "wait_copy_ms": (copying & ~running).sum() * 1e-3,
              "wait_neither_ms": (~copying & ~running).sum() * 1e-3}
    for key, ms in expect.items():
        assert o[key] == pytest.approx(ms, abs=2e-3), key
    assert o["wait_ms"] == pytest.approx(34.0) and expect["wait_neither_ms"] > 5  # 6.3 ms with nothing running
    assert o["wait_text"].startswith(f"34.0 ms: an all-reduce still running for {expect['wait_running_ms']:.1f} ms")
    assert f"neither for {expect['wait_neither_ms']:.1f} ms" in o["wait_text"]


def test_peer_wait_counts_all_reduce_time_before_the_other_rank_launched_outside_the_compute() -> None:
    """Rank 0 launched bucket 0 at 3.5 ms (its all-reduce ran 3.6-30), the other rank at 20 ms: the wait is 3.6-20
    minus the backward's compute up to 6 ms, which excludes the 0.05 ms launch call at 5.5: 14.05 ms. Bucket 1,
    launched by the other rank before rank 0's all-reduce began, waited for nobody. Clocks: rank 0's perf_counter
    reads 100 s at trace 0."""
    spans = _step_spans(launch_ms=0.05)
    own = [100 + 3.5e-3, 100 + 5.5e-3]
    assert dfs.peer_wait_ms(spans, own, [[100 + 20e-3, 100 + 10e-3]]) == pytest.approx(14.05)
    assert dfs.peer_wait_ms(spans, own, [[100 + 1e-3, 100 + 2e-3]]) == 0.0  # the other rank was earlier
    assert dfs.peer_wait_ms(spans, own, []) == 0.0  # one rank: nobody to wait for
    # three ranks: the latest other rank counts
    assert dfs.peer_wait_ms(spans, own, [[100 + 1e-3] * 2, [100 + 20e-3, 100 + 10e-3]]) == pytest.approx(14.05)


def test_overlap_share_leaves_out_the_whole_launch_calls_not_only_the_c10d_events() -> None:
    """The line starting "step": the launch calls are the whole Python calls the clock timed (1.5 and 0.3 ms), not
    the trace's 0.05 ms c10d::allreduce_ events inside them; their readings land on the trace's axis at the least
    gap to the events (here 0.01 ms). Backward 2-6 ms = the calls + computing; the share of all-reduce time during
    that computing is counted here on a 1 us grid. Cutting only the c10d events (the old rule) gives 6%, not 2%."""
    spans = _step_spans(launch_ms=0.05)  # c10d events at 3.5 and 5.5 ms; all-reduces 3.6-30 and 30-40
    began, wall = [100 + 3.45e-3, 100 + 5.49e-3], [1.5, 0.3]
    clock = [{"began_s": b, "wall_ms": w} for b, w in zip(began, wall)]
    gap = min(3.5 - 1e3 * (began[0] - 100), 5.5 - 1e3 * (began[1] - 100))  # the offset: trace 0 = 100 s + gap
    windows = [(1e3 * (b - 100) + gap, 1e3 * (b - 100) + gap + w) for b, w in zip(began, wall)]
    grid = np.arange(0, 40, 1e-3) + 5e-4
    held = np.zeros_like(grid, dtype=bool)
    for a, b in windows:
        held |= (grid >= a) & (grid < b)
    computing = (grid >= 2) & (grid < 6) & ~held
    comm = [s for s in spans if s.kind == dfs.ALL_REDUCE]
    running = sum(((grid >= s.start) & (grid < s.end) & computing).sum() * 1e-3 for s in comm)
    share = running / sum(s.end - s.start for s in comm)
    o = dfs.overlap_summary(dfs.whole_launch_calls(spans, clock))
    assert o["hidden_share"] == pytest.approx(share, abs=1e-4) and f"{share:.0%}" == "2%"
    assert o["step_text"] == (f"40.0 ms, backward 4.0 ms = the hooks' launch calls {held.sum() * 1e-3:.1f} ms + "
                              f"computing {computing.sum() * 1e-3:.1f} ms; {share:.0%} of the 2 all-reduces' time "
                              "ran during that computing")
    placed = sorted((s.start, s.end) for s in dfs.whole_launch_calls(spans, clock) if s.lane == "launch")
    assert np.allclose(placed, windows)


@pytest.mark.parametrize("peer, core, launch", [(120.0, 0.0, 0.7), (0.0, 12.9, 0.9), (0.5, 0.2, 3.0),
                                                (2.0, None, 1.0), (0.1, None, 1.0)])
def test_overlap_cause_names_the_largest_measured_part(peer, core, launch) -> None:
    """The sentence the lesson quotes names the largest of the three measured parts, computed here on its own."""
    parts = {"waiting for another rank": peer, "queued for a core": core if core is not None else -1,
             "the launch calls themselves": launch}
    largest = max(parts, key=parts.get)
    text = dfs.overlap_cause(peer, core, launch)
    assert text.startswith(largest + ":"), text
    assert all(not text.startswith(k) for k in parts if k != largest)
    assert f"{peer:.1f} ms" in text and f"{launch:.1f} ms" in text
    assert (f"{core:.1f} ms" if core is not None else "not measured here") in text


# ----------------------------------------------------------------------------------------------- the ideal overlap
def _ready_order_numels() -> list[int]:
    model = GPT(GPTConfig.preset("tiny"))
    return [p.numel() for p in model.parameters() if p.requires_grad][::-1]  # reverse registration order


@pytest.mark.parametrize("bucket_mb", [0.03, 0.01])
def test_ideal_schedule_starts_each_all_reduce_when_its_bucket_is_ready_and_the_stream_is_free(bucket_mb) -> None:
    """The model drawn before the measured trace, recomputed here from assign_buckets' own plan: overlapped bucket i
    starts at max(ready_i, end of bucket i-1), bucketed at max(end of backward, end of bucket i-1)."""
    numels = _ready_order_numels()
    cap = int(bucket_mb * 2**20)
    ideal = dfs.ideal_schedule(numels, 4, cap, comm_share=0.6)
    plan = assign_buckets(numels, 4, cap)
    assert ideal["buckets"] == plan and len(plan) >= 3
    total = sum(numels)
    ready = [sum(numels[:b[-1] + 1]) / total for b in plan]
    length = [0.6 * sum(numels[i] for i in b) / total for b in plan]
    for name, earliest in (("overlapped", ready), ("bucketed", [1.0] * len(plan))):
        end = 0.0
        for i, (start, stop) in enumerate(ideal[name]):
            want = max(earliest[i], end)
            assert math.isclose(start, want, abs_tol=1e-12), (name, i, start, want)
            assert math.isclose(stop - start, length[i], abs_tol=1e-12)
            end = stop
        assert math.isclose(ideal[f"{name}_end"], max(1.0, end), abs_tol=1e-12)
    assert ideal["overlapped_end"] < ideal["bucketed_end"]  # overlap hides every bucket but what follows the last
    assert math.isclose(ideal["backward"][-1][1], 1.0) and ideal["backward"][0][0] == 0.0


def test_ideal_schedule_with_one_bucket_starts_no_all_reduce_before_the_backward_ends() -> None:
    numels = _ready_order_numels()
    ideal = dfs.ideal_schedule(numels, 4, 2**20)  # 1 MiB: the whole tiny GPT in one bucket
    assert len(ideal["buckets"]) == 1
    backward_end = ideal["backward"][-1][1]
    for name in ("overlapped", "bucketed"):
        assert all(start >= backward_end for start, _ in ideal[name]), ideal[name]
    assert ideal["overlapped_end"] == ideal["bucketed_end"]


# ----------------------------------------------------------------------------------------------- unequal token counts
gs = load_script(CH05 / "grad_sync.py")
UNEQUAL = [2, 3, 5]  # sequences per rank


def _divide_by_global_count(loss_sum: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The planted bug: divide by the global token count N while DDP still divides by W (gradient W times small)."""
    import torch.distributed as dist

    total = torch.tensor([float(num_tokens)])
    dist.all_reduce(total)
    return loss_sum / total[0]


def per_token_worker(ctx) -> dict:
    from mlsys.ddp import global_token_mean

    tokens, _ = load_splits(200, 0)
    args = gs.Settings(seed=0)
    return {name: {k: g.numpy() for k, g in gs.per_token_recipe(args, tokens, ctx.world_size, UNEQUAL, ctx.rank,
                                                                   divide).items()}
            for name, divide in (("recipe", global_token_mean), ("planted", _divide_by_global_count))}


@pytest.mark.timeout(120)
def test_per_token_loss_through_ddp_is_the_single_process_gradient_and_the_planted_bug_is_not() -> None:
    """Ranks with 2, 3, 5 sequences: sum the per-token losses, divide by N/W, BucketedDDP (which divides by W) --
    every rank's gradient equals one process's gradient of the mean loss over all 10 sequences. Dividing by N
    instead (the planted bug) gives that gradient over W on every tensor."""
    from mlsys.launch import launch

    result = launch(per_token_worker, world_size=3, backend="gloo", timeout=60)  # rank 0's (all ranks agree)
    tokens, _ = load_splits(200, 0)
    args = gs.Settings(seed=0)
    model, batches = gs.model_and_batches(args, tokens, 3, UNEQUAL)
    oracle = gs.full_batch_gradient(model, batches)  # one process, no communication
    for name, want in oracle.items():
        torch.testing.assert_close(torch.from_numpy(result["recipe"][name]), want, rtol=1e-4, atol=1e-6)
        planted = torch.from_numpy(result["planted"][name])
        torch.testing.assert_close(planted * 3, want, rtol=1e-4, atol=1e-6)  # exactly W times too small
        if want.abs().max() > 1e-6:
            with pytest.raises(AssertionError):
                torch.testing.assert_close(planted, want, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------- the scripts
@pytest.fixture(scope="module")
def grad_sync_json(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ch05") / "grad_sync.json"
    proc = run([CH05 / "grad_sync.py", "-w", "3", "--smoke", "--json", out, "--plot-dir", out.parent], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())["results"]


@pytest.mark.timeout(120)
def test_grad_sync_average_equals_full_batch(grad_sync_json: dict) -> None:
    r = grad_sync_json
    assert r["world_size"] == 3 and r["unequal_sizes"] == [4, 5, 6]
    assert r["max_err_equal"] < 1e-6 and r["max_err_weighted_unequal"] < 1e-6 and r["max_err_per_token_unequal"] < 1e-6
    assert r["max_err_plain_unequal"] > 100 * r["max_err_weighted_unequal"]
    before, after, full = np.array(r["before"]), np.array(r["after"]), np.array(r["full_batch"])
    np.testing.assert_allclose(before.mean(0), after, rtol=1e-4, atol=1e-7)  # the figure's data: mean of ranks
    np.testing.assert_allclose(after, full, rtol=1e-4, atol=1e-7)
    assert np.abs(before[0] - before[1]).max() > 1e-5  # ranks really had different gradients


def _check_first_step(doc: dict) -> None:
    """dp_training's step-1 record against an oracle: each rank's first batch rebuilt here (rank_batches), its
    gradient computed on a fresh model with the run's initial weights; the averaged gradient is their mean; every rank
    ends the step with the same parameters; the marked windows are where the batch lies in the rank's shard."""
    settings, r = doc["settings"], doc["results"]["step1"]
    world = settings["world_size"]
    local, averaged, after, before = (np.array(r[k]) for k in ("local", "averaged", "after", "before"))
    assert local.shape == averaged.shape == after.shape == (world, 12)
    np.testing.assert_allclose(averaged, np.broadcast_to(local.mean(0), averaged.shape), rtol=1e-5, atol=1e-7)
    for a in range(world):  # different data: every pair of ranks has different gradients
        for b in range(a + 1, world):
            assert np.abs(local[a] - local[b]).max() > 1e-3 * np.abs(local).max(), (a, b)
    assert (after == after[0]).all() and (before == before[0]).all()  # identical replicas, before and after
    assert np.abs(after - before).min() > 0  # the step moved every drawn entry
    tokens, _ = load_splits(settings["num_records"], settings["seed"])
    torch.manual_seed(settings["seed"])
    model = GPT(GPTConfig.preset("tiny"))
    init = [p.detach().clone() for p in model.parameters()]
    for rank in range(world):
        (x, y), = rank_batches(tokens, rank, world, settings["batch_size"], 64, settings["seed"], 1)
        with torch.no_grad():
            for p, p0 in zip(model.parameters(), init):
                p.copy_(p0)
        grads = torch.cat([g.flatten() for g in _grad_of(model, x, y)])
        np.testing.assert_allclose(local[rank], grads[r["entries"]].numpy(), rtol=1e-4, atol=1e-7)
        part = shard(tokens, rank, world)
        assert [part[s:s + 64].tolist() for s in r["starts"][rank]] == x.tolist()


@pytest.mark.timeout(120)
def test_dp_training_first_step_averages_each_ranks_own_gradient(tmp_path) -> None:
    """Three ranks, torch's DDP (which averages inside backward()); two ranks with the overlapped DDP in the test
    below."""
    out = tmp_path / "dp.json"
    proc = run([CH05 / "dp_training.py", "-w", "3", "--smoke", "--json", out, "--plot-dir", tmp_path], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_first_step(json.loads(out.read_text()))
    assert f"figure: {tmp_path / 'dp_step.png'}" in proc.stdout


@pytest.mark.timeout(120)
def test_dp_training_loss_falls_and_replicas_agree(tmp_path) -> None:
    out = tmp_path / "dp.json"
    proc = run([CH05 / "dp_training.py", "-w", "2", "--smoke", "--ddp", "overlapped", "--json", out,
                "--plot-dir", tmp_path], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())["results"]
    assert r["replica_max_diff"] == 0.0
    assert r["final_val_loss"] < 0.6 * r["initial_val_loss"]
    assert r["initial_val_loss"] == pytest.approx(np.log(GPTConfig().vocab_size), abs=0.1)  # uniform at init
    shards = r["shards"]
    assert shards[0]["first token"] == 0 and shards[1]["first token"] == shards[0]["last token"] + 1
    assert r["rank_loss_last"][0] != r["rank_loss_last"][1]  # different data on each rank
    _check_first_step(json.loads(out.read_text()))


# ----------------------------------------------------------------------------------------------- the plain recipe
@pytest.mark.timeout(120)
def test_ddp_recipe_sampler_gives_equal_padded_shares(tmp_path) -> None:
    """W = 2 does not divide the smoke run's windows: every rank still reads ceil(n / 2) per epoch (the sampler
    pads), the in-run checks of cover and padding pass, and the loss falls."""
    out = tmp_path / "recipe.json"
    proc = run([CH05 / "ddp_recipe.py", "-w", "2", "--smoke", "--json", out], timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())["results"]
    n = r["num_windows"]
    assert n % 2, "the smoke corpus should exercise the padding"
    epochs = {row["epoch"] for row in r["rows"]}
    for e in epochs:
        assert [row["windows"] for row in r["rows"] if row["epoch"] == e] == [math.ceil(n / 2)] * 2
    assert r["epoch_losses"][-1] < r["epoch_losses"][0]


@pytest.mark.timeout(120)
def test_ddp_recipe_without_set_epoch_fails_its_self_check() -> None:
    proc = run([CH05 / "ddp_recipe.py", "--smoke", "--no-set-epoch"], timeout=110)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "set_epoch" in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------------------------- bench_ddp's headline
bench = load_script(CH05 / "bench_ddp.py")


def test_bench_headline_names_only_the_variant_whose_rows_fell_below_local() -> None:
    """The read run: torch's rows (129/158/150 ms) below local (162 ms), overlapped's above: name torch alone."""
    med = {("local", 0.0): 0.162} | {("overlapped", mb): t for mb, t in ((1, .177), (4, .169), (16, .182))} \
        | {("torch", mb): t for mb, t in ((1, .129), (4, .158), (16, .150))}
    text = bench._headline(med, {"overlapped": 4, "torch": None}, 0.162)
    assert text.startswith("no headline ratio: every torch row came out below local's median (162 ms")
    assert "torch 129/158/150" in text and "overlapped row" not in text and "overlapped 1" not in text
    both = bench._headline(med, {"overlapped": None, "torch": None}, 0.162)
    assert "every overlapped and every torch row came out below local" in both


def test_bench_headline_gives_the_ratio_when_both_have_a_row_above_local() -> None:
    med = {("local", 0.0): 0.1, ("overlapped", 4.0): 0.12, ("torch", 1.0): 0.11}
    text = bench._headline(med, {"overlapped": 4.0, "torch": 1.0}, 0.1)
    assert "overlapped / torch = 1.09x" in text and "no headline" not in text


def _direction_of(text: str, mb: float) -> str:
    """The word ("shorter", "longer" or "the same") that governs the sentence's mention of `mb` MiB."""
    head = text.split(";")[0]
    at = head.index(f" {mb:g} MiB (by ")
    return max(("shorter", "longer", "the same"), key=lambda w: head.rfind(w, 0, at))


@pytest.mark.parametrize("bucketed_ms, overlapped_ms, spread", [
    ((177, 178, 193), (189, 170, 214), 10.0),   # the read run's shape: shorter at 2 MiB only; two gaps wide
    ((177, 178, 193), (157, 158, 173), 25.0),   # shorter everywhere, all within the spread
    ((177, 178, 193), (197, 198, 213), 7.0),    # longer everywhere, every gap wide
    ((177, 178, 193), (169.96, 185.04, 193), 6.96),  # gaps 7.04 against 6.96: both 7.0 as printed, not wider; a tie
])
def test_overlapped_vs_bucketed_sentence_follows_the_medians(bucketed_ms, overlapped_ms, spread) -> None:
    """Medians by (variant, bucket MiB); each size's direction and gap, and which gaps are wider than local's
    spread (compared as printed, one decimal), worked out here on their own."""
    sizes = [0.25, 2.0, 16.0]
    med = {("bucketed", mb): b / 1e3 for mb, b in zip(sizes, bucketed_ms)}
    med |= {("overlapped", mb): o / 1e3 for mb, o in zip(sizes, overlapped_ms)}
    text = bench._overlapped_vs_bucketed(med, sizes, spread)
    assert text.startswith("overlapped's step was ") and "bucketed's at" in text, text
    for mb, b, o in zip(sizes, bucketed_ms, overlapped_ms):
        gap = 1e3 * (b / 1e3 - o / 1e3)
        assert f"{mb:g} MiB (by {abs(gap):.1f} ms)" in text, (mb, text)
        want = "shorter" if gap > 0 else "longer" if gap < 0 else "the same"
        assert _direction_of(text, mb) == want, (mb, text)
    wide = [mb for mb, b, o in zip(sizes, bucketed_ms, overlapped_ms)
            if float(f"{abs(b - o):.1f}") > float(f"{spread:.1f}")]
    tail = text.split(";")[1]
    if not wide:
        assert "none of these gaps is wider" in tail and "noise" in tail, text
    elif len(wide) == len(sizes):
        assert "every gap is wider" in tail, text
    else:
        named = tail.split(" at ")[1].split(" MiB")[0]
        assert sorted(float(x) for x in named.replace(" and ", ", ").split(", ")) == sorted(wide), text


def test_naive_sentence_follows_the_medians() -> None:
    """Medians in seconds; the expectation is worked out here: naive's ratio to local, and the rows not below it."""
    med = {("local", 0.0): 0.040, ("naive", 0.0): 0.120, ("bucketed", 1.0): 0.070, ("overlapped", 1.0): 0.066,
           ("torch", 1.0): 0.055}
    ratio = med[("naive", 0.0)] / med[("local", 0.0)]
    slowest = max((v for v in med if v[0] not in ("local", "naive")), key=med.get)
    text = bench._naive_vs_rest(med)
    assert text.startswith(f"naive took {ratio:.2f}x local's median; every bucketed, overlapped and torch row took")
    assert f"{slowest[0]} at {slowest[1]:g} MiB, {med[slowest] / med[('local', 0.0)]:.2f}x" in text
    slow = med | {("bucketed", 1.0): 0.130}  # a row slower than naive: the sentence must not rank naive last
    text = bench._naive_vs_rest(slow)
    assert "did not rank it last: bucketed at 1 MiB took as long or longer" in text and "every" not in text


@pytest.mark.parametrize("medians_ms, local_max", [((150, 130, 125), 200.0), ((250, 130, 125), 200.0),
                                                  ((250, 230, 225), 200.0), ((200, 200, 200), 200.0)])
def test_verdict_names_the_rows_above_locals_slowest_round(medians_ms, local_max) -> None:
    """The section's plain conclusion: the rows whose median lies above local's slowest round, none, or every one,
    counted here on its own."""
    keys = [("naive", 0.0), ("bucketed", 1.0), ("overlapped", 1.0)]
    med = {("local", 0.0): 0.1} | {k: t / 1e3 for k, t in zip(keys, medians_ms)}
    text = bench._verdict(med, 90.0, local_max)
    above = [k for k, t in zip(keys, medians_ms) if t > local_max]
    if not above:
        assert text.startswith("no measured cost of communicating"), text
    elif len(above) == len(keys):
        assert text.startswith("every version cost measurably more than local"), text
    else:
        named = ["naive" if k == "naive" else f"{k} at {mb:g} MiB" for k, mb in above]
        assert text.startswith(f"of the rows, only {', '.join(named)} had a median above local's band"), text
        assert "inside or below the band" in text, text


def test_above_noise_says_every_row_when_every_row_is_above_local() -> None:
    """Medians in seconds; local's slowest round in ms. All above: "every row", not the list; some: the list."""
    med = {("local", 0.0): 0.100, ("naive", 0.0): 0.150, ("bucketed", 1.0): 0.130, ("overlapped", 1.0): 0.125}
    above, rows, text = bench._above_noise(med, 120.0)
    assert len(above) == 3 and rows == "every row (the fastest at 125 ms)" and "naive" not in text
    above, rows, _ = bench._above_noise(med, 127.0)
    assert rows == "naive (150 ms), bucketed at 1 MiB (130 ms)" and len(above) == 2
    above, rows, text = bench._above_noise(med, 200.0)
    assert above == [] and rows == "none" and text.startswith("no median lies above")



@pytest.mark.parametrize("naive_ms, fastest_ms", [(180.0, 120.0), (210.0, 150.0), (180.0, 170.0), (140.0, 110.0)])
def test_takeaway_gives_naives_cost_and_the_saving_only_beyond_locals_spread(naive_ms, fastest_ms) -> None:
    """Local's rounds 95-145 ms (spread 50), median 100 ms. The take-away's case and numbers, worked out here:
    naive above local's slowest round gives its cost; a saving is claimed only when naive minus the fastest other
    row exceeds the spread; a row below local's median (torch at 90 ms: noise) is never the fastest."""
    med = {("local", 0.0): 0.100, ("naive", 0.0): naive_ms / 1e3, ("bucketed", 2.0): 0.175,
           ("overlapped", 2.0): fastest_ms / 1e3, ("torch", 2.0): 0.090}
    text = bench._takeaway(med, 95.0, 145.0)
    assert "torch at" not in text, text
    if naive_ms <= 145.0:
        assert text.startswith(f"naive's median ({naive_ms:.0f} ms) lies within local's rounds"), text
        assert "cost" not in text.split(":")[0]
        return
    assert text.startswith(f"one all-reduce per parameter (naive) cost {naive_ms - 100:.0f} ms per step over not "
                           f"communicating ({naive_ms / 100:.2f}x local's median)"), text
    if naive_ms - fastest_ms > 50.0:
        band = "above local's band" if fastest_ms > 145.0 else "inside local's band"  # band: local's 95-145 ms
        assert f"row (overlapped at 2 MiB, {band}) took {naive_ms - fastest_ms:.0f} ms less than naive" in text, text
    else:
        assert "does not measure what buckets save" in text and "less than naive" not in text, text
    below = {k: (0.095 if k[0] not in ("local", "naive") else t) for k, t in med.items()}  # every other row noise
    if naive_ms > 145.0:
        assert bench._takeaway(below, 95.0, 145.0).endswith("so the run cannot say what buckets saved")


@pytest.mark.parametrize("fastest", [("overlapped", 16.0), ("overlapped", 2.0), ("bucketed", 16.0)])
def test_takeaway_says_nothing_overlapped_when_the_fastest_overlapped_row_has_one_bucket(fastest) -> None:
    """bench_ddp's default sizes: 16 MiB holds the whole gradient in one bucket, 2 MiB several. The take-away may
    name an overlapped row as the fastest only with the warning that a single bucket overlaps nothing; whether the
    warning is due is worked out here from the bucket counts."""
    buckets = {2.0: 6, 16.0: 1}
    med = {("local", 0.0): 0.100, ("naive", 0.0): 0.200} | {
        (k, mb): 0.170 for k in ("bucketed", "overlapped", "torch") for mb in buckets} | {fastest: 0.120}
    text = bench._takeaway(med, 95.0, 105.0, buckets)
    assert f"({fastest[0]} at {fastest[1]:g} MiB" in text, text
    warned = fastest[0] == "overlapped" and buckets[fastest[1]] == 1
    assert ("nothing overlapped there" in text) == warned, text


@pytest.mark.parametrize("overlapped_ms, spread", [(113.0, 67.0), (113.0, 10.0), (140.0, 67.0), (131.54, 8.0)])
def test_one_bucket_sentence_calls_the_gap_noise_only_within_locals_spread(overlapped_ms, spread) -> None:
    """The figure's 16 MiB point: one bucket, so overlapped and bucketed do the same work there. The read run had
    overlapped 18 ms below bucketed with local's rounds spread over 67 ms; whether the sentence may say "noise",
    and the gap's direction, are worked out here."""
    med = {("bucketed", 2.0): 0.127, ("overlapped", 2.0): 0.116, ("bucketed", 16.0): 0.131,
           ("overlapped", 16.0): overlapped_ms / 1e3}
    text = bench._one_bucket(med, {2.0: 7, 16.0: 1}, spread)
    gap = 131.0 - overlapped_ms
    assert text.startswith("at 16 MiB all the gradients fit in one bucket"), text
    assert f"lies {abs(gap):.1f} ms {'below' if gap > 0 else 'above'} bucketed's" in text, text
    # the same gap, and the same direction, as the per-size sentence gives it
    per_size = bench._overlapped_vs_bucketed(med, [2.0, 16.0], spread)
    assert f"16 MiB (by {abs(gap):.1f} ms)" in per_size, per_size
    assert _direction_of(per_size, 16.0) == ("shorter" if gap > 0 else "longer" if gap < 0 else "the same")
    assert ("noise" in text) == (abs(gap) <= spread), text
    assert "2 MiB" not in text
    assert bench._one_bucket(med, {2.0: 7, 16.0: 2}, spread).startswith("no bucket size of this run holds")
