"""Chapter 3 oracles: the ring all-reduce against dist.all_reduce and numpy, comm_volume against counted messages,
every collective of the tour against numpy, and the composed operations against numpy/torch on the full data."""

from __future__ import annotations

import functools
import json
import math
import operator
import re

import numpy as np
import pytest
import torch

from conftest import load_script, run, scripts_dir, smoke_run
from mlsys.collectives import COLLECTIVES, comm_volume, ring_all_reduce

CH03 = scripts_dir(3)
LENGTHS = [1, 2, 5, 7, 1000, 1001]


# ----------------------------------------------------------------------------------------------- ring all-reduce
def ring_worker(ctx, lengths: list[int]) -> list[dict]:
    import torch.distributed as dist

    out = []
    for n in lengths:
        x = torch.randn(n, generator=torch.Generator().manual_seed(1000 * ctx.rank + n))
        sent = [0]
        ring = ring_all_reduce(x.clone(), on_step=lambda *a: sent.__setitem__(0, sent[0] + a[4]))  # noqa: B023
        builtin = x.clone()
        dist.all_reduce(builtin)
        out.append({"n": n, "ring": ring.tolist(), "builtin": builtin.tolist(), "sent": sent[0]})
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, out)
    return gathered


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_all_reduce_equals_all_reduce_and_numpy(world_size: int) -> None:
    from mlsys.launch import launch

    per_rank = launch(ring_worker, LENGTHS, world_size=world_size, backend="gloo", timeout=60)
    for i, n in enumerate(LENGTHS):
        inputs = np.stack([torch.randn(n, generator=torch.Generator().manual_seed(1000 * r + n)).numpy()
                           for r in range(world_size)]).astype(np.float64)
        for rank in range(world_size):
            row = per_rank[rank][i]
            np.testing.assert_allclose(row["ring"], inputs.sum(0), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(row["ring"], row["builtin"], rtol=1e-5, atol=1e-5)
        # bytes handed to isend: exactly 2(W-1)N over all ranks, for any chunking
        total = sum(per_rank[r][i]["sent"] for r in range(world_size))
        assert total == pytest.approx(world_size * comm_volume("all_reduce", 4 * n, world_size)["sent"])


def test_ring_all_reduce_is_a_no_op_without_peers_and_keeps_shape() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        x = torch.arange(6.0).reshape(2, 3).t()  # non-contiguous (3, 2)
        assert ring_all_reduce(x) is x and torch.equal(x, torch.arange(6.0).reshape(2, 3).t())
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- comm_volume
def messages(collective: str, n: int, w: int) -> list[tuple[int, int, float]]:
    """Every (src, dst, bytes) message of the explicit algorithm comm_volume names, for N bytes on W ranks."""
    piece, root, msgs = n / w, 0, []
    ring = [(r, (r + 1) % w) for r in range(w)]
    if collective == "broadcast":  # a chain 0 -> 1 -> ... -> W-1, the tensor cut into 8 pipelined slices
        msgs = [(r, r + 1, n / 8) for r in range(w - 1) for _ in range(8)]
    elif collective == "scatter":
        msgs = [(root, r, piece) for r in range(w) if r != root]
    elif collective == "gather":
        msgs = [(r, root, piece) for r in range(w) if r != root]
    elif collective in ("all_gather", "reduce_scatter"):
        msgs = [(s, d, piece) for _ in range(w - 1) for s, d in ring]
    elif collective == "all_reduce":
        msgs = [(s, d, piece) for _ in range(2 * (w - 1)) for s, d in ring]
    elif collective == "reduce":  # a chain W-1 -> ... -> 1 -> 0 (the root), partial sums in 8 pipelined slices
        msgs = [(r, r - 1, n / 8) for r in range(w - 1, 0, -1) for _ in range(8)]
    elif collective == "all_to_all":
        msgs = [(s, d, piece) for s in range(w) for d in range(w) if s != d]
    return msgs


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_comm_volume_matches_counted_messages(collective: str, world_size: int) -> None:
    n = 3 * 8 * 1024 * 7 * 5  # divisible by every W here and by the 8 broadcast slices
    msgs = messages(collective, n, world_size)
    sent = [sum(b for s, _, b in msgs if s == r) for r in range(world_size)]
    received = [sum(b for _, d, b in msgs if d == r) for r in range(world_size)]
    v = comm_volume(collective, n, world_size)
    assert v["sent"] == pytest.approx(max(sent)) and v["received"] == pytest.approx(max(received))


def wire_worker(ctx, lengths: list[int]) -> list[dict]:
    """Run the real ring_all_reduce with dist.batch_isend_irecv wrapped: the bytes of every tensor it hands to
    isend and irecv, in order, per rank."""
    import torch.distributed as dist

    real, seen = dist.batch_isend_irecv, []

    def counting(ops):
        seen.extend(("send" if op.op is dist.isend else "recv", op.tensor.nbytes) for op in ops)
        return real(ops)

    dist.batch_isend_irecv = counting
    out = []
    try:
        for n in lengths:
            seen.clear()
            ring_all_reduce(torch.ones(n))
            out.append({"sent": [b for kind, b in seen if kind == "send"],
                        "received": [b for kind, b in seen if kind == "recv"]})
    finally:
        dist.batch_isend_irecv = real
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, out)
    return gathered


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [3, pytest.param(4, marks=pytest.mark.sweep),
                                        pytest.param(7, marks=pytest.mark.sweep)])
def test_ring_bytes_on_the_wire_are_the_searched_ring_on_tensor_split_chunks(world_size: int) -> None:
    """The bytes the real ring hands to isend/irecv, rank by rank and step by step, are those of the ring found
    by search (brute_force_ring, no chunk-index formula) on torch.tensor_split's chunk sizes, empty chunks
    skipped; with W | N every rank sends comm_volume's 2(W-1)/W * N bytes."""
    from mlsys.launch import launch

    lengths = [1, 5, 1000, 1001, 7 * 12]
    per_rank = launch(wire_worker, lengths, world_size=world_size, backend="gloo", timeout=60)
    msgs = brute_force_ring(world_size)
    for i, n in enumerate(lengths):
        sizes = [len(c) * 4 for c in torch.arange(n).tensor_split(world_size)]
        for r in range(world_size):
            want_sent = [sizes[k] for _, src, _, k in msgs if src == r and sizes[k] > 0]
            want_received = [sizes[k] for _, _, dst, k in msgs if dst == r and sizes[k] > 0]
            assert per_rank[r][i]["sent"] == want_sent, (n, r)
            assert per_rank[r][i]["received"] == want_received, (n, r)
            if n % world_size == 0:
                assert sum(want_sent) == comm_volume("all_reduce", 4 * n, world_size)["sent"]


def test_comm_volume_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown collective"):
        comm_volume("allreduce", 8, 2)


