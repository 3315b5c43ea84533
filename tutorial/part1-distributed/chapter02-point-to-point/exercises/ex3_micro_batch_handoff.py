"""Exercise ch02.3 (extend) — the lesson's pipeline hand-off, changed to cut the batch into micro-batches.

Rank r of W holds stage r of a W-stage model; every stage is `stage(x, weight, bias) = tanh(x @ weight.T + bias)`.
The lesson sends the whole batch through the stages once. Here the batch of B rows is cut into `num_micro` equal
micro-batches: every stage runs all the forwards (micro-batch 0, 1, ...), then all the backwards in the same
order, accumulating its parameter gradients (GPipe's schedule, without the overlap). The gradients must equal
the whole batch's, loss = mse_loss(model(x), target) with the default mean over all B rows.
Runs on every rank of a real gloo job; use blocking dist.send / dist.recv.
Check your work:  make check EX=ch02.3
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)
import torch.nn.functional as F


def stage(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """(Given.) One pipeline stage: (b, h) -> (b, h)."""
    return torch.tanh(F.linear(x, weight, bias))


def micro_batched_step(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       num_micro: int) -> dict:
    """One forward + backward of this rank's stage over `num_micro` micro-batches.

    x (B, h) is the input (only rank 0 uses it) and target (B, h) the target (only the last rank uses it); every
    rank gets both. weight (h, h) and bias (h,) are this rank's stage: make them leaves that require grad.
    Forward, for each micro-batch i: rank 0 takes x.chunk(num_micro)[i]; other ranks receive it from rank - 1
    (mark it requires_grad so that backward fills its .grad); run `stage`; send the output (detached) to rank + 1
    unless last. Keep each micro-batch's input and output for the backward.
    Backward, for each micro-batch i in the same order: the last rank calls backward on
    mse_loss(out_i, target_i) / num_micro (the mean over B rows is the mean of the micro-batch means, divided by
    how many there are); the others receive d(loss)/d(out_i) from rank + 1 and call out_i.backward(it). Every
    rank but 0 then sends its input's .grad to rank - 1.
    Returns {"loss": the summed loss (a float) on the last rank, None elsewhere,
             "grad_weight": weight.grad, "grad_bias": bias.grad}.
    """
    raise NotImplementedError("TODO: all forwards (recv, stage, send), then all backwards (recv grad, backward, "
                              "send input grad), accumulating into weight.grad and bias.grad")


# ----------------------------------------------------------------------------------------------- provided
def run_step(x, target, weight, bias, num_micro: int) -> dict:
    """(Given, do not edit.) Calls micro_batched_step and turns its tensors into lists for the checker."""
    out = micro_batched_step(x, target, weight, bias, num_micro)
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
