"""Exercise ch04.1 — bus bandwidth, and a broadcast down a binary tree.

Check your work:  make check EX=ch04.1
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it for tree_broadcast)


def busbw(collective: str, size_bytes: float, time_s: float, world_size: int) -> float:
    """nccl-tests' bus bandwidth in GB/s (1e9 bytes per second) of one call that took `time_s`.

    algbw = size_bytes / time_s / 1e9, and busbw = algbw * factor, where the factor for n = world_size ranks is
      all_reduce 2(n-1)/n;  all_gather, reduce_scatter, all_to_all (n-1)/n;  broadcast, reduce 1.
    (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md). Unknown collective: raise ValueError.
    Example: busbw("all_reduce", 8e9, 2.0, 4) == 6.0
    """
    raise NotImplementedError("TODO: algbw, times the collective's factor")


def tree_parent(rank: int) -> int | None:
    """The parent of `rank` in a binary tree laid out like a heap (root 0; children of r are 2r+1 and 2r+2).
    The root has no parent: return None."""
    raise NotImplementedError("TODO: one integer division")


def tree_children(rank: int, world_size: int) -> list[int]:
    """The children of `rank` that exist in a job of `world_size` ranks, smallest first (0, 1 or 2 of them)."""
    raise NotImplementedError("TODO: 2r+1 and 2r+2, when they are < world_size")


def tree_broadcast(tensor: torch.Tensor) -> torch.Tensor:
    """Runs on every rank: make every rank's `tensor` equal rank 0's, in place, and return it.

    Use only dist.send / dist.recv (or isend / irecv) along the tree: receive from your parent (unless you are the
    root), then send to each of your children. Do not call dist.broadcast.
    """
    raise NotImplementedError("TODO: recv from the parent, then send to the children")