# ----------------------------------------------------------------------------------------------- the scripts
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [pytest.param(5, marks=pytest.mark.sweep)])  # with the root last; 1..8: sweep
def test_tour_checks_every_supported_collective(world_size: int, tmp_path) -> None:
    out = tmp_path / "tour.json"
    proc = run([CH03 / "collectives_tour.py", "-w", world_size, "--root", world_size - 1, "--json", out])
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["results"]["collectives"]
    assert len(rows) == 19  # 15 collectives and ops, BAND, BOR, BXOR, the flat all-gather
    assert {r["collective"] for r in rows if not r["supported"]} <= {"all_reduce PREMUL_SUM"}
    expected = rank0_after(world_size, k=2, root=world_size - 1)  # rank 0 is not the root: nothing at gather
    for row in rows:
        name = row["collective"].replace("all_gather_single", "all_gather_flat").replace(
            "all_gather_into_tensor", "all_gather_flat").replace("reduce_scatter_single", "reduce_scatter_flat") \
            .replace("reduce_scatter_tensor", "reduce_scatter_flat")
        if row["supported"] and expected[name] is None:
            assert row["after"] is None, name
        elif row["supported"]:  # exact but AVG, which float32 rounds (1.8)
            assert row["after"] == pytest.approx(expected[name], rel=1e-6), (name, row["after"], expected[name])


def rank0_after(W: int, k: int, root: int) -> dict:
    """What rank 0 must hold after each collective, written element by element from the definitions (not from the
    script's reference lambdas): inputs are the script's own seeded (W, W*k) rows."""
    tour = load_script(CH03 / "collectives_tour.py")
    X = tour.all_inputs(0, W, k).astype(np.int64)  # small integers: every result is exact
    col = lambda j: [int(X[r][j]) for r in range(W)]  # element j of every rank's input
    first = range(k)
    reduce_all = lambda f: [float(f(col(j))) for j in first]
    bits = lambda f: [float(functools.reduce(f, col(j))) for j in first]
    pieces_for_0 = [float(X[r][j]) for r in range(W) for j in range(k)]  # piece 0 of every rank, rank order
    return {
        "broadcast": [float(X[root][j]) for j in first],
        "scatter": [float(X[root][j]) for j in first],
        "gather": None,
        "all_gather": [float(X[r][j]) for r in range(W) for j in first],
        "all_gather_flat": [float(X[r][j]) for r in range(W) for j in first],
        "reduce": None,
        "all_reduce SUM": reduce_all(sum),
        "all_reduce MAX": reduce_all(max),
        "all_reduce MIN": reduce_all(min),
        "all_reduce PRODUCT": reduce_all(math.prod),
        "all_reduce AVG": [float(sum(col(j))) / W for j in first],
        "all_reduce PREMUL_SUM": [2.0 * sum(col(j)) for j in first],
        "all_reduce BAND": bits(operator.and_),
        "all_reduce BOR": bits(operator.or_),
        "all_reduce BXOR": bits(operator.xor),
        "reduce_scatter": [float(sum(col(j))) for j in first],
        "reduce_scatter_flat": [float(sum(col(j))) for j in first],
        "all_to_all": pieces_for_0,
        "all_to_all_single": pieces_for_0,
    }


def tour_with_broken_collectives_worker(ctx) -> list[dict]:
    """Run every case of the tour twice on this rank: with torch's collectives, then with collectives that do
    nothing (the script's `dist` swapped for one whose collectives return at once, outputs left as they were).
    Records which cases the script's own check raised SelfCheckFailed for."""
    import torch.distributed as dist

    from mlsys.cli import SelfCheckFailed

    tour = load_script(CH03 / "collectives_tour.py")
    args = tour.Settings(world_size=ctx.world_size, root=ctx.world_size - 1)
    x = tour.rank_input(args.seed, ctx.rank, ctx.world_size, args.per_rank)
    X = tour.all_inputs(args.seed, ctx.world_size, args.per_rank)
    collectives = {"broadcast", "scatter", "gather", "all_gather", "reduce", "all_reduce", "reduce_scatter",
                   "all_to_all", "all_to_all_single"}

    class NoOp:  # torch.distributed, except that its collectives move nothing
        def __getattr__(self, name):
            return (lambda *a, **k: None) if name in collectives else getattr(dist, name)

    raised = {}
    for broken in (False, True):
        if broken:
            tour.dist, tour.ALL_GATHER_FLAT, tour.REDUCE_SCATTER_FLAT = NoOp(), NoOp().all_gather, NoOp().all_gather
        for name, case in tour.CASES.items():
            try:
                row = tour.run_case(ctx, name, case, x, X, args)
                raised[(broken, name)] = None if row and not row["supported"] else False
            except SelfCheckFailed:
                raised[(broken, name)] = True
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, raised)
    return gathered


@pytest.mark.timeout(120)
def test_tour_reference_catches_collectives_that_move_nothing() -> None:
    """The tour's reference is computed from the inputs, not from what the collectives returned: with torch's
    collectives no case fails its check, and with collectives that move nothing every supported case fails it on
    at least one of three ranks (the root is rank 2)."""
    from mlsys.launch import launch

    per_rank = launch(tour_with_broken_collectives_worker, world_size=3, backend="gloo", timeout=60)
    names = {name for _, name in per_rank[0]}
    supported = {n for n in names if per_rank[0][(False, n)] is not None}
    assert supported >= names - {"all_reduce PREMUL_SUM"} and len(supported) >= 18
    for name in supported:
        assert not any(r[(False, name)] for r in per_rank), name  # torch's collectives pass
        assert any(r[(True, name)] for r in per_rank), name  # doing nothing is caught


def test_tour_figure_shows_where_each_id_went(smoke_cache) -> None:
    """The figure's grids (the smoke run: W=2, root 0, k=2) are the numpy moves of the readable ids base*r + e."""
    proc = smoke_run(smoke_cache, CH03 / "collectives_tour.py")
    assert proc["code"] == 0, proc["stderr"]
    res = proc["json"]["results"]
    w, k, base, fig = 2, 2, res["figure_ids_base"], res["figure"]
    ids = np.arange(w)[:, None] * base + np.arange(w * k)[None, :]  # (W, W*k)
    assert len(set(ids.ravel())) == ids.size  # every element readable as its own id
    first = ids[:, :k]  # the first piece of every rank
    after = {  # rank -> what it holds after, None where nothing is defined (root 0)
        "broadcast": [first[0]] * w, "scatter": list(ids[0].reshape(w, k)),
        "gather": [first.ravel()] + [None] * (w - 1), "all_gather": [first.ravel()] * w,
        "reduce": [first.sum(0)] + [None] * (w - 1), "all_reduce SUM": [first.sum(0)] * w,
        "reduce_scatter": list(ids.sum(0).reshape(w, k)),
        "all_to_all": [ids.reshape(w, w, k)[:, r].ravel() for r in range(w)],
    }
    assert set(fig) == set(after)
    for name, expected in after.items():
        for r, (before, got) in enumerate(fig[name]):
            assert np.array_equal(before, ids[r] if name in ("scatter", "reduce_scatter", "all_to_all") else
                                  first[r])
            assert got is None if expected[r] is None else np.array_equal(got, expected[r]), (name, r)


