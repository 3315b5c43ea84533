"""Exercise ch02.1 — shift tensors around a ring with point-to-point calls only (no collectives).

Each function runs on every rank of a real gloo job; the process group is already initialised.
Remember from the lesson: a gloo send waits for the matching recv, so if every rank sends first, nobody ever
receives. Check your work:  make check EX=ch02.1
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


def ring_shift(tensor: torch.Tensor) -> torch.Tensor:
    """Send `tensor` to the right neighbour (rank + 1) % W and return what the left neighbour (rank - 1) % W sent.

    Works for any world size W >= 2 without deadlocking; `tensor` itself must not be modified. Across all ranks,
    the results are numpy.roll(inputs, 1, axis=0).
    """
    raise NotImplementedError("TODO: post an isend to the right and an irecv from the left, then wait on both")


def ring_allgather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's tensor, stacked in rank order (shape (W, *tensor.shape)), built from W - 1 ring shifts.

    After k shifts, a rank holds the tensor that started k ranks to its left: put it in row (rank - k) % W.
    This is the ring all-gather that chapter 3 builds on.
    """
    raise NotImplementedError("TODO: call ring_shift W - 1 times, placing each received tensor in its row")
