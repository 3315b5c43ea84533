"""Exercise ch02.2 (warm-up) — blocking send and recv: the chain's closed form, the chain itself, and a ring that
does not deadlock because the calls are ordered (the lesson's first fix), with no isend/irecv at all.

`chain` and `ordered_ring_shift` run on every rank of a real gloo job; the process group is already initialised.
Check your work:  make check EX=ch02.2
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


def chain_expected(start: float, rank: int) -> float:
    """What rank `rank` holds at the end of the chain, computed with no communication.

    In the chain, rank 0 starts from `start` and adds its rank (0); each rank r > 0 receives the value from r - 1,
    adds r, and sends it on. Example: start 10.0 -> rank 3 holds 10 + 0 + 1 + 2 + 3 = 16.0.
    """
    raise NotImplementedError("TODO: start plus the sum 0 + 1 + ... + rank, in closed form")


def chain(start: float) -> float:
    """Run the chain on the real ranks with blocking dist.send / dist.recv; return the value this rank holds.

    Rank 0 makes a 1-element float64 tensor holding `start`; every rank r > 0 first receives from r - 1. Each rank
    adds its rank and, unless it is the last, sends the result to r + 1.
    """
    raise NotImplementedError("TODO: recv from rank - 1 (unless rank 0), add rank, send to rank + 1 (unless last)")


def ordered_ring_shift(tensor: torch.Tensor) -> torch.Tensor:
    """Send `tensor` to (rank + 1) % W and return what (rank - 1) % W sent, using BLOCKING dist.send and
    dist.recv only (no isend, irecv or batch_isend_irecv). Must work for every W >= 2, odd ones included.

    If every rank sent first, every send would wait for a recv that nobody posts. Order the calls by parity:
    even ranks send then receive, odd ranks receive then send.
    """
    raise NotImplementedError("TODO: even ranks: send, then recv; odd ranks: recv, then send")
