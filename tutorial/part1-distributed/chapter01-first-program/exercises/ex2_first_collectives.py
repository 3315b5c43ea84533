"""Exercise ch01.2 — your first collectives. Each function runs on every rank of a real job (gloo on CPU).

The process group is already initialised when your function is called: use torch.distributed directly.
Check your work:  make check EX=ch01.2
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


def global_mean(local: torch.Tensor) -> torch.Tensor:
    """The mean of all elements held by all ranks, returned on every rank as a 0-dim float tensor.

    Ranks may hold different numbers of elements (even none), so the mean of the per-rank means is wrong:
    all-reduce a (sum, count) pair instead.
    """
    raise NotImplementedError("TODO: all_reduce the sum and the count, then divide")


def argmax_rank(value: float) -> int:
    """The rank that holds the largest `value`, known on every rank (ties: the lowest such rank).

    Hint: one all_reduce with MAX finds the largest value; a second with MIN picks the lowest rank that holds it.
    """
    raise NotImplementedError("TODO: two all_reduce calls")