def check_partials(calls: list[dict], rows: list[np.ndarray], vec: np.ndarray) -> None:
    """The partials picture: what each rank put into each all_reduce and what came back, against numpy on the
    rank's own rows and its np.array_split slice of the vector, then reduced over the ranks here."""
    W, big = len(rows), np.iinfo(np.int64).max
    slices = np.array_split(np.arange(len(vec)), W)
    top = vec.max()
    want_in = []
    for q in range(W):
        x, part = rows[q], vec[slices[q]]
        hits = slices[q][part == top]
        want_in.append([np.concatenate([[len(x)], x.sum(0), (x * x).sum(0)]), part.max(),
                        np.exp(part - top).sum(), part.max(), hits[0] if len(hits) else big])
    want_out = [sum(w[0] for w in want_in), top, sum(w[2] for w in want_in), top, min(w[4] for w in want_in)]
    assert [p["rank"] for p in calls] == list(range(W))
    for q, p in enumerate(calls):
        assert p["slice"] == [int(slices[q][0]), int(slices[q][-1]) + 1]
        assert [c["op"] for c in p["calls"]] == ["SUM", "MAX", "SUM", "MAX", "MIN"]
        for k, c in enumerate(p["calls"]):
            np.testing.assert_allclose(c["in"], want_in[q][k], rtol=1e-5, err_msg=f"rank {q} call {k} in")
            np.testing.assert_allclose(c["out"], want_out[k], rtol=1e-5, err_msg=f"rank {q} call {k} out")


@pytest.mark.timeout(120)
def test_composed_ops_equal_numpy(tmp_path) -> None:
    out = tmp_path / "ops.json"
    proc = run([CH03 / "composed_ops.py", "-w", 3, "--vocab", 17, "--json", out, "--plot-dir", tmp_path])
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "partials.png").stat().st_size > 1000
    res = json.loads(out.read_text())["results"]
    assert res["rows_per_rank"] == [5, 8, 11]
    vec = np.asarray(res["vector"], dtype=np.float64)  # the softmax and argmax, from the input alone, in numpy
    start, stop = res["slice"]
    ref = np.exp(vec - vec.max()) / np.exp(vec - vec.max()).sum()
    assert (start, stop) == (0, 17 // 3 + 1) and np.allclose(res["softmax_slice"], ref[start:stop], rtol=1e-5)
    assert res["argmax_index"] == int(np.argmax(vec)) and res["argmax_value"] == vec.max()
    # mean and variance: what rank 0 computed, against numpy on the rows of all three ranks, concatenated here
    ops = load_script(CH03 / "composed_ops.py")
    settings = ops.Settings(world_size=3, vocab=17)
    rows = np.concatenate([ops.shard_rows(settings.seed, q, settings).numpy() for q in range(3)]).astype(np.float64)
    assert rows.shape == (5 + 8 + 11, settings.dim)
    for name in ("sums", "chan"):
        np.testing.assert_allclose(res[f"{name}_mean"], rows.mean(0), rtol=1e-10)
        np.testing.assert_allclose(res[f"{name}_var"], rows.var(0), rtol=1e-9)
    # the shifted rows (+1e8, float64): Chan within float64 rounding of numpy, the sums formula visibly off
    shifted = np.var(rows + settings.shift, axis=0)
    np.testing.assert_allclose(res["shifted_chan_var"], shifted, rtol=1e-6)
    assert np.abs(np.asarray(res["shifted_sums_var"]) - shifted).max() > 0.1
    # the picture's all_reduces: each rank's own rows and slice, reduced in numpy
    shards = [ops.shard_rows(settings.seed, q, settings).numpy().astype(np.float64) for q in range(3)]
    check_partials(res["all_reduce_calls"], shards, vec)


def test_a_large_shift_breaks_the_sums_formula_but_not_chan() -> None:
    """The lesson's claim, checked on numpy data alone: at a mean of 1e8, E[x^2] - E[x]^2 in float64 is off by
    more than 0.1 on a variance near 4, while Chan's merge of two halves matches numpy's two-pass variance."""
    ops = load_script(CH03 / "composed_ops.py")
    rng = np.random.default_rng(1)
    a, b = 1e8 + rng.normal(0, 2, (9, 3)), 1e8 + rng.normal(0, 2, (14, 3))
    both = np.concatenate([a, b])
    textbook = (both * both).mean(0) - both.mean(0) ** 2
    assert np.abs(textbook - both.var(0)).max() > 0.1

    def stats(x):
        return len(x), torch.tensor(x.mean(0)), torch.tensor(((x - x.mean(0)) ** 2).sum(0))

    n, _, m2 = ops.chan_merge(stats(a), stats(b))
    np.testing.assert_allclose((m2 / n).numpy(), both.var(0), rtol=1e-6)


def test_chan_merge_equals_numpy_on_the_union() -> None:
    ops = load_script(CH03 / "composed_ops.py")
    rng = np.random.default_rng(0)
    a, b = rng.normal(5, 2, (7, 3)), rng.normal(-1, 3, (12, 3))

    def stats(x):
        return len(x), torch.tensor(x.mean(0)), torch.tensor(((x - x.mean(0)) ** 2).sum(0))

    n, mean, m2 = ops.chan_merge(stats(a), stats(b))
    both = np.concatenate([a, b])
    assert n == 19
    np.testing.assert_allclose(mean.numpy(), both.mean(0), rtol=1e-12)
    np.testing.assert_allclose((m2 / n).numpy(), both.var(0), rtol=1e-12)


@pytest.mark.timeout(120)
def test_ring_script_counts_the_formula_bytes(tmp_path) -> None:
    out = tmp_path / "ring.json"
    proc = run([CH03 / "ring_allreduce.py", "-w", 3, "--mib", 0.05, "--repeats", 1, "--json", out])
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())["results"]
    assert [r["numel"] for r in res["lengths"]] == [1, 2, 4, 1001, 13107]
    big = res["lengths"][-1]
    assert big["ring_bytes_sent_max"] == big["formula_bytes_sent"] == 2 * 2 * 13107 * 4 // 3
    assert "reduce-scatter step 1: sent chunk" in proc.stdout and "all-gather     step 1" in proc.stdout
    check_drawn_ring(res["ring_schedule"], res["ring_frames"], world_size=3)


