"""A mistake for ch03.3: the reduce-scatter receives straight into its chunk, overwriting instead of adding."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _step(send: torch.Tensor, recv: torch.Tensor, right: int, left: int) -> None:
    """Send one chunk right and receive one from the left, both posted before either is waited on."""
    ops = []
    if send.numel():  # a chunk is empty on both ends or on neither: both ranks skip it in agreement
        ops.append(dist.P2POp(dist.isend, send, right))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, left))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def ring_all_reduce(local: torch.Tensor) -> torch.Tensor:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    buf = local.clone()
    chunks = list(torch.tensor_split(buf, world_size))  # views into buf
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for s in range(world_size - 1):  # reduce-scatter
        send_i, recv_i = (rank - s) % world_size, (rank - s - 1) % world_size
        _step(chunks[send_i], chunks[recv_i], right, left)
    for s in range(world_size - 1):  # all-gather: rank r starts with the finished chunk r + 1
        send_i, recv_i = (rank + 1 - s) % world_size, (rank - s) % world_size
        _step(chunks[send_i], chunks[recv_i], right, left)
    return buf


def ring_bytes_per_rank(num_bytes: int, world_size: int) -> float:
    return 2 * (world_size - 1) * num_bytes / world_size
