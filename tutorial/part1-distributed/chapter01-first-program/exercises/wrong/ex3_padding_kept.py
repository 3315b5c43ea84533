"""A mistake for ch01.3: returns the padded gather as it is, padding zeros included."""

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
    return torch.cat(pieces)


def padding_overhead(lengths):
    slots = len(lengths) * max(lengths)
    return 0.0 if slots == 0 else 1.0 - sum(lengths) / slots
