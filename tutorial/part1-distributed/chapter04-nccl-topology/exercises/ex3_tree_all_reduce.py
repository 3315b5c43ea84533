"""Exercise ch04.3 (extend) — change your tree broadcast (ch04.1) into a tree ALL-REDUCE: sums flow up the tree to
rank 0, then the total flows back down. The checker counts what every rank sends and compares it with the ring.

Runs on every rank of a real job; the process group is already initialised.
Check your work:  make check EX=ch04.3
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tree_parent(rank: int) -> int | None:
    """(Given, as in ch04.1.) Heap order: the parent of r is (r - 1) // 2; the root 0 has none."""
    return None if rank == 0 else (rank - 1) // 2


def tree_children(rank: int, world_size: int) -> list[int]:
    """(Given, as in ch04.1.) The children 2r+1 and 2r+2 that exist."""
    return [c for c in (2 * rank + 1, 2 * rank + 2) if c < world_size]


def tree_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """The element-wise SUM over all ranks of `tensor`, returned on every rank (a new tensor; `tensor` unchanged).

    Up: start from a copy of your own tensor, receive each child's partial sum (the sum over that child's whole
    subtree) and add it, then send your partial sum to your parent. Rank 0 then holds the total.
    Down: receive the total from your parent (unless you are rank 0), then send it to each child.
    Use only dist.send / dist.recv / dist.isend / dist.irecv. No collectives.
    """
    raise NotImplementedError("TODO: up the tree (recv children, add, send to parent), then down (recv, send)")


# ----------------------------------------------------------------------------------------------- provided
def run_and_count(tensor: torch.Tensor) -> dict:
    """(Given, do not edit.) Calls tree_all_reduce, counts the elements this rank sends, and returns the result and
    the input tensor as the call left it."""
    sent = {"elements": 0, "messages": 0}
    real_send, real_isend = dist.send, dist.isend

    def send(t, *args, **kwargs):
        sent["elements"] += t.numel()
        sent["messages"] += 1
        return real_send(t, *args, **kwargs)

    def isend(t, *args, **kwargs):
        sent["elements"] += t.numel()
        sent["messages"] += 1
        return real_isend(t, *args, **kwargs)

    dist.send, dist.isend = send, isend
    try:
        out = tree_all_reduce(tensor)
    finally:
        dist.send, dist.isend = real_send, real_isend
    return {"result": out.tolist(), "input_after": tensor.tolist(), **sent}  # the checker compares it with its copy
