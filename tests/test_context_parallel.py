"""Context parallelism (mlsys/context_parallel.py): ring attention and Ulysses against one process.

The oracle is torch's scaled_dot_product_attention(is_causal=True) on the whole sequence, in one process, in
float64: the output and the gradients of q, k and v, gathered from the shards, must equal it. The zigzag split
is checked against a brute-force list of positions, the causal work per rank against a count of the mask's ones,
the merge against numpy's softmax over the concatenated scores, and the bytes each rank sends against the
formula, counted on real ranks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mlsys import context_parallel as cp


# ----------------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("seq,world", [(16, 2), (24, 3), (32, 4), (8, 1)])
def test_zigzag_and_contiguous_splits_cover_every_position_once(seq: int, world: int) -> None:
    for layout in cp.LAYOUTS:
        held = [list(range(a, b)) for r in range(world) for a, b in cp.shard_chunks(seq, world, r, layout)]
        assert sorted(p for run in held for p in run) == list(range(seq))
    c = seq // (2 * world)
    for r in range(world):  # zigzag by hand: chunk r and chunk 2W-1-r
        want = list(range(r * c, (r + 1) * c)) + list(range((2 * world - 1 - r) * c, (2 * world - r) * c))
        got = [p for a, b in cp.shard_chunks(seq, world, r, "zigzag") for p in range(a, b)]
        assert got == want
    x = torch.arange(seq).view(1, 1, seq, 1)
    for layout in cp.LAYOUTS:
        parts = [cp.shard(x, world, r, layout) for r in range(world)]
        assert torch.equal(cp.unshard(parts, layout), x)


@pytest.mark.parametrize("seq,world", [(64, 2), (64, 4), (96, 3), (128, 8)])
def test_causal_work_is_the_count_of_visible_pairs_and_zigzag_balances_it(seq: int, world: int) -> None:
    mask = np.tril(np.ones((seq, seq), dtype=np.int64))  # mask[i, j] = 1 when query i sees key j
    for layout in cp.LAYOUTS:
        want = [int(sum(mask[p].sum() for a, b in cp.shard_chunks(seq, world, r, layout) for p in range(a, b)))
                for r in range(world)]
        assert cp.causal_work(seq, world, layout) == want
    assert len(set(cp.causal_work(seq, world, "zigzag"))) == 1  # every rank the same work
    if world > 1:
        contiguous = cp.causal_work(seq, world, "contiguous")
        # the last rank does about (2W-1) x the first's work (exactly so as the chunks grow: the diagonal halves)
        assert contiguous[-1] / contiguous[0] == pytest.approx(2 * world - 1, rel=0.1)


def test_merge_equals_softmax_over_both_blocks() -> None:
    rng = np.random.default_rng(0)
    s1, s2 = rng.normal(size=(3, 5)) * 4, rng.normal(size=(3, 7)) * 4
    v1, v2 = rng.normal(size=(5, 2)), rng.normal(size=(7, 2))
    s = np.concatenate([s1, s2], axis=1)
    p = np.exp(s - s.max(1, keepdims=True))
    want = (p / p.sum(1, keepdims=True)) @ np.concatenate([v1, v2])

    def partial(sc, vv):
        sc = torch.tensor(sc)
        lse = torch.logsumexp(sc, -1)
        return torch.exp(sc - lse[:, None]) @ torch.tensor(vv), lse

    out, lse = partial(s1, v1)
    out2, lse2 = partial(s2, v2)
    cp.merge(out, lse, out2, lse2)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), np.log(np.exp(s).sum(1)), rtol=1e-12)


def test_ring_at_one_rank_is_blockwise_attention_equal_to_sdpa() -> None:
    """W = 1 needs no process group: the tiled kernel and its backward alone against SDPA."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 8, dtype=torch.float64) for _ in range(3))
    dout = torch.randn_like(q)
    scale = 8 ** -0.5
    for layout in cp.LAYOUTS:
        chunks = cp.shard_chunks(40, 1, 0, layout)
        out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
        cp.block_attention(q, k, v, chunks, chunks, out, lse, scale, q_tile=7)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        cp.block_attention_backward(q, k, v, dout, lse, (dout * out).sum(-1), chunks, chunks, dq, dk, dv, scale,
                                    q_tile=7)
        qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
        ref.backward(dout)
        for name, got, want in (("out", out, ref), ("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
            torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-10, msg=f"{layout} {name}")


def messages_one_rank_sends(method: str, seq: int, world: int, heads: int, head_dim: int, batch: int,
                            dtype: torch.dtype) -> dict[str, list[torch.Tensor]]:
    """Every tensor one rank puts on the wire for one attention layer, built as a real tensor and listed message
    by message from the algorithm's steps, not from a byte formula.

    ring: forward, at each of the W-1 steps the K and V block it holds goes to the next rank; backward, K and V
    travel the same W-1 hops again, and the dK, dV accumulators travel W hops (all the way round, home).
    ulysses: each of q, k, v and the output (forward), and of their gradients (backward), is one all-to-all of the
    rank's (B, H, S/W, D) shard split into W head groups; the group for the rank itself stays home."""
    shard = torch.empty(batch, heads, seq // world, head_dim, dtype=dtype)
    if method == "ring":
        k, v = shard.clone(), shard.clone()
        return {"forward": [k, v] * (world - 1), "backward": [k, v] * (world - 1) + [k.clone(), v.clone()] * world
                if world > 1 else []}
    groups = shard.tensor_split(world, dim=1)  # heads split over the ranks
    away = [g for r, g in enumerate(groups) if r != 0]  # seen from rank 0; every rank sends the same sizes
    return {"forward": away * 4, "backward": away * 4}


@pytest.mark.parametrize("method,seq,world,batch,dtype", [
    ("ring", 6, 2, 1, torch.float32), ("ring", 8, 4, 2, torch.float64), ("ring", 4, 1, 1, torch.float32),
    ("ulysses", 4, 2, 1, torch.float32), ("ulysses", 12, 4, 3, torch.float64), ("ulysses", 3, 1, 1, torch.float32)])
def test_comm_bytes_formula_against_the_messages_counted_one_by_one(method, seq, world, batch, dtype) -> None:
    """The closed form against a brute-force count: the bytes of every message, summed (numel x element size)."""
    counted = {phase: sum(t.numel() * t.element_size() for t in messages)
               for phase, messages in messages_one_rank_sends(method, seq, world, 4, 2, batch, dtype).items()}
    size = torch.empty(0, dtype=dtype).element_size()
    assert cp.comm_bytes(method, seq, world, heads=4, head_dim=2, batch=batch, dtype_bytes=size) == counted


# ----------------------------------------------------------------------------------------------- on real ranks
def cp_worker(ctx, seq: int, heads: int) -> dict:
    """Every method on this rank's shard; outputs and grads gathered to rank 0 with the bytes each rank sent."""
    import torch.distributed as dist

    world, rank, group = ctx.world_size, ctx.rank, dist.group.WORLD
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, heads, seq, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(2, heads, seq, 8, generator=gen, dtype=torch.float64)
    from conftest import load_script, scripts_dir

    trace_ring_steps = load_script(scripts_dir(6) / "context_parallel.py").trace_ring_steps
    results = {}
    methods = [("ring", "zigzag"), ("ring", "contiguous")] + ([("ulysses", "contiguous")] if heads % world == 0 else [])
    for method, layout in methods:
        padded = cp.padded_length(seq, world, layout)
        pad = (0, 0, 0, padded - seq)
        local = [cp.shard(F.pad(t, pad), world, rank, layout).requires_grad_(True) for t in (q, k, v)]
        with cp.comm_log() as log, trace_ring_steps() as steps:
            if method == "ring":
                out = cp.ring_attention(*local, group=group, layout=layout, q_tile=5)
                steps = list(steps)  # the blocks of the forward pass, as the kernel was handed them
            else:
                out = cp.ulysses_attention(*local, group=group)
            out.backward(cp.shard(F.pad(dout, pad), world, rank, layout))
        tensors = [out.detach()] + [t.grad for t in local]
        gathered = []
        for t in tensors:
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t)
            gathered.append(cp.unshard(parts, layout)[..., :seq, :].numpy())  # numpy: tensors do not cross the pipe
        sent = {phase: sum(e.nbytes for e in log if e.phase == phase) for phase in ("forward", "backward")}
        every = [None] * world
        dist.all_gather_object(every, steps if method == "ring" else [])
        results[f"{method}-{layout}"] = {"tensors": gathered, "sent": sent, "padded": padded, "ring_steps": every}
    return results


def simulate_ring(seq: int, world: int, layout: str) -> list[list[dict]]:
    """The ring by hand, in token positions: rank r's runs (zigzag: chunks r and 2W-1-r of 2W; contiguous: the
    r-th of W); at step i every rank holds the K/V that started on rank r - i (each step passes them to r + 1);
    a (query run, key run) pair is scored when some query sees some key, masked when some key lies after some
    query: both counted by brute force over the positions."""
    c = seq // (2 * world)
    if layout == "zigzag":
        runs = [[[r * c, (r + 1) * c], [(2 * world - 1 - r) * c, (2 * world - r) * c]] for r in range(world)]
    else:
        w = seq // world   # contiguous pads to a multiple of W only, so a run is not always 2 zigzag chunks
        runs = [[[r * w, (r + 1) * w]] for r in range(world)]
    out = []
    for r in range(world):
        steps = []
        for i in range(world):
            kv = runs[(r - i) % world]
            pairs = [[qr, kr, any(q < k for q in range(*qr) for k in range(*kr))] for qr in runs[r] for kr in kv
                     if any(q >= k for q in range(*qr) for k in range(*kr))]
            steps.append({"q": runs[r], "kv": kv, "pairs": pairs})
        out.append(steps)
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world,seq,heads", [(2, 24, 4), (4, 32, 4), (4, 29, 4), (3, 20, 4)])
def test_ring_and_ulysses_equal_full_attention_forward_and_backward(world: int, seq: int, heads: int) -> None:
    from mlsys.launch import launch

    results = launch(cp_worker, seq, heads, world_size=world, backend="gloo", timeout=80)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, heads, seq, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(2, heads, seq, 8, generator=gen, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref.backward(dout)
    want = [ref.detach(), q.grad, k.grad, v.grad]
    expected = {"ring-zigzag", "ring-contiguous"} | ({"ulysses-contiguous"} if heads % world == 0 else set())
    assert set(results) == expected
    for key, res in results.items():
        for name, got, w in zip(("output", "dq", "dk", "dv"), res["tensors"], want, strict=True):
            torch.testing.assert_close(torch.from_numpy(got), w, rtol=1e-9, atol=1e-9,
                                       msg=f"W={world} S={seq} {key} {name}")
        method = key.split("-")[0]
        formula = cp.comm_bytes(method, res["padded"], world, heads, 8, batch=2, dtype_bytes=8)
        assert res["sent"] == formula, f"{key}: counted {res['sent']}, formula {formula}"
        if method == "ring":  # the blocks the kernel was handed, step by step (what ring.gif draws)
            want_steps = simulate_ring(res["padded"], world, key.split("-")[1])
            for r, (got_r, want_r) in enumerate(zip(res["ring_steps"], want_steps, strict=True)):
                assert [{**g, "pairs": sorted(g["pairs"])} for g in got_r] == \
                       [{**w, "pairs": sorted(w["pairs"])} for w in want_r], f"{key} rank {r}"


@pytest.mark.parametrize("flags,message", [(["-w", "4", "--lengths", "4"], "each at least 2W = 8"),
                                           (["--seq", "0"], "--seq must be >= 1"),
                                           (["--lengths", "70000"], "at most 65536")])
def test_script_bad_flags_exit_2_with_one_line(flags: list[str], message: str) -> None:
    from conftest import run, scripts_dir

    proc = run([scripts_dir(6) / "context_parallel.py", *flags])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


@pytest.mark.timeout(120)
def test_ring_and_ulysses_pictures_draw_the_real_layout(smoke_cache) -> None:
    """ring.gif draws, per step and rank, the K/V chunks the kernel was handed and the (query, key) chunk pairs it
    scored, in zigzag chunk units; ulysses.png which rank holds each (head, token) before and after the all-to-all.
    Both read from the smoke run's JSON and held to a simulation by hand."""
    from conftest import scripts_dir, smoke_run

    proc = smoke_run(smoke_cache, scripts_dir(6) / "context_parallel.py")
    assert proc["code"] == 0, proc["stderr"][-3000:]
    res, settings = proc["json"]["results"], proc["json"]["settings"]
    world = settings["world_size"]
    padded = next(e["padded_to"] for e in res["equality"] if e["method"] == "ring" and e["layout"] == "zigzag")
    c = padded // (2 * world)
    drawn = {(d["step"], d["rank"]): d for d in res["ring_drawn"]}
    assert len(drawn) == world * world
    for (i, r), d in drawn.items():
        want = simulate_ring(padded, world, "zigzag")[r][i]
        assert d["kv"] == [a // c for a, _ in want["kv"]] == [(r - i) % world, 2 * world - 1 - (r - i) % world]
        assert sorted(d["pairs"]) == sorted([qr[0] // c, kr[0] // c, m] for qr, kr, m in want["pairs"])
    heads, tokens = settings["heads"], res["ulysses_layout"]["tokens"]
    assert res["ulysses_layout"]["before"] == [[t // (tokens // world) for t in range(tokens)] for _ in range(heads)]
    assert res["ulysses_layout"]["after"] == [[h // (heads // world)] * tokens for h in range(heads)]
    assert {"ring.gif", "ring_strip.png", "ulysses.png"} <= {p.name for p in Path(proc["plot_dir"]).iterdir()}
