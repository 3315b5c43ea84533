"""A mistake for ch03.1: the sample variance (divides by n - 1) instead of the population variance."""

import torch
import torch.distributed as dist


def sharded_mean_var(local):
    x = local.double()
    packed = torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64), x.sum(), (x * x).sum()])
    dist.all_reduce(packed)
    n, s, ss = packed.tolist()
    mean = s / n
    return mean, (ss - n * mean * mean) / (n - 1)


def sharded_softmax(local):
    m = local.max().clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    e = torch.exp(local - m)
    total = e.sum()
    dist.all_reduce(total)
    return e / total
