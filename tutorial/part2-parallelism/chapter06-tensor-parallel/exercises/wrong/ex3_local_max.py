"""A mistake for ch06.3: each rank shifts by its LOCAL maximum before exp, so the summed exponentials mix scales."""

import torch
import torch.distributed as dist


def vocab_parallel_cross_entropy(local_logits, targets, vocab_start):
    n, v_local = local_logits.shape
    m = local_logits.max(dim=-1).values
    s = torch.exp(local_logits - m[:, None]).sum(dim=-1)
    dist.all_reduce(s)
    local_ids = targets - vocab_start
    mine = (local_ids >= 0) & (local_ids < v_local)
    picked = local_logits[torch.arange(n), local_ids.clamp(0, v_local - 1)] * mine
    dist.all_reduce(picked)
    shift = m.clone()
    dist.all_reduce(shift, op=dist.ReduceOp.MAX)
    return float((torch.log(s) + shift - picked).mean())