def brute_force_ring(w: int) -> list[tuple[int, int, int, int]]:
    """The ring's messages found by search over contributor sets, with no chunk-index formula: at each step every
    rank r sends one chunk to r+1. Reduce-scatter: the chunk holding the most ranks' data that r+1 shares none of
    (double counting is impossible), ties broken by starting from the rank's own chunk. All-gather: the finished
    chunk r+1 lacks. Returns (step, src, dst, chunk)."""
    held = [[{r} for _ in range(w)] for r in range(w)]  # held[r][k]: ranks whose data chunk k of rank r sums
    out = []
    for step in range(2 * (w - 1)):
        sends = []
        for r in range(w):
            nxt = (r + 1) % w
            if step < w - 1:
                ok = [k for k in range(w) if not held[r][k] & held[nxt][k]]
                best = max(len(held[r][k]) for k in ok)
                sends.append(min((k for k in ok if len(held[r][k]) == best), key=lambda k: (k - r) % w))
            else:
                (k,) = [k for k in range(w) if len(held[r][k]) == w and len(held[nxt][k]) < w]
                sends.append(k)
        before = [[set(c) for c in row] for row in held]  # every send reads the state before the step
        for r, k in enumerate(sends):
            held[(r + 1) % w][k] = before[(r + 1) % w][k] | before[r][k]
            out.append((step, r, (r + 1) % w, k))
    assert all(len(c) == w for row in held for c in row)  # the search did finish an all-reduce
    return out


def check_drawn_ring(schedule: list[dict], frames: list, world_size: int) -> None:
    """The messages the figure drew equal the searched schedule, and replaying them in numpy on 10^r inputs gives
    every frame's values and ends at the all-reduce sum."""
    w = world_size
    assert [(m["step"], m["src"], m["dst"], m["chunk"]) for m in schedule] == brute_force_ring(w)
    state = np.array([[10**r] * w for r in range(w)], dtype=np.int64)  # (rank, chunk)
    assert np.array_equal(frames[0], state)
    for step in range(2 * (w - 1)):
        before = state.copy()
        for m in (m for m in schedule if m["step"] == step):
            incoming = before[m["src"], m["chunk"]]
            state[m["dst"], m["chunk"]] = incoming if step >= w - 1 else state[m["dst"], m["chunk"]] + incoming
        assert np.array_equal(frames[step + 1], state), step
    assert (state == sum(10**r for r in range(w))).all()


def test_brute_force_ring_is_the_textbook_ring() -> None:
    """The search above finds the ring of the lesson's docstring (W=3) and needs 2(W-1) steps at every size."""
    assert [m[3] for m in brute_force_ring(3) if m[1] == 0] == [0, 2, 1, 0]
    for w in range(2, 9):
        assert len(brute_force_ring(w)) == 2 * (w - 1) * w


# ------------------------------------------------------------------------------------------- bytes on the wire
def link_model_schedule(collective: str, w: int) -> list[tuple[int, int, int]]:
    """(step, src, dst) of every piece the collective moves, found by a greedy search over what each rank holds,
    with no index formula: in every step each rank sends at most one piece and receives at most one, along the
    links the algorithm allows (a chain, the root's links, the ring, any pair), always a piece its receiver still
    needs. Root 0; the chains run 0 -> W-1 (broadcast) and W-1 -> 0 (reduce).

    held[r][k] is the set of ranks whose data rank r's piece k holds (for all_to_all: whose block for whom)."""
    everyone = set(range(w))
    mine = [[{r} for _ in range(w)] for r in range(w)]  # every rank holds its own data in every piece
    rooted = [[{0} if r == 0 else set() for _ in range(w)] for r in range(w)]  # only the root holds data
    start = {
        "broadcast": rooted, "scatter": rooted, "reduce": mine, "reduce_scatter": mine, "all_reduce": mine,
        "gather": [[{r} if k == 0 else set() for k in range(w)] for r in range(w)],  # contributions in piece 0
        "all_gather": [[{r} if k == r else set() for k in range(w)] for r in range(w)],  # own piece only
        "all_to_all": [[{(r, k)} for k in range(w)] for r in range(w)],  # rank r's block k is meant for rank k
    }[collective]
    finished = {  # when the collective is done
        "broadcast": lambda h: all(h[r][k] for r in range(w) for k in range(w)),
        "scatter": lambda h: all(h[r][r] for r in range(w)),
        "gather": lambda h: all(h[0][k] == {k} for k in range(w)),
        "all_gather": lambda h: all(h[r][k] == {k} for r in range(w) for k in range(w)),
        "reduce": lambda h: all(h[0][k] == everyone for k in range(w)),
        "reduce_scatter": lambda h: all(h[r][r] == everyone for r in range(w)),
        "all_reduce": lambda h: all(c == everyone for row in h for c in row),
        "all_to_all": lambda h: all(h[r][k] == {(k, r)} for r in range(w) for k in range(w) if k != r),
    }[collective]

    def choose(h: list, src: int, busy: set) -> tuple[int, int] | None:
        """(receiver, piece) that `src` sends this step, or None; `busy`: receivers already taken this step."""
        options: list[tuple[int, int]] = []  # in order of preference
        if collective == "broadcast" and src < w - 1:  # forward down the chain what the next rank lacks
            options = [(src + 1, k) for k in range(w) if h[src][k] and not h[src + 1][k]]
        elif collective == "reduce" and src > 0:  # pass up a partial sum of the whole suffix src..W-1
            options = [(src - 1, k) for k in range(w)
                       if h[src][k] >= set(range(src, w)) and not h[src - 1][k] & h[src][k]]
        elif collective == "scatter" and src == 0:  # the root deals out pieces, lowest rank first
            options = [(d, d) for d in range(1, w) if not h[d][d]]
        elif collective == "gather" and src > 0 and not h[0][src]:  # one piece into the root per step
            options = [(0, src)] if all(h[0][d] for d in range(1, src)) else []
        elif collective == "all_gather":
            options = [((src + 1) % w, k) for k in range(w) if h[src][k] and not h[(src + 1) % w][k]]
        elif collective in ("reduce_scatter", "all_reduce"):
            dst = (src + 1) % w
            if any(h[r][r] != everyone for r in range(w)):  # reducing: the biggest partial sum that would not
                partial = [k for k in range(w) if k != src and not h[src][k] & h[dst][k]]  # count a rank twice,
                options = [(dst, k) for k in sorted(partial, key=lambda k: (-len(h[src][k]), -((k - src) % w)))]
            elif collective == "all_reduce":  # ties: the piece whose owner is farthest ahead; then pass totals on
                options = [(dst, k) for k in range(w) if h[src][k] == everyone and h[dst][k] != everyone]
        elif collective == "all_to_all":  # a block its receiver still lacks, nearest receiver first
            options = [(d, d) for d in sorted(range(w), key=lambda d: (d - src) % w) if d != src and
                       h[d][src] != {(src, d)}]
        return next((o for o in options if o[0] not in busy), None)

    held, out, t = start, [], 0
    while not finished(held):
        before, busy, moves = [[set(c) for c in row] for row in held], set(), []
        for src in range(w):
            choice = choose(before, src, busy)
            if choice is not None:
                busy.add(choice[0])
                moves.append((src, *choice))
        assert moves, f"{collective}: the search is stuck at step {t}"
        for src, dst, k in moves:
            if collective == "all_to_all":  # src's input block for dst (its input is not overwritten) lands in
                held[dst][src] = {(src, dst)}  # slot src of dst's output
            elif collective == "gather":
                held[0][src] = set(before[src][0])
            elif collective in ("broadcast", "scatter", "all_gather") or before[src][k] == everyone != before[dst][k] \
                    and collective == "all_reduce" and all(before[r][r] == everyone for r in range(w)):
                held[dst][k] = set(before[src][k])  # a copy
            else:
                held[dst][k] = before[dst][k] | before[src][k]  # an addition
            out.append((t, src, dst))
        t += 1
    return out


