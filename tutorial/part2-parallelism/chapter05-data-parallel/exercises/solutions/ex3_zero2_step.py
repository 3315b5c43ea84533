"""Reference solution for ch05.3 — ZeRO-2 steps of SGD with momentum, and ZeRO's memory per rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def zero_bytes_per_rank(num_params: int, world_size: int, stage: int) -> dict[str, float]:
    params = 2 * num_params / (world_size if stage >= 3 else 1)
    grads = 2 * num_params / (world_size if stage >= 2 else 1)
    optimizer = 12 * num_params / (world_size if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


def zero2_train(init: torch.Tensor, grads: list[torch.Tensor], lr: float, momentum: float) -> dict:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    numel = init.numel()
    padded = -(-numel // world_size) * world_size
    size = padded // world_size
    full = torch.zeros(padded, dtype=init.dtype)
    full[:numel] = init
    buf = torch.zeros(size, dtype=init.dtype)  # the sharded optimizer state: 1/W of it per rank
    for grad in grads:
        flat = torch.zeros(padded, dtype=grad.dtype)
        flat[:numel] = grad
        g = torch.empty(size, dtype=grad.dtype)
        REDUCE_SCATTER(g, flat)  # the sum over ranks of flat[rank*size:(rank+1)*size]
        g /= world_size
        buf.mul_(momentum).add_(g)
        mine = full[rank * size:(rank + 1) * size] - lr * buf  # this rank's updated slice
        ALL_GATHER(full, mine.contiguous())  # every rank's slice, in rank order
    return {"params": full[:numel].clone(), "state_numel": buf.numel()}


def run_train(init: torch.Tensor, grads: list[torch.Tensor], lr: float, momentum: float) -> dict:
    out = zero2_train(init.clone(), [g.clone() for g in grads], lr, momentum)
    return {"params": torch.as_tensor(out["params"]).tolist(), "state_numel": int(out["state_numel"])}
