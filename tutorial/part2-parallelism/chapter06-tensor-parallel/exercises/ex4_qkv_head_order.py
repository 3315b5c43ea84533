"""Exercise ch06.4 (build) — prepare a fused q, k, v projection for torch's ColwiseParallel, as fsdp_tp.py does.

ColwiseParallel gives tensor-parallel rank r the r-th contiguous block of a weight's output rows. The fused
(3C, C) c_attn weight stacks all of q's rows, then all of k's, then all of v's, so a contiguous block would hand
rank 0 only query rows. Reorder the rows so that block r holds the q, k and v rows of rank r's own heads.
Check your work:  make check EX=ch06.4
"""

from __future__ import annotations

import torch


def head_order(C: int, tp: int) -> torch.Tensor:
    """A permutation of range(3C) (a LongTensor) such that weight[head_order(C, tp)], cut into tp equal
    contiguous blocks, gives rank r: the q rows of its heads, then their k rows, then their v rows.
    Rank r's heads are the r-th contiguous block of C / tp features (heads r·H/tp .. (r+1)·H/tp − 1).
    Example, C = 4, tp = 2: [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11].
    """
    raise NotImplementedError("TODO: for each rank, its slice of the q rows, of the k rows, of the v rows")
