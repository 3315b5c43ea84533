"""Checker for ch04.1 — busbw against hand-computed values, the tree against a breadth-first walk, and the tree
broadcast on 1 to 5 real ranks against rank 0's data."""

from __future__ import annotations

import math

import torch

from mlsys.exercises import run_ranks, source_of, task


@task("busbw: matches hand-computed values for every collective")
def check_busbw(ex) -> None:
    cases = [("all_reduce", 8e9, 2.0, 4, 6.0), ("all_reduce", 1e9, 1.0, 2, 1.0), ("all_gather", 6e8, 0.5, 3, 0.8),
             ("reduce_scatter", 8e9, 1.0, 8, 7.0), ("all_to_all", 2e9, 1.0, 2, 1.0), ("broadcast", 3e9, 1.5, 8, 2.0),
             ("reduce", 1e9, 0.5, 5, 2.0), ("all_reduce", 1e9, 1.0, 1, 0.0)]
    for collective, size, seconds, n, want in cases:
        got = ex.busbw(collective, size, seconds, n)
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), \
            f"busbw({collective!r}, {size:g}, {seconds}, {n}) = {got}, expected {want}"
    try:
        ex.busbw("all_shuffle", 1.0, 1.0, 2)
    except ValueError:
        return
    raise AssertionError("busbw('all_shuffle', ...) should raise ValueError")


@task("tree_parent: heap order, the parent of r is (r - 1) // 2, the root 0 has None")
def check_tree_parent(ex) -> None:
    assert ex.tree_parent(0) is None, "rank 0 is the root: its parent is None"
    for r in range(1, 64):
        got, want = ex.tree_parent(r), (r - 1) // 2  # heap order, spelled out in the stub's docstring
        assert got == want, f"tree_parent({r}) = {got}, want {want} (children of p are 2p+1 and 2p+2)"


@task("tree_children: 2r+1 and 2r+2 that exist; one binary tree over all ranks, depth floor(log2 W)")
def check_tree_children(ex) -> None:
    for world_size in range(1, 20):
        for r in range(world_size):
            got, want = list(ex.tree_children(r, world_size)), [c for c in (2 * r + 1, 2 * r + 2) if c < world_size]
            assert got == want, f"W={world_size}: tree_children({r}, {world_size}) = {got}, want {want}"
        seen, frontier, depth = [0], [0], 0
        while frontier:
            frontier = [c for r in frontier for c in ex.tree_children(r, world_size)]
            seen += frontier
            depth += bool(frontier)
        assert sorted(seen) == list(range(world_size)), f"W={world_size}: the tree reaches {sorted(seen)}"
        want = int(math.log2(world_size))
        assert depth == want, f"W={world_size}: the tree is {depth} levels deep, expected {want}"


@task("tree_broadcast gives every rank rank 0's tensor (1, 2 and 5 ranks)")
def check_tree_broadcast(ex) -> None:
    # tree_broadcast walks the tree your tree_parent / tree_children describe (the ranks load this same file), so
    # a wrong tree is reported here as "fix ... first" rather than as a hang
    if "NotImplementedError" in source_of(ex.tree_broadcast):
        raise NotImplementedError("TODO: write tree_broadcast")
    for world_size in (1, 2, 5):  # a wrong tree could hang the job: check it on paper first
        for r in range(world_size):
            children = ex.tree_children(r, world_size)
            assert all(0 < c < world_size for c in children), "fix tree_children first (its own task above)"
            assert r == 0 or ex.tree_parent(r) in range(r), "fix tree_parent first (its own task above)"
        data = [(torch.arange(7.0) + 100 * r,) for r in range(world_size)]  # rank r starts with its own values
        got = run_ranks(ex, "tree_broadcast", data, timeout=20)
        want = torch.arange(7.0).tolist()
        assert got == [want] * world_size, f"W={world_size}: ranks hold {got}, expected {want} everywhere"
