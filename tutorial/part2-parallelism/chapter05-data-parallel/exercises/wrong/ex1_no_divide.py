"""A mistake for ch05.1: sums the gradients over the ranks but forgets to divide by the world size."""

from __future__ import annotations

import torch
import torch.distributed as dist


def assign_buckets(numels: list[int], element_size: int, bucket_bytes: int) -> list[list[int]]:
    """Group tensors (given by their element counts, in the order given) into buckets; return lists of indices.

    Rule (torch's DDP uses the same one): put the next tensor into the open bucket; as soon as the bucket holds
    `bucket_bytes` bytes or more, close it and open a new one. The last bucket may be smaller; a tensor bigger than
    the cap ends up alone in its bucket. Example, 4-byte elements and a 1000-byte cap:
        numels [10, 300, 5, 700, 20]  ->  [[0, 1], [2, 3], [4]]
    An empty `numels` gives [].
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, numel in enumerate(numels):
        current.append(index)
        filled += numel * element_size
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def all_reduce_mean_bucketed(grads: list[torch.Tensor], bucket_bytes: int) -> list[torch.Tensor]:
    """The mean over ranks of every tensor in `grads` (float32, any shapes), with one all-reduce per bucket.

    Like DDP, walk the gradients in REVERSE order (backward produces the last layer's first) and bucket them with
    `assign_buckets`. For each bucket: flatten its tensors into one 1-D buffer (torch.cat of .flatten()),
    all-reduce it (SUM) with `dist.all_reduce`, divide by the world size, and cut it back into tensors of the
    original shapes. Return the averaged tensors in the ORIGINAL order of `grads`. Exactly one dist.all_reduce
    call per bucket, nothing else (the checker counts them).
    """
    order = list(range(len(grads)))[::-1]  # positions in grads, last first
    buckets = assign_buckets([grads[i].numel() for i in order], 4, bucket_bytes)
    out: list[torch.Tensor | None] = [None] * len(grads)
    for bucket in buckets:
        members = [order[j] for j in bucket]
        flat = torch.cat([grads[i].flatten() for i in members])  # (sum of numels,)
        dist.all_reduce(flat)
        for i, piece in zip(members, flat.split([grads[i].numel() for i in members])):
            out[i] = piece.view_as(grads[i])
    return out  # type: ignore[return-value]


def run_and_count(grads: list[torch.Tensor], bucket_bytes: int) -> dict:
    """Provided for the checker, do not edit: calls your function and records every all-reduce it makes."""
    sizes: list[int] = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        out = all_reduce_mean_bucketed([g.clone() for g in grads], bucket_bytes)
    finally:
        dist.all_reduce = original
    return {"values": [o.tolist() for o in out], "shapes": [list(o.shape) for o in out], "allreduce_numels": sizes}
