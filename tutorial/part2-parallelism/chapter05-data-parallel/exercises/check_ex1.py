"""Checker for ch05.1 — bucket assignment against torch's own DDP helper, bucketed averaging on real ranks."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from mlsys.exercises import run_ranks, source_of, task

CASES = [  # (numels, bucket_bytes), 4-byte elements
    ([10, 300, 5, 700, 20], 1000),
    ([], 1000),
    ([1], 4),
    ([250, 250, 250, 250], 1000),  # every tensor fills a bucket exactly
    ([5000, 1, 1, 1], 1000),  # the first alone exceeds the cap
    ([3, 7, 11, 13, 17, 19, 23, 29], 64),
    ([100] * 9, 1 << 20),  # everything in one bucket
]


def reference_buckets(numels: list[int], bucket_bytes: int) -> list[list[int]]:
    """torch's DDP computes its buckets with this function (C++, the Reducer's bucket assignment)."""
    if not numels:
        return []
    tensors = [torch.empty(n) for n in numels]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [bucket_bytes], [False] * len(tensors))
    return [list(b) for b in buckets]


def _written(fn) -> None:
    """A stub's function still raises NotImplementedError: report the task as TODO before starting any rank."""
    if "NotImplementedError" in source_of(fn):
        raise NotImplementedError(f"TODO: write {fn.__name__}")


@task("assign_buckets groups tensors exactly as torch's DDP does "
      "(torch.distributed._compute_bucket_assignment_by_size)")
def check_assign(ex) -> None:
    for numels, cap in CASES:
        got = ex.assign_buckets(list(numels), 4, cap)
        want = reference_buckets(numels, cap)
        assert [list(b) for b in got] == want, f"numels {numels}, cap {cap} B: got {got}, want {want}"


@task("all_reduce_mean_bucketed on 1, 2 and 3 ranks: the numpy mean, original order and shapes, "
      "one all-reduce per bucket")
def check_mean(ex) -> None:
    _written(ex.all_reduce_mean_bucketed)  # the ranks call it through a given wrapper
    shapes = [(4, 3), (7,), (2, 2, 2), (1,), (5, 6)]  # numels 12, 7, 8, 1, 30
    for world_size, cap in [(1, 64), (2, 40), (3, 1000), (2, 4)]:
        per_rank = [[torch.randn(s, generator=torch.Generator().manual_seed(100 * r + i)) for i, s in enumerate(shapes)]
                    for r in range(world_size)]
        got = run_ranks(ex, "run_and_count", [(g, cap) for g in per_rank])
        reversed_numels = [int(np.prod(s)) for s in shapes][::-1]
        want_calls = [sum(reversed_numels[i] for i in b) for b in reference_buckets(reversed_numels, cap)]
        for rank, result in enumerate(got):
            assert result["shapes"] == [list(s) for s in shapes], f"W={world_size} rank {rank}: shapes " \
                f"{result['shapes']}, want {[list(s) for s in shapes]} (original order)"
            for i, s in enumerate(shapes):  # noqa: B007
                mean = np.mean([per_rank[r][i].numpy() for r in range(world_size)], axis=0)
                np.testing.assert_allclose(np.asarray(result["values"][i]), mean, rtol=1e-5, atol=1e-6,
                                           err_msg=f"W={world_size}, cap {cap} B: tensor {i} on rank {rank}")
            assert result["allreduce_numels"] == want_calls, (
                f"W={world_size}, cap {cap} B: rank {rank} all-reduced buffers of {result['allreduce_numels']} "
                f"elements; want one per bucket, {want_calls} (reverse order)")
