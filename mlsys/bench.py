"""Timing collectives the way nccl-tests does, and its bandwidth arithmetic (algbw, busbw).

Shared by the benchmarks from Chapter 4 on, so that every busbw in the book is computed one way:
time the slowest rank over a loop of calls after a warm-up, then convert with the per-collective factors of
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md.
"""

from __future__ import annotations

import time
import typing

import torch
import torch.distributed as dist


# --8<-- [start:busbw]
def busbw_factor(collective: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor (doc/PERFORMANCE.md in NVIDIA/nccl-tests).

    It turns "bytes of the buffer per second" into "bytes each link carried per second", so that every collective
    can be compared with the hardware's link bandwidth: an all_reduce must move 2(n-1)/n of the buffer through each
    rank's link (reduce-scatter then all-gather), an all_gather or reduce_scatter (n-1)/n, a broadcast the whole.
    """
    n = world_size
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
               "all_to_all": (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}
    return factors[collective]


def algbw(size_bytes: float, time_s: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes, as nccl-tests): the buffer's size over the time of one call."""
    return size_bytes / time_s / 1e9


def busbw(collective: str, size_bytes: float, time_s: float, world_size: int) -> float:
    return algbw(size_bytes, time_s) * busbw_factor(collective, world_size)
# --8<-- [end:busbw]


# --8<-- [start:timing]
def time_collective(call: typing.Callable[[], None], warmup: int, iters: int, device: torch.device) -> float:
    """Seconds per call, the slowest rank's: a collective is finished only when the last rank is done."""
    for _ in range(warmup):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # NCCL calls return before the GPU is done
    dist.barrier()  # everyone starts the timed loop together
    start = time.perf_counter()
    for _ in range(iters):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # nccl-tests reports the max over ranks
    return elapsed.item() / iters
# --8<-- [end:timing]
