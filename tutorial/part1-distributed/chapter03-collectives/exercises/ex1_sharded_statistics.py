"""Exercise ch03.1 — statistics of data no single rank holds. Each function runs on every rank of a real job.

The process group is already initialised when your function is called: use torch.distributed directly.
Check your work:  make check EX=ch03.1
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


def sharded_mean_var(local: torch.Tensor) -> tuple[float, float]:
    """(mean, population variance) of the concatenation of every rank's 1-D `local`, returned on every rank.

    Shards have different lengths, and a rank may hold none. Use one all_reduce of a float64 vector
    [count, sum, sum of squares], or all_gather each rank's (count, mean, M2) and merge them (Chan's formula).
    """
    raise NotImplementedError("TODO: all_reduce [count, sum, sum of squares], then var = E[x^2] - E[x]^2")


def sharded_softmax(local: torch.Tensor) -> torch.Tensor:
    """This rank's slice of softmax(concatenation of every rank's 1-D `local`); every shard has >= 1 element.

    Subtract the GLOBAL maximum before exp (all_reduce MAX), then divide by the global sum (all_reduce SUM).
    Must not overflow when values are around 1000.
    """
    raise NotImplementedError("TODO: all_reduce MAX, exp, all_reduce SUM, divide")