def check_bytes_on_the_wire(res: dict) -> None:
    """Every message the figure drew is one the link-model search finds, with one piece (N/W bytes) each; the
    busiest sender and receiver, counted here, are comm_volume's."""
    w, piece = res["world_size"], res["piece_bytes"]
    assert list(res["messages"]) == list(COLLECTIVES)
    for name, msgs in res["messages"].items():
        assert sorted((m["step"], m["src"], m["dst"]) for m in msgs) == sorted(link_model_schedule(name, w)), name
        assert all(m["bytes"] == piece for m in msgs), name
        sent = [sum(m["bytes"] for m in msgs if m["src"] == r) for r in range(w)]
        received = [sum(m["bytes"] for m in msgs if m["dst"] == r) for r in range(w)]
        v = comm_volume(name, w * piece, w)
        assert (max(sent), max(received)) == (v["sent"], v["received"]), name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [pytest.param(3, marks=pytest.mark.sweep), 4])
def test_bytes_on_the_wire_picture_is_the_link_model_search(world_size: int, tmp_path) -> None:
    out = tmp_path / "b.json"
    proc = run([CH03 / "bytes_on_the_wire.py", "-w", world_size, "--piece-numel", 3, "--json", out,
                "--plot-dir", tmp_path])
    assert proc.returncode == 0, proc.stderr
    check_bytes_on_the_wire(json.loads(out.read_text())["results"])
    assert (tmp_path / "bytes_on_the_wire.png").stat().st_size > 1000


def test_link_model_search_steps() -> None:
    """The search alone: the ring collectives take W-1 steps (all-reduce 2(W-1)), the chains W + W-2, the rooted
    ones W-1 (the root's link is the bottleneck), and every rank sends and receives at most one piece a step."""
    for w in range(2, 9):
        want = {"broadcast": 2 * w - 2, "reduce": 2 * w - 2, "all_reduce": 2 * w - 2}
        for name in COLLECTIVES:
            sched = link_model_schedule(name, w)
            assert 1 + max(t for t, _, _ in sched) == want.get(name, w - 1), (name, w)
            for t in {t for t, _, _ in sched}:
                this = [(s, d) for u, s, d in sched if u == t]
                assert len({s for s, _ in this}) == len(this) == len({d for _, d in this}), (name, w, t)


