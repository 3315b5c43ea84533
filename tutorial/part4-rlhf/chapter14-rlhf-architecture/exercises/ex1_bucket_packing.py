"""Exercise ch14.1 — bucketed weight sync: pack tensors into flat buckets, send each bucket with one broadcast.

A trainer that pushes weights to rollout workers one tensor at a time pays a collective's fixed cost per tensor.
Packing them into a few flat buffers ("buckets") of at most bucket_bytes turns hundreds of small messages into a
few large ones (mlsys/weight_sync.py does this; write your own here). Rules:
  * greedy, in order, one open bucket per dtype: a tensor joins its dtype's open bucket if the bucket's bytes stay
    <= bucket_bytes, otherwise that bucket is closed and a new one is opened for the tensor;
  * a tensor larger than bucket_bytes travels alone in its own bucket;
  * buckets are listed in the order they were closed, then the still-open ones in the order their dtype first
    appeared.
Check your work:  make check EX=ch14.1
"""

from __future__ import annotations

import torch


def assign_buckets(nbytes: list[int], dtypes: list[str], bucket_bytes: int) -> list[list[int]]:
    """Indices of the tensors in each bucket, by the rules above. nbytes[i], dtypes[i] describe tensor i."""
    raise NotImplementedError("TODO: in order, one open bucket per dtype, closed when it would overflow")


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors (same dtype, any shapes) flattened and concatenated into one 1-D tensor (a copy)."""
    raise NotImplementedError("TODO: reshape(-1) each tensor and concatenate")


def unpack(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """The inverse of pack: consecutive slices of flat, viewed with the given shapes."""
    raise NotImplementedError("TODO: walk an offset through flat, slice numel elements, view them with the shape")


def sync_bucketed(tensors: list[torch.Tensor], bucket_bytes: int, src: int) -> torch.Tensor:
    """Collective: every rank passes tensors of the same shapes and dtypes; afterwards every rank's tensors hold
    rank src's values, bit for bit, updated in place. Use assign_buckets, pack, one dist.broadcast per bucket,
    unpack. Return torch.cat([t.double().reshape(-1) for t in tensors]) so the checker can compare the ranks
    (float64 holds these float32, bfloat16 and small int64 values exactly)."""
    raise NotImplementedError("TODO: plan buckets, pack on src / allocate elsewhere, broadcast, unpack into place")
