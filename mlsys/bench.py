"""Timing collectives the way nccl-tests does, and its bandwidth arithmetic (algbw, busbw).

Shared by the benchmarks from Chapter 4 on, so that every busbw in the book is computed one way:
time the slowest rank over a loop of calls after a warm-up (nccl-tests averages over ranks by default, `-a 1`;
the slowest rank is its `-a 3`, which this book uses because a collective is done only when its last rank is),
then convert with the per-collective factors of https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md.
At the end, the two ceilings of one box that a CPU busbw is compared with: a memory copy and loopback TCP.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import socket
import statistics
import threading
import time
import typing

import torch
import torch.distributed as dist


# --8<-- [start:busbw]
def busbw_factor(collective: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor (doc/PERFORMANCE.md in NVIDIA/nccl-tests).

    It turns "bytes of the buffer per second" into "bytes each link carried per second", so that every collective
    can be compared with the hardware's link bandwidth: on p ranks an all_reduce must move 2(p-1)/p of the buffer
    through each rank's link (reduce-scatter then all-gather), an all_gather or reduce_scatter (p-1)/p, a broadcast
    the whole. At p = 2 the all_reduce factor is exactly 1: busbw equals algbw.
    """
    p = world_size  # the ranks; the chapter calls the buffer's bytes n
    factors = {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p,
               "all_to_all": (p - 1) / p, "broadcast": 1.0, "reduce": 1.0}
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
    with steady_timing():  # no garbage-collector pass inside the timed loop
        dist.barrier()  # everyone starts the timed loop together
        start = time.perf_counter()
        for _ in range(iters):
            call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank (nccl-tests -a 3; its default averages)
    return elapsed.item() / iters
# --8<-- [end:timing]


@contextlib.contextmanager
def steady_timing() -> typing.Iterator[None]:
    """Time with the garbage collector out of the way: collect once, freeze what survives (so no generation-2 pass
    lands inside a timed region, as vLLM does before serving), and turn automatic collection off until the end.
    Nested inside another steady_timing it does nothing: the outer one has already collected (a full collection
    of a process holding torch costs a tenth of a second, too much to pay before every timed loop of a sweep)."""
    global _steady_depth
    if _steady_depth:
        _steady_depth += 1
        try:
            yield
        finally:
            _steady_depth -= 1
        return
    gc.collect()
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    _steady_depth = 1
    try:
        yield
    finally:
        _steady_depth = 0
        if was_enabled:
            gc.enable()
        gc.unfreeze()


_steady_depth = 0  # how many steady_timing blocks are open in this process (threads share it)


def best_of(fn: typing.Callable[[], float], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Run `fn` (which returns a duration in seconds) `warmup` times untimed, then `repeats` times; return the best
    and the median. The best is the least disturbed by other work on a shared machine; the median shows the spread."""
    for _ in range(warmup):
        fn()
    times = sorted(fn() for _ in range(max(1, repeats)))
    return {"best_s": times[0], "median_s": statistics.median(times), "repeats": len(times)}


def load_average() -> str:
    """The 1-minute load average and the core count, printed beside every timing so a reader can judge the noise."""
    try:
        one, _, _ = os.getloadavg()
    except OSError:  # not available on this platform
        return f"load average n/a on {os.cpu_count()} cores"
    return f"load average {one:.2f} on {os.cpu_count()} cores"


# --8<-- [start:ceiling]
def memcpy_bandwidth(num_bytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a large torch copy (best of a few): the memory system's ceiling for anything that moves bytes
    inside one box (each byte copied is read once and written once)."""
    src, dst = torch.ones(num_bytes // 4), torch.empty(num_bytes // 4)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def loopback_tcp_bandwidth(num_bytes: int = 64 * 2**20, repeats: int = 3) -> float:
    """Bytes/s through one TCP connection on 127.0.0.1 (what gloo's pairs of ranks use on one box), best of a few."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    payload, sink = bytearray(num_bytes), bytearray(num_bytes)

    def drain() -> None:
        view, got = memoryview(sink), 0
        while got < num_bytes:
            got += conn.recv_into(view[got:])

    best = math.inf
    try:
        for _ in range(repeats):
            reader = threading.Thread(target=drain)
            start = time.perf_counter()
            reader.start()
            client.sendall(payload)
            reader.join()
            best = min(best, time.perf_counter() - start)
    finally:
        for s in (client, conn, server):
            s.close()
    return num_bytes / best
# --8<-- [end:ceiling]