# ------------------------------------------------------------------------------------ async handles, subgroups
def async_worker(ctx, numel: int) -> dict:
    mod = load_script(CH03 / "async_ops.py")
    gen = torch.Generator().manual_seed(ctx.rank)
    x, mats = torch.randn(numel, generator=gen), [torch.randn(16, 16, generator=gen) for _ in range(2)]
    a, b = x.clone(), x.clone()
    mod.overlapped(a, mats)
    mod.sequential(b, mats)
    return {"overlapped": a.tolist(), "sequential": b.tolist(), "demo": mod.handle_demo(ctx)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_async_all_reduce_after_wait_is_the_numpy_sum(world_size: int) -> None:
    from mlsys.launch import launch

    results = launch(async_worker, 1000, world_size=world_size, backend="gloo", timeout=60)
    inputs = np.stack([torch.randn(1000, generator=torch.Generator().manual_seed(r)).numpy()
                       for r in range(world_size)]).astype(np.float64)
    np.testing.assert_allclose(results["overlapped"], inputs.sum(0), rtol=1e-5, atol=1e-5)
    assert results["overlapped"] == results["sequential"]  # bit for bit: the same collective, only timed apart
    assert results["demo"]["completed_after_wait"] is True


def check_async_timeline(lanes: dict, world_size: int) -> None:
    """The timeline picture, against what any all_reduce must obey: no rank's sum is ready, and no blocking
    all_reduce or wait() returns, before the last rank has entered the all_reduce (the sum needs every input);
    the overlapped order posts, then waits, then returns, and nothing of it waits before the post returned."""
    assert list(lanes) == ["sequential", "overlapped"]
    for order, program in (("sequential", ["all_reduce", "returned"]),
                           ("overlapped", ["all_reduce", "wait(all_reduce)", "returned"])):
        calls = lanes[order]
        last_in = max(c["start_ms"] for c in calls if c["call"] == "all_reduce")
        for q in range(world_size):
            mine = [c for c in calls if c["rank"] == q]
            assert [c["call"] for c in mine] == program, (order, q, mine)
            assert all(a["end_ms"] <= b["start_ms"] for a, b in zip(mine, mine[1:])), (order, q, mine)
            got = mine[-2]  # the call after which the sum may be read: the blocking all_reduce, or wait()
            assert got["end_ms"] >= last_in, (order, q, got, last_in)
            if order == "overlapped":
                assert mine[0]["done_ms"] >= last_in and mine[0]["done_ms"] >= mine[0]["start_ms"], (q, mine)


@pytest.mark.timeout(120)
def test_async_timeline_obeys_the_all_reduce(tmp_path) -> None:
    out = tmp_path / "a.json"
    proc = run([CH03 / "async_ops.py", "-w", 2, "--mib", 1, "--matmuls", 2, "--n", 64, "--repeats", 1,
                "--json", out, "--plot-dir", tmp_path])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    check_async_timeline(results["timeline"], 2)
    assert summary_errors(results["figure_summary"], results["figure_spans"]) == []
    assert (tmp_path / "timeline.png").stat().st_size > 1000


def synthetic_lanes(seq_compute: tuple[float, float], ovl_compute: tuple[float, float], wait: float = 0.5) -> dict:
    """Two ranks' recorded calls with the given compute boxes: sequential all_reduce 0-20 ms, then compute; the
    overlapped post 0-1 ms, then compute, then a wait() of `wait` ms (0.5 by default)."""
    lanes: dict[str, list[dict]] = {"sequential": [], "overlapped": []}
    for q in range(2):
        end = 20 + seq_compute[q]
        lanes["sequential"] += [{"rank": q, "call": "all_reduce", "start_ms": 0.0, "end_ms": 20.0},
                                {"rank": q, "call": "returned", "start_ms": end, "end_ms": end}]
        w = 1 + ovl_compute[q]
        lanes["overlapped"] += [{"rank": q, "call": "all_reduce", "start_ms": 0.0, "end_ms": 1.0, "done_ms": 25.0},
                                {"rank": q, "call": "wait(all_reduce)", "start_ms": w, "end_ms": w + wait},
                                {"rank": q, "call": "returned", "start_ms": w + wait + 0.1,
                                 "end_ms": w + wait + 0.1}]
    return lanes


def test_async_figure_text_follows_the_recorded_spans() -> None:
    mod = load_script(CH03 / "async_ops.py")
    slowed = mod.compute_spans(synthetic_lanes((50.0, 40.0), (75.0, 70.0)))  # overlap slowed the compute by 1.5x+
    assert slowed == {"sequential": {"compute_ms": 50.0, "compute_rank": 0, "compute_by_rank": [50.0, 40.0],
                                     "round_ms": 70.0, "comm_by_rank": [20.0, 20.0], "comm_ms": 20.0},
                      "overlapped": {"compute_ms": 75.0, "compute_rank": 0, "compute_by_rank": [75.0, 70.0],
                                     "round_ms": 76.6, "wait_by_rank": [0.5, 0.5], "wait_ms": 0.5,
                                     "wait_max_ms": 0.5}}
    text = mod.figure_text(slowed)
    assert "took 1.5x to 1.8x the same rank's sequential compute" in text and "slowed the matmuls" in text
    assert "rank 0: 75.0 ms overlapped against 50.0 ms sequential; rank 1: 70.0 ms overlapped against 40.0" in text
    assert "ended no sooner" in text and "even where wait() found the sum ready, nothing was saved" in text
    # a long wait() (about the whole all-reduce) never found the sum ready: the clause is left out
    waited = mod.compute_spans(synthetic_lanes((10.0, 10.0), (10.0, 10.0), wait=32.0))
    assert waited["overlapped"]["wait_ms"] == 32.0
    long_wait = mod.figure_text(waited)
    assert "ended no sooner" in long_wait and "nothing was saved" in long_wait
    assert "found the sum ready" not in long_wait
    # boxes are compared rank by rank, never across ranks: each panel's longest box (52 ms on rank 0 against 50 ms
    # on rank 1) would read "about its sequential time", but rank 0 took 1.3x and rank 1 about 1.0x
    spans = mod.compute_spans(synthetic_lanes((40.0, 50.0), (52.0, 48.0)))
    mixed = mod.figure_text(spans)
    assert "took 1.0x to 1.3x the same rank's sequential compute" in mixed and "ranks disagree" in mixed
    assert "rank 0: 52.0 ms overlapped against 40.0 ms sequential" in mixed
    assert "about" not in mixed and "ended 16.4 ms sooner" in mixed
    # rank 0 doubled, rank 1 barely moved: the longest boxes (20.1 on rank 0 against 11.2 on rank 1) would say 1.8x
    crossed = mod.figure_text(mod.compute_spans(synthetic_lanes((10.0, 11.2), (20.1, 11.5))))
    assert "1.8x" not in crossed and "ranks disagree" in crossed and "slowed" not in crossed
    same = mod.figure_text(mod.compute_spans(synthetic_lanes((40.0, 50.0), (42.0, 49.0))))
    assert "took about the same rank's sequential compute time" in same
    # the drawn round beside the table's medians: a direction only when all three agree
    medians = {"compute": 30.0, "communication": 20.0, "sequential": 50.0, "overlapped": 40.0}
    assert "single sample, slower than the table's medians" in mod.figure_note(spans, medians)
    assert "50.0 ms (rank 1) against the compute median of 30.0 ms" in mod.figure_note(spans, medians)
    assert "faster than" in mod.figure_note(spans, {k: 3 * v for k, v in medians.items()})
    assert "single sample, not the table's medians" in mod.figure_note(spans, {**medians, "sequential": 90.0})
    faster = mod.figure_text(mod.compute_spans(synthetic_lanes((50.0, 50.0), (30.0, 20.0))))
    assert "took 0.4x to 0.6x" in faster and "vary that much" in faster
    assert "too short to compare" in mod.figure_text(mod.compute_spans(synthetic_lanes((0.5, 0.5), (2.0, 2.0))))


def summary_errors(text: str, spans: dict) -> list[str]:
    """What is wrong in the summary of the drawn round, judged from the recorded spans by rules written here: one
    reading per rank, "rank q waited W ms against C ms", with that rank's recorded numbers and the case they fall in
    (wait under half the blocking all_reduce: "most of its bytes"; above 80%: "few if any"; in between: "part of
    its bytes"); the round "ended sooner" only if the overlapped round's end is below the sequential one's,
    "nothing was saved" otherwise; "yet" only after a wait of at most 80% of the blocking all_reduce on every rank;
    "slowed" only if every rank's overlapped box is longer than its sequential one. With (almost) no compute between
    post and wait(), no direction at all."""
    seq, ovl = spans["sequential"], spans["overlapped"]
    waits, comms = ovl["wait_by_rank"], seq["comm_by_rank"]
    if max(ovl["compute_by_rank"]) < max(1.0, 0.05 * max(comms)):
        return [word for word in ("of its bytes", "sooner", "saved", "slowed", "yet") if word in text]
    errors = []
    pattern = r"rank (\d+) waited ([\d.]+) ms against ([\d.]+) ms for its blocking all_reduce, ([^;]*)"
    read = {int(q): (float(w), float(c), how) for q, w, c, how in re.findall(pattern, text)}
    for q, (w, c) in enumerate(zip(waits, comms)):
        case = ("too short" if c < 1.0 else "most of its" if w < 0.5 * c else "few if any" if w > 0.8 * c else
                "part of its")
        if q not in read or read[q][:2] != (w, c) or case not in read[q][2]:
            errors.append(f"rank {q}")
    if ("ended" in text and "sooner" in text) != (ovl["round_ms"] < seq["round_ms"]):
        errors.append("sooner")
    if ("nothing was saved" in text) == (ovl["round_ms"] < seq["round_ms"]):
        errors.append("saved")
    if "yet" in text and not all(w <= 0.8 * c for w, c in zip(waits, comms)):
        errors.append("yet")
    if "slowed" in text and not all(o > s for o, s in zip(ovl["compute_by_rank"], seq["compute_by_rank"])):
        errors.append("slowed")
    return errors


def test_async_figure_summary_states_only_directions_the_spans_show() -> None:
    mod = load_script(CH03 / "async_ops.py")
    # the run the reader saw: waits of 2.6 and 1.7 ms against 9.9 and 10.0 ms, boxes 10.5 -> 14.9 and 15.7 ms
    seen = {"sequential": {"compute_by_rank": [10.5, 10.5], "round_ms": 20.5, "comm_by_rank": [9.9, 10.0]},
            "overlapped": {"compute_by_rank": [14.9, 15.7], "round_ms": 21.4, "wait_by_rank": [2.6, 1.7]}}
    text = mod.figure_summary(seen)
    assert text == ("rank 0 waited 2.6 ms against 9.9 ms for its blocking all_reduce, so most of its bytes moved "
                    "during the compute; rank 1 waited 1.7 ms against 10.0 ms for its blocking all_reduce, so most "
                    "of its bytes moved during the compute; yet nothing was saved (the round ended at 21.4 ms "
                    "against 20.5 ms), because the compute slowed on every rank (rank 0 from 10.5 to 14.9 ms)"), text
    # the run a reader found unreadable: rank 0 waited 6.2 of 17.3 ms (most), rank 1 11.8 of 17.3 ms (part)
    split = {"sequential": {"compute_by_rank": [10.9, 10.4], "round_ms": 28.2, "comm_by_rank": [17.3, 17.3]},
             "overlapped": {"compute_by_rank": [18.4, 13.5], "round_ms": 25.4, "wait_by_rank": [6.2, 11.8]}}
    assert mod.figure_summary(split) == (
        "rank 0 waited 6.2 ms against 17.3 ms for its blocking all_reduce, so most of its bytes moved during the "
        "compute; rank 1 waited 11.8 ms against 17.3 ms for its blocking all_reduce, so part of its bytes moved "
        "during the compute; and the round ended 2.8 ms sooner (25.4 ms against 28.2 ms)")
    cases = [seen, split, mod.compute_spans(synthetic_lanes((50.0, 40.0), (75.0, 70.0))),  # slowed, no gain
             mod.compute_spans(synthetic_lanes((50.0, 50.0), (30.0, 20.0))),  # faster compute, ended sooner
             mod.compute_spans(synthetic_lanes((10.0, 10.0), (10.0, 10.0), wait=32.0)),  # long wait, no gain
             mod.compute_spans(synthetic_lanes((10.0, 10.0), (10.0, 10.0), wait=12.0)),  # part of the bytes
             mod.compute_spans(synthetic_lanes((40.0, 50.0), (52.0, 48.0)))]  # ranks disagree on the compute
    for spans in cases:
        text = mod.figure_summary(spans)
        assert summary_errors(text, spans) == [], (text, spans)
    assert "slowed" not in mod.figure_summary(cases[-1]) and "sooner" in mod.figure_summary(cases[3])
    assert "yet" not in mod.figure_summary(cases[4]) and "few if any" in mod.figure_summary(cases[4])
    # the checker catches a sentence whose direction is planted the wrong way round
    good = mod.figure_summary(seen)
    assert summary_errors(good.replace("yet nothing was saved", "and the round ended sooner"), seen) == ["sooner",
                                                                                                       "saved"]
    flipped = {"sequential": {**seen["sequential"], "compute_by_rank": [14.9, 15.7]},
               "overlapped": {**seen["overlapped"], "compute_by_rank": [10.5, 10.5]}}
    assert summary_errors(good, flipped) == ["slowed"]
    assert summary_errors(good, {**seen, "overlapped": {**seen["overlapped"], "wait_by_rank": [9.0, 9.5]}}) == [
        "rank 0", "rank 1", "yet"]
    # a wrong reading of one rank: rank 1 read as "most" where its wait was 68% of its blocking call
    planted = mod.figure_summary(split).replace("so part of its", "so most of its")
    assert summary_errors(planted, split) == ["rank 1"]
    assert summary_errors(mod.figure_summary(split).replace("rank 1 waited", "rank 2 waited"), split) == ["rank 1"]
    # no compute between post and wait(): no direction at all
    idle = mod.figure_summary(mod.compute_spans(synthetic_lanes((0.0, 0.0), (0.0, 0.0), wait=11.8)))
    assert idle.startswith("no compute ran") and "says nothing about overlap" in idle
    assert not any(word in idle for word in ("of its bytes", "sooner", "slowed", "yet"))


def test_async_figure_lines_claim_no_overlap_without_compute() -> None:
    """--matmuls 0: no compute between post and wait(). A wait() shorter than the blocking all_reduce, or an
    overlapped round that ended sooner, is then no sign that bytes moved during a compute: both lines say so."""
    mod = load_script(CH03 / "async_ops.py")
    # the run the reader saw: waits of 11.8 and 14.0 ms against a 20 ms blocking all_reduce, no compute at all
    lanes = synthetic_lanes((0.0, 0.0), (0.0, 0.0), wait=11.8)
    lanes["overlapped"][4:] = synthetic_lanes((0.0, 0.0), (0.0, 0.0), wait=14.0)["overlapped"][3:]
    spans = mod.compute_spans(lanes)
    wait, text = mod.wait_reading(spans), mod.figure_text(spans)
    assert "much shorter" not in wait and "moved during the compute" not in wait, wait
    assert "no compute" in text and "not a gain from overlap" in text, text
    assert spans["overlapped"]["wait_by_rank"] == [11.8, 14.0] and mod.no_compute(spans)
    assert wait.startswith("wait() against the same rank's blocking all_reduce above: rank 0 11.8 ms against "
                           "20.0 ms; rank 1 14.0 ms against 20.0 ms: no compute ran"), wait
    assert "only measured the all-reduce itself" in wait
    # both rounds ended: sequential at 20 ms, overlapped at 1 + 14.0 + 0.1 = 15.1 ms, "sooner" but not by overlap
    assert text.startswith("there was no compute to overlap (at most 0.0 ms between post and wait() on any rank)")
    assert "ended 4.9 ms sooner" in text and "not a gain from overlap" in text
    assert "slowed" not in text and "too short to compare" not in text
    later = mod.figure_text(mod.compute_spans(synthetic_lanes((0.0, 0.0), (0.0, 0.0), wait=32.0)))
    assert "no compute to overlap" in later and "ended no sooner" in later and "found the sum ready" not in later
    # a compute box that is negligible against the all-reduce (0.8 ms against 20 ms) counts as none
    assert mod.no_compute(mod.compute_spans(synthetic_lanes((0.8, 0.8), (0.8, 0.8), wait=5.0)))
    assert not mod.no_compute(mod.compute_spans(synthetic_lanes((2.0, 2.0), (2.0, 2.0), wait=5.0)))


def test_async_wait_reading_judges_the_wait_against_the_blocking_all_reduce() -> None:
    mod = load_script(CH03 / "async_ops.py")

    def reading(wait: float) -> str:  # both ranks wait `wait` ms; the blocking all_reduce took 20 ms
        return mod.wait_reading(mod.compute_spans(synthetic_lanes((10.0, 10.0), (10.0, 10.0), wait=wait)))

    def spans(comms: list[float], waits: list[float], boxes: list[float] | None = None) -> dict:
        return {"sequential": {"comm_by_rank": comms, "comm_ms": max(comms)},
                "overlapped": {"wait_by_rank": waits, "compute_by_rank": boxes or [10.0] * len(waits)}}

    assert reading(0.5) == ("wait() against the same rank's blocking all_reduce above: rank 0 0.5 ms against 20.0 ms; "
                            "rank 1 0.5 ms against 20.0 ms: "
                            "much shorter, so most of the bytes moved during the compute")
    # rank by rank: rank 1's 7.0 ms wait is judged against rank 1's 23.8 ms blocking call, not rank 0's 12.0 ms
    drawn = mod.wait_reading(spans([12.0, 23.8], [4.2, 7.0]))
    assert drawn.startswith("wait() against the same rank's blocking all_reduce above: rank 0 4.2 ms against 12.0 ms; "
                            "rank 1 7.0 ms against 23.8 ms: much shorter"), drawn
    assert "part of the bytes moved during the compute, the rest after it" in reading(12.0)
    assert "about as long, so almost none of the bytes moved" in reading(18.0)
    assert "different cases, so this round names none" in mod.wait_reading(spans([20.0, 20.0], [2.0, 19.0]))
    # against the longest blocking call (20 ms) rank 1's 9 ms wait would be "part"; against its own 10 ms, "none"
    assert "different cases" in mod.wait_reading(spans([20.0, 10.0], [2.0, 9.0]))
    # four ranks: only the two extremes are named, and the line says so
    four = mod.wait_reading(spans([20.0] * 4, [2.0, 3.0, 1.0, 4.0]))
    assert "rank 2 1.0 ms against 20.0 ms; rank 3 4.0 ms against 20.0 ms (the extremes of the 4 ranks)" in four
    assert "too short to compare" in mod.wait_reading(spans([0.4, 0.4], [0.3, 0.3], [2.0, 2.0]))


def groups_worker(ctx, R: int, C: int) -> list[dict]:
    import torch.distributed as dist

    mod = load_script(CH03 / "subgroups.py")
    rows, cols = mod.make_groups(R, C)
    i, j = divmod(ctx.rank, C)
    x = torch.tensor([float(ctx.rank), float(ctx.rank) ** 2])
    out = {k: v.tolist() for k, v in mod.in_groups(x, rows[i], cols[j], C).items()}
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, out)
    return gathered


