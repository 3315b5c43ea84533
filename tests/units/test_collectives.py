"""mlsys.collectives with rank 0 in the test's own process: each all-reduce against a plain sum.

The chapter tests run the collectives inside scripts' worker processes, which mutation testing cannot see (mutmut
maps a mutant to the tests that reach it in the pytest process). Here the test process is rank 0 of a real gloo
group and forked children are ranks 1..W-1, so every line of the ring, the tree and halving-doubling runs here too.

The inputs are small integers stored as float32: every partial sum is exact, whatever order the algorithm adds
in, so the oracle (numpy's sum over the ranks' inputs) must match exactly, at every world size and at lengths
shorter than, equal to and not divisible by the world size.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mlsys import collectives

LENGTHS = (1, 2, 3, 5, 8, 12, 13)
TIMEOUT = timedelta(seconds=20)


def inputs(rank: int, numel: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Distinct small integers per rank and position (exact in float32 under any summation order)."""
    rng = np.random.default_rng(1000 * rank + numel)
    values = rng.integers(-50, 50, size=numel).astype(np.float32)
    return torch.from_numpy(values).reshape(shape or (numel,))


def algorithms(world_size: int) -> list[str]:
    names = ["ring", "tree"]
    return names + (["halving_doubling"] if collectives.is_power_of_two(world_size) else [])


def run_all(rank: int, world_size: int) -> dict:
    """What one rank computes: every algorithm at every length, plus the ring's step trace and a sub-group ring."""
    out: dict = {}
    for numel in LENGTHS:
        for name in algorithms(world_size):
            x = inputs(rank, numel)
            if name == "ring":
                steps: list = []
                held: list = []  # the chunk each step wrote, as the hook sees it right after the step

                def hook(phase, step, s, r, nbytes, chunks, steps=steps, held=held):
                    steps.append((phase, step, s, r, nbytes))
                    held.append(chunks[r].tolist())

                result = collectives.ring_all_reduce(x, on_step=hook)
                out[("trace", numel)] = steps
                out[("held", numel)] = held
            elif name == "tree":
                result = collectives.tree_all_reduce(x)
            else:
                result = collectives.halving_doubling_all_reduce(x)
            assert result is x, "the all-reduce works in place and returns its argument"
            out[(name, numel)] = x.tolist()
    # a non-contiguous tensor (a transposed matrix): the ring works on a flat copy and must write it back
    m = inputs(rank, 12, (3, 4)).t()
    collectives.ring_all_reduce(m)
    out["noncontiguous"] = m.tolist()
    # the ring on a sub-group of the even ranks: group ranks translate to global ranks
    evens = list(range(0, world_size, 2))
    group = dist.new_group(evens)
    if rank in evens:
        y = inputs(rank, 7)
        collectives.ring_all_reduce(y, group=group)
        out["evens"] = y.tolist()
    # a message already queued on the default group must not be taken by a ring on a sub-group of the same ranks
    pair = dist.new_group([0, 1])
    if rank in (0, 1):
        z = inputs(rank, 2)  # two ranks, two elements: one-element chunks, the size of the stray message
        early = dist.isend(torch.full((1,), 999.0), dst=1) if rank == 0 else None  # default group, tag 0
        collectives.ring_all_reduce(z, group=pair)
        out["pair"] = z.tolist()
        if rank == 1:
            stray = torch.empty(1)
            dist.recv(stray, src=0)
            out["stray"] = stray.item()
        else:
            early.wait()
    dist.barrier()
    return out


def _peer(rank: int, world_size: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=TIMEOUT)
    try:
        results.put((rank, run_all(rank, world_size)))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(world_size: int) -> dict[int, dict]:
    """Run `run_all` with this process as rank 0 and forked children as the other ranks; every rank's result."""
    ctx = mp.get_context("fork")
    port, results = free_port(), ctx.Queue()
    peers = [ctx.Process(target=_peer, args=(r, world_size, port, results), daemon=True) for r in range(1, world_size)]
    for p in peers:
        p.start()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world_size,
                                timeout=TIMEOUT)
        try:
            everything = {0: run_all(0, world_size)}
        finally:
            dist.destroy_process_group()
        for _ in peers:
            rank, result = results.get(timeout=30)
            everything[rank] = result
        return everything
    finally:
        for p in peers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_every_all_reduce_equals_the_sum_of_the_inputs(world_size: int) -> None:
    results = run_group(world_size)
    assert sorted(results) == list(range(world_size))
    for numel in LENGTHS:
        expected = sum(inputs(r, numel).numpy() for r in range(world_size)).tolist()
        for name in algorithms(world_size):
            for rank in range(world_size):
                assert results[rank][(name, numel)] == expected, (name, numel, rank)
    expected_t = sum(inputs(r, 12, (3, 4)).t().numpy() for r in range(world_size)).tolist()
    assert all(results[r]["noncontiguous"] == expected_t for r in range(world_size))
    evens = range(0, world_size, 2)
    expected_e = sum(inputs(r, 7).numpy() for r in evens).tolist()
    assert all(results[r]["evens"] == expected_e for r in evens)


