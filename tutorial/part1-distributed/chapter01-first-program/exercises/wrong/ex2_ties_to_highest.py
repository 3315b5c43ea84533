"""A mistake for ch01.2: proposals reduced with MAX instead of MIN, so ties go to the HIGHEST rank."""

import torch
import torch.distributed as dist


def global_mean(local):
    stats = torch.tensor([local.sum().item(), local.numel()], dtype=torch.float64)
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).float()


def argmax_rank(value):
    best = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(best, op=dist.ReduceOp.MAX)
    mine = dist.get_rank() if value == best.item() else -1
    candidate = torch.tensor([mine])
    dist.all_reduce(candidate, op=dist.ReduceOp.MAX)
    return int(candidate.item())
