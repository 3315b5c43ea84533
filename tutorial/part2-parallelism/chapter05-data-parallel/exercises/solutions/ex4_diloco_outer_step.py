"""Reference solution for ch05.4 — DiLoCo's outer step: averaged parameter change, Nesterov SGD."""

from __future__ import annotations

import torch
import torch.distributed as dist


def outer_step(global_params: torch.Tensor, local_params: torch.Tensor, buf: torch.Tensor, lr: float,
               momentum: float) -> tuple[torch.Tensor, torch.Tensor]:
    delta = global_params - local_params  # how far this rank moved, as a gradient would point: downhill is -delta
    dist.all_reduce(delta)  # one all-reduce per round, instead of one per step
    delta /= dist.get_world_size()
    buf = momentum * buf + delta
    return global_params - lr * (delta + momentum * buf), buf


def run_rounds(init: torch.Tensor, local_ends: list[torch.Tensor], lr: float, momentum: float) -> list:
    params, buf, out = init.clone(), torch.zeros_like(init), []
    for drift in local_ends:
        params, buf = outer_step(params, params + drift, buf, lr, momentum)
        out.append(torch.as_tensor(params).tolist())
    return out