@pytest.mark.timeout(120)
def test_the_ring_sends_two_w_minus_one_chunks_and_matches_comm_volume() -> None:
    """The ring's trace, against a schedule written from the definition: rank r sends chunk r-s in reduce-scatter
    step s and chunk r+1-s in all-gather step s, each a tensor_split piece of the input."""
    world_size = 4
    results = run_group(world_size)
    for numel in LENGTHS:
        pieces = [len(p) for p in np.array_split(np.zeros(numel), world_size)]  # numpy's uneven split
        for rank in range(world_size):
            trace = results[rank][("trace", numel)]
            want = [("reduce-scatter", s, (rank - s) % world_size, (rank - s - 1) % world_size,
                     4 * pieces[(rank - s) % world_size]) for s in range(world_size - 1)]
            want += [("all-gather", s, (rank + 1 - s) % world_size, (rank - s) % world_size,
                      4 * pieces[(rank + 1 - s) % world_size]) for s in range(world_size - 1)]
            assert [tuple(t) for t in trace] == want, (numel, rank)
        if numel % world_size == 0:  # even pieces: every rank sends exactly the bandwidth-optimal volume
            sent = sum(t[4] for t in results[0][("trace", numel)])
            assert sent == collectives.comm_volume("all_reduce", 4 * numel, world_size)["sent"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [3, 4])
def test_each_ring_step_leaves_the_partial_sums_the_schedule_promises(world_size: int) -> None:
    """The chunk a step writes, as the on_step hook sees it, against numpy sums over the ranks that chunk has
    passed: after reduce-scatter step s, rank r's chunk (r-s-1) holds the sum over ranks r-s-1 .. r (s + 2 of
    them); after any all-gather step the chunk it received is complete. Computed from the inputs, not the trace."""
    results = run_group(world_size)
    W = world_size
    for numel in LENGTHS:
        pieces = [np.array_split(inputs(r, numel).numpy(), W) for r in range(W)]  # pieces[rank][chunk]
        for rank in range(W):
            held = results[rank][("held", numel)]
            assert len(held) == 2 * (W - 1)
            for s in range(W - 1):
                chunk = (rank - s - 1) % W
                ranks = [(rank - j) % W for j in range(s + 2)]
                assert held[s] == sum(pieces[q][chunk] for q in ranks).tolist(), (numel, rank, "rs", s)
            for s in range(W - 1):
                chunk = (rank - s) % W
                assert held[W - 1 + s] == sum(pieces[q][chunk] for q in range(W)).tolist(), (numel, rank, "ag", s)


@pytest.mark.timeout(120)
def test_a_ring_on_a_sub_group_does_not_take_the_default_groups_messages() -> None:
    """Rank 0 has a message in flight to rank 1 on the default group when both start a ring on a two-rank
    sub-group: the ring must exchange over its own group (sum exact) and leave the stray message to rank 1's
    later plain recv (999). A ring that talked over the default group would swap the two."""
    results = run_group(3)
    want = (inputs(0, 2).numpy() + inputs(1, 2).numpy()).tolist()
    assert results[0]["pair"] == want and results[1]["pair"] == want
    assert results[1]["stray"] == 999.0


def test_tree_shape_against_a_heap_built_by_hand() -> None:
    for world_size in range(1, 12):
        parents = {r: collectives.tree_parent(r) for r in range(world_size)}
        assert parents[0] is None
        for r in range(1, world_size):
            assert r in collectives.tree_children(parents[r], world_size)
        children = [c for r in range(world_size) for c in collectives.tree_children(r, world_size)]
        assert sorted(children) == list(range(1, world_size))  # every rank but the root has exactly one parent
        assert all(len(collectives.tree_children(r, world_size)) <= 2 for r in range(world_size))


def test_halving_doubling_plan_partitions_the_vector() -> None:
    """After the reduce-scatter steps the kept ranges of the W ranks tile [0, n) exactly once."""
    for world_size in (1, 2, 4, 8):
        for numel in (1, 5, 8, 13):
            final = []
            for rank in range(world_size):
                plan = collectives.halving_doubling_plan(rank, world_size, numel)
                assert len(plan) == int(np.log2(world_size))
                assert [p for p, _, _ in plan] == [rank ^ (world_size >> (i + 1)) for i in range(len(plan))]
                final.append(plan[-1][1] if plan else (0, numel))
            covered = sorted(i for lo, hi in final for i in range(lo, hi))
            assert covered == list(range(numel))


