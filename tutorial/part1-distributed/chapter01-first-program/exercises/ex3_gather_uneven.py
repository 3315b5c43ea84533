"""Exercise ch01.3 (extend) — all_gather needs tensors of the same size on every rank. Gather shards of DIFFERENT
sizes anyway: share the sizes first, pad to the largest, gather, then cut the padding off. Runs on real ranks.

The process group is already initialised when `gather_uneven` is called: use torch.distributed directly.
Check your work:  make check EX=ch01.3
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


def gather_uneven(local: torch.Tensor) -> torch.Tensor:
    """The concatenation, in rank order, of every rank's 1-D float32 `local`, returned on every rank.

    Shards may have different lengths, and some may be empty. Use two dist.all_gather calls: one of the lengths
    (a 1-element int64 tensor per rank), one of the shards zero-padded to the longest length; then keep only the
    first length[r] elements of rank r's padded piece. Example, 2 ranks: [1, 2] and [3] -> [1, 2, 3] on both.
    """
    raise NotImplementedError("TODO: all_gather the lengths, pad to the max, all_gather, trim each piece")


def padding_overhead(lengths: list[int]) -> float:
    """The fraction of the padded all_gather's buffer (world_size x max length) that is padding, not data.

    Pure arithmetic, no communication. Example: lengths [4, 1] -> buffer 2 x 4 = 8 slots, 5 of data -> 3 / 8.
    All lengths 0 -> 0.0 (an empty buffer holds no padding).
    """
    raise NotImplementedError("TODO: 1 - sum(lengths) / (len(lengths) * max(lengths)), careful with all zeros")
