"""Reference solution for ch01.3 — gather shards of different sizes with a padded all_gather."""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather_uneven(local: torch.Tensor) -> torch.Tensor:
    world_size = dist.get_world_size()
    length = torch.tensor([local.numel()], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(lengths, length)  # every rank learns every rank's length
    sizes = [int(n.item()) for n in lengths]
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=local.dtype)
    padded[:local.numel()] = local
    pieces = [torch.empty(longest, dtype=local.dtype) for _ in range(world_size)]
    dist.all_gather(pieces, padded)  # (W, longest) in all, padding included
    return torch.cat([piece[:n] for piece, n in zip(pieces, sizes)])  # each rank's real elements, in rank order


def padding_overhead(lengths: list[int]) -> float:
    slots = len(lengths) * max(lengths, default=0)
    return 0.0 if slots == 0 else 1.0 - sum(lengths) / slots
