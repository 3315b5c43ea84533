"""Mistake for ch14.1: a bucket that would be exactly full closes early (>= instead of >)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def assign_buckets(nbytes: list[int], dtypes: list[str], bucket_bytes: int) -> list[list[int]]:
    closed: list[list[int]] = []
    open_: dict[str, tuple[list[int], int]] = {}  # dtype -> (indices, bytes) of its open bucket
    for i, (n, dtype) in enumerate(zip(nbytes, dtypes)):
        members, used = open_.get(dtype, ([], 0))
        if members and used + n >= bucket_bytes:
            closed.append(members)
            members, used = [], 0
        open_[dtype] = (members + [i], used + n)
    return closed + [members for members, _ in open_.values() if members]


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= d
        out.append(flat[offset:offset + numel].view(shape))
        offset += numel
    return out


def sync_bucketed(tensors: list[torch.Tensor], bucket_bytes: int, src: int) -> torch.Tensor:
    nbytes = [t.numel() * t.element_size() for t in tensors]
    for bucket in assign_buckets(nbytes, [str(t.dtype) for t in tensors], bucket_bytes):
        members = [tensors[i] for i in bucket]
        if dist.get_rank() == src:
            flat = pack(members)
        else:
            flat = torch.empty(sum(t.numel() for t in members), dtype=members[0].dtype)
        dist.broadcast(flat, src=src)
        for i, part in zip(bucket, unpack(flat, [tuple(t.shape) for t in members])):
            tensors[i].copy_(part)
    return torch.cat([t.double().reshape(-1) for t in tensors])
