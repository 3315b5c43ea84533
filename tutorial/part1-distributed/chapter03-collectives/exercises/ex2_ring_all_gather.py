"""Exercise ch03.2 — an all-gather built only from send/recv, around a ring. Runs on every rank of a real job.

The process group is already initialised when your function is called: use torch.distributed directly.
Check your work:  make check EX=ch03.2
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


def ring_all_gather(local: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D `local` (all the same length n), concatenated in rank order: shape (W*n,), on every rank.

    Only point-to-point calls (dist.isend / dist.irecv, or dist.batch_isend_irecv), no collectives. In W-1 steps,
    rank r sends the block it received last (its own at step 0) to rank r+1 and receives a new block from r-1.
    Post the send and the receive before waiting on either, or the ring deadlocks. W=1 must work too.
    """
    raise NotImplementedError("TODO: W-1 steps of isend to the right / irecv from the left")
