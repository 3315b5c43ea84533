"""A mistake for ch05.3: keeps a FULL-size momentum buffer on every rank (right numbers, no memory saved); and
the memory formula shards the gradients from stage 1 on."""

import torch
import torch.distributed as dist

REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def zero_bytes_per_rank(num_params, world_size, stage):
    params = 2 * num_params / (world_size if stage >= 3 else 1)
    grads = 2 * num_params / (world_size if stage >= 1 else 1)
    optimizer = 12 * num_params / (world_size if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


def zero2_train(init, grads, lr, momentum):
    world_size, rank = dist.get_world_size(), dist.get_rank()
    numel = init.numel()
    padded = -(-numel // world_size) * world_size
    size = padded // world_size
    lo, hi = rank * size, (rank + 1) * size
    full = torch.zeros(padded)
    full[:numel] = init
    buf = torch.zeros(padded)
    for grad in grads:
        flat = torch.zeros(padded)
        flat[:numel] = grad
        g = torch.empty(size)
        REDUCE_SCATTER(g, flat)
        buf[lo:hi].mul_(momentum).add_(g / world_size)
        mine = full[lo:hi] - lr * buf[lo:hi]
        ALL_GATHER(full, mine.contiguous())
    return {"params": full[:numel].clone(), "state_numel": buf.numel()}


def run_train(init, grads, lr, momentum):
    out = zero2_train(init.clone(), [g.clone() for g in grads], lr, momentum)
    return {"params": torch.as_tensor(out["params"]).tolist(), "state_numel": int(out["state_numel"])}
