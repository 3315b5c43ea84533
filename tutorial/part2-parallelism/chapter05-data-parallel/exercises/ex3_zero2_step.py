"""Exercise ch05.3 (extend) — from ch05.2's gradient shard to whole ZeRO-2 training steps: reduce-scatter the
gradient, update only your slice with SGD + momentum (the momentum buffer is the sharded optimizer state), then
all-gather the updated parameters. And the memory table of the lesson, as a formula.

`zero2_train` runs on every rank of a real job; the process group is already initialised.
Check your work:  make check EX=ch05.3
"""

from __future__ import annotations

import torch
import torch.distributed as dist

REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def zero_bytes_per_rank(num_params: int, world_size: int, stage: int) -> dict[str, float]:
    """Bytes one rank holds under ZeRO stage 0-3, mixed precision: 2 per parameter for the bf16 weights, 2 for the
    bf16 gradients, 12 for the optimizer (fp32 master, Adam's m and v). Stage >= 1 divides the optimizer's bytes by
    world_size, stage >= 2 also the gradients', stage 3 also the weights'.
    Returns {"params": ..., "grads": ..., "optimizer": ..., "total": ...}. Example: 1000 params, 4 ranks,
    stage 2 -> params 2000, grads 500, optimizer 3000, total 5500.
    """
    raise NotImplementedError("TODO: 2, 2 and 12 bytes per parameter, each divided by W from its stage on")


def zero2_train(init: torch.Tensor, grads: list[torch.Tensor], lr: float, momentum: float) -> dict:
    """Run len(grads) ZeRO-2 steps of SGD with momentum on the flat float32 parameters `init` (numel,), the same on
    every rank. grads[k] is THIS rank's full flat gradient at step k; the step must use the MEAN over the ranks.

    Every step: zero-pad the gradient to `padded` (a multiple of W), reduce-scatter it (REDUCE_SCATTER, a SUM)
    into this rank's slice of padded // W elements and divide by W; update the momentum buffer of the slice,
    buf = momentum * buf + g (torch.optim.SGD's rule; buf starts at zero), and the slice of the parameters,
    p = p - lr * buf; then all-gather (ALL_GATHER) every rank's slice into the full padded parameters.
    Keep the momentum buffer for your slice ONLY.
    Returns {"params": the final (numel,) parameters, "state_numel": elements in your momentum buffer}.
    """
    raise NotImplementedError("TODO: per step: pad, reduce-scatter, / W, momentum on the slice, all-gather")


# ----------------------------------------------------------------------------------------------- provided
def run_train(init: torch.Tensor, grads: list[torch.Tensor], lr: float, momentum: float) -> dict:
    """(Given, do not edit.) Calls zero2_train and hands plain lists to the checker."""
    out = zero2_train(init.clone(), [g.clone() for g in grads], lr, momentum)
    return {"params": torch.as_tensor(out["params"]).tolist(), "state_numel": int(out["state_numel"])}
