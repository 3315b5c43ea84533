"""Exercise ch03.3 (extend) — extend your ring all-gather (ch03.2) into the whole ring all-reduce: a reduce-scatter
phase first, then the all-gather, with point-to-point calls only; and the bytes each rank sends.

`ring_all_reduce` runs on every rank of a real job; the process group is already initialised.
Check your work:  make check EX=ch03.3
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


def ring_all_reduce(local: torch.Tensor) -> torch.Tensor:
    """The element-wise SUM over all ranks of the 1-D float32 `local` (same length on every rank), on every rank.

    Cut a copy into W chunks with torch.tensor_split (lengths may differ by one when W does not divide it).
    Reduce-scatter, W-1 steps: at step s, rank r sends chunk (r - s) % W to rank r+1 and ADDS the chunk
    (r - s - 1) % W that arrives from rank r-1 into its own copy of that chunk. Afterwards rank r holds the finished
    sum of chunk (r + 1) % W. All-gather, W-1 steps: at step s, rank r sends chunk (r + 1 - s) % W and receives
    (overwrites) chunk (r - s) % W. Post each step's send and receive together (isend/irecv, or
    batch_isend_irecv), then wait. No collectives. W=1 must work too.
    """
    raise NotImplementedError("TODO: W-1 reduce-scatter steps (receive into a buffer, add), then W-1 all-gather steps")


def ring_bytes_per_rank(num_bytes: int, world_size: int) -> float:
    """Bytes one rank sends in your ring all-reduce of a `num_bytes` tensor, when W divides it: 2(W-1) steps of
    one chunk of num_bytes / W each. 0 for one rank. Example: 1000 bytes on 4 ranks -> 1500.0."""
    raise NotImplementedError("TODO: 2 (W - 1) chunks of num_bytes / W")