@pytest.mark.timeout(120)
@pytest.mark.parametrize("R, C", [(2, 2), (2, 3), (3, 2)])
def test_row_and_column_groups_against_numpy(R: int, C: int) -> None:
    """Rank g at (i, j) = divmod(g, C) holds [g, g^2]: its row's sum, its column's vectors, the column's top."""
    from mlsys.launch import launch

    per_rank = launch(groups_worker, R, C, world_size=R * C, backend="gloo", timeout=60)
    g = np.arange(R * C, dtype=np.float64)
    grid = np.stack([g, g ** 2], axis=-1).reshape(R, C, 2)
    for rank, got in enumerate(per_rank):
        i, j = divmod(rank, C)
        np.testing.assert_array_equal(got["row_sum"], grid[i].sum(0))
        np.testing.assert_array_equal(got["col_gather"], grid[:, j])
        np.testing.assert_array_equal(got["col_top"], grid[0, j])


def check_group_cells(cells: list[dict], R: int, C: int, x: np.ndarray) -> None:
    """The groups picture: rank g's cell sits at divmod(g, C), its row and column groups are the rows and columns
    of arange(W).reshape(R, C), and what it got is numpy's row sum and the column's first x."""
    ranks = np.arange(R * C).reshape(R, C)
    assert [c["rank"] for c in cells] == list(range(R * C))
    for g, c in enumerate(cells):
        i, j = divmod(g, C)
        assert c["at"] == [i, j] and c["x"] == x[g].tolist()
        assert c["row_group"] == ranks[i].tolist() and c["col_group"] == ranks[:, j].tolist(), c
        assert c["row_sum"] == x[ranks[i]].sum(0).tolist() and c["col_top"] == x[ranks[0, j]].tolist(), c