def test_is_power_of_two_against_a_brute_force_set() -> None:
    powers = {2 ** k for k in range(12)}
    assert [n for n in range(-3, 3000) if collectives.is_power_of_two(n)] == sorted(powers & set(range(3000)))


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_comm_volume_against_the_nccl_tests_bus_bandwidth_factors(world_size: int) -> None:
    """nccl-tests (doc/PERFORMANCE.md) turns algorithm bandwidth into bus bandwidth with a per-collective factor:
    all-reduce 2(n-1)/n, all-gather, reduce-scatter and all-to-all (n-1)/n, broadcast and reduce 1. Bytes moved
    per rank = factor x N for the symmetric collectives."""
    n, w = 1200, world_size
    factors = {"all_reduce": 2 * (w - 1) / w, "all_gather": (w - 1) / w, "reduce_scatter": (w - 1) / w,
               "all_to_all": (w - 1) / w, "broadcast": 1.0 if w > 1 else 0.0, "reduce": 1.0 if w > 1 else 0.0}
    for name, factor in factors.items():
        v = collectives.comm_volume(name, n, w)
        assert v["collective"] == name
        assert v["sent"] == pytest.approx(factor * n) and v["received"] == pytest.approx(factor * n), name
    # rooted: the root sends (scatter) or receives (gather) every piece but its own; the others one piece each
    assert collectives.comm_volume("scatter", n, w)["sent"] == pytest.approx((w - 1) * n / w)
    assert collectives.comm_volume("scatter", n, w)["received"] == pytest.approx(n / w if w > 1 else 0)
    assert collectives.comm_volume("gather", n, w)["received"] == pytest.approx((w - 1) * n / w)
    assert collectives.comm_volume("gather", n, w)["sent"] == pytest.approx(n / w if w > 1 else 0)
    with pytest.raises(ValueError):
        collectives.comm_volume("all_reduce", n, 0)
    with pytest.raises(ValueError):
        collectives.comm_volume("allreduce", n, w)


def test_halving_doubling_ranks_own_their_own_balanced_piece_in_rank_order() -> None:
    """Rabenseifner's recursive halving (Thakur et al. 2005): at each step the lower rank of a pair (bit d clear)
    keeps the lower half, and each half is the range cut in two. So after log2(W) steps rank r owns the r-th of W
    contiguous pieces, in rank order, whose sizes differ by at most one (a balanced split, like numpy's)."""
    for world_size in (2, 4, 8):
        for numel in (8, 13, 29, 64):
            owned = []
            for rank in range(world_size):
                lo, hi = 0, numel
                for partner, keep, give in collectives.halving_doubling_plan(rank, world_size, numel):
                    lower, upper = sorted([keep, give])
                    assert lower[0] == lo and lower[1] == upper[0] and upper[1] == hi
                    assert abs((upper[1] - upper[0]) - (lower[1] - lower[0])) <= 1, "each step halves the range"
                    assert keep == (lower if rank < partner else upper), "the lower rank keeps the lower half"
                    lo, hi = keep
                owned.append((lo, hi))
            assert [lo for lo, _ in owned] == sorted(lo for lo, _ in owned), "rank r owns piece r"
            sizes = [hi - lo for lo, hi in owned]
            assert max(sizes) - min(sizes) <= 1, (world_size, numel, sizes)


def test_comm_volume_names_the_algorithm_and_says_what_is_wrong() -> None:
    """The algorithm each volume assumes (the docstring's table; nccl-tests' PERFORMANCE.md: ring for all-reduce,
    all-gather and reduce-scatter, pipelined chains for broadcast and reduce), and errors that name the bad value."""
    expected = {"broadcast": "pipelined chain", "scatter": "direct from root", "gather": "direct to root",
                "all_gather": "ring", "reduce": "pipelined chain", "all_reduce": "ring", "reduce_scatter": "ring",
                "all_to_all": "direct pairwise"}
    assert set(expected) == set(collectives.COLLECTIVES)
    for name, algorithm in expected.items():
        v = collectives.comm_volume(name, 64, 4)
        assert set(v) == {"collective", "algorithm", "sent", "received"}
        assert v["algorithm"] == algorithm, name
    with pytest.raises(ValueError, match=r"world_size must be >= 1, got 0"):
        collectives.comm_volume("all_reduce", 64, 0)
    with pytest.raises(ValueError, match=r"'allreduce'.*broadcast, scatter, gather, all_gather, reduce, all_reduce"):
        collectives.comm_volume("allreduce", 64, 4)
