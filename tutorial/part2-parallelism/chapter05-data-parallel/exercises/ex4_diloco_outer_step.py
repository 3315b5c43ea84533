"""Exercise ch05.4 (extend) — DiLoCo's outer step: after H local steps, average what every rank's parameters
moved, treat it as a gradient, and take one SGD step with Nesterov momentum from the last global parameters.
Runs on every rank of a real job (the process group is already initialised).
Check your work:  make check EX=ch05.4
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


def outer_step(global_params: torch.Tensor, local_params: torch.Tensor, buf: torch.Tensor, lr: float,
               momentum: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One outer step. `global_params` (the same on every rank) is where this round started, `local_params` where
    THIS rank's inner steps ended, `buf` the Nesterov momentum buffer (the same on every rank).

    The outer gradient is the MEAN over ranks of (global_params - local_params): one all_reduce. Then
    torch.optim.SGD's rule with nesterov=True: buf = momentum * buf + g, and
    new = global_params - lr * (g + momentum * buf).
    Returns (new global parameters, new buf), equal on every rank. Do not modify the arguments in place.
    """
    raise NotImplementedError("TODO: all_reduce the change, divide by W, then Nesterov SGD")


# ----------------------------------------------------------------------------------------------- provided
def run_rounds(init: torch.Tensor, local_ends: list[torch.Tensor], lr: float, momentum: float) -> list:
    """(Given, do not edit.) Round k starts from the current global parameters; this rank's inner steps end at
    global + local_ends[k] (a stand-in for H real AdamW steps). Returns the global parameters after every round."""
    params, buf, out = init.clone(), torch.zeros_like(init), []
    for drift in local_ends:
        params, buf = outer_step(params, params + drift, buf, lr, momentum)
        out.append(torch.as_tensor(params).tolist())
    return out
