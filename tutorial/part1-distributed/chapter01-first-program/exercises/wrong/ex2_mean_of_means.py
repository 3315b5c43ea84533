"""A mistake for ch01.2: averages the per-rank means, which is wrong when shards have different sizes."""

import torch
import torch.distributed as dist


def global_mean(local):
    mean = local.mean() if local.numel() else torch.tensor(0.0)
    dist.all_reduce(mean)
    return mean / dist.get_world_size()


def argmax_rank(value):
    best = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(best, op=dist.ReduceOp.MAX)
    mine = dist.get_rank() if value == best.item() else dist.get_world_size()
    candidate = torch.tensor([mine])
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN)
    return int(candidate.item())