@pytest.mark.timeout(120)
def test_groups_picture_against_numpy_on_the_grid(tmp_path) -> None:
    out = tmp_path / "g.json"
    proc = run([CH03 / "subgroups.py", "-w", 6, "--rows", 2, "--seed", 5, "--json", out, "--plot-dir", tmp_path])
    assert proc.returncode == 0, proc.stderr[-3000:]
    x = np.random.default_rng(5).integers(0, 10, size=(6, 3)).astype(np.float64)  # rank g's vector, as documented
    check_group_cells(json.loads(out.read_text())["results"]["cells"], 2, 3, x)
    assert (tmp_path / "groups.png").stat().st_size > 1000


@pytest.mark.timeout(60)
def test_subgroups_refuses_a_grid_that_does_not_fit() -> None:
    proc = run([CH03 / "subgroups.py", "-w", 6, "--rows", 4])
    assert proc.returncode == 2 and "--rows must divide the world size 6" in proc.stderr


def test_async_summary_rounds_as_printed_and_names_the_impossible_cases() -> None:
    mod = load_script(CH03 / "async_ops.py")
    # worked by hand: (24.5 + 10.0 - 20.1) / 10.0 = 1.44; overlapped 20.1 < compute 24.5, which only noise explains
    shown, hidden, verdict = mod.summarize({"compute": 24.54, "communication": 10.04, "sequential": 44.62,
                                            "overlapped": 20.14})
    assert shown == {"compute": 24.5, "communication": 10.0, "sequential": 44.6, "overlapped": 20.1}
    assert hidden == 1.44 and "below its longer part alone" in verdict
    # hidden must follow from the printed values: (25.0 + 4.3 - 26.3) / 4.3 = 0.6977 (the raw values: 0.682)
    _, hidden, verdict = mod.summarize({"compute": 24.96, "communication": 4.34, "sequential": 30.04,
                                        "overlapped": 26.34})
    assert hidden == 0.70 and "between" in verdict
    # (30 + 20 - 52) / 20 = -0.1: slower than the two parts one after the other
    _, hidden, verdict = mod.summarize({"compute": 30.0, "communication": 20.0, "sequential": 50.0,
                                        "overlapped": 52.0})
    assert hidden == -0.1 and "nothing was hidden" in verdict
    # (20.5 + 13.9 - 29.9) / 13.9 = 0.3237, but overlapped 29.9 >= sequential 29.8: no clear gain
    _, hidden, verdict = mod.summarize({"compute": 20.5, "communication": 13.9, "sequential": 29.8,
                                        "overlapped": 29.9})
    assert hidden == 0.32 and "no clear gain" in verdict
