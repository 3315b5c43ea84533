"""A mistake for ch01.3: trims every gathered piece to this rank's own length instead of its sender's length."""

import torch
import torch.distributed as dist


def gather_uneven(local):
    world_size = dist.get_world_size()
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(lengths, torch.tensor([local.numel()]))
    longest = int(max(n.item() for n in lengths))
    padded = torch.zeros(longest, dtype=local.dtype)
    padded[:local.numel()] = local
    pieces = [torch.empty(longest, dtype=local.dtype) for _ in range(world_size)]
    dist.all_gather(pieces, padded)
    return torch.cat([p[:local.numel()] for p in pieces])


def padding_overhead(lengths):
    return 1.0 - sum(lengths) / (len(lengths) * max(lengths))  # divides by zero when every shard is empty
