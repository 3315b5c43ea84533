"""Exercise ch06.3 (extend) — the lesson's vocabulary-parallel head gathers the full (N, V) logits before the loss.
Change it as Megatron does: compute the cross-entropy from each rank's slice of the vocabulary, all-reducing three
numbers per token (a max and two sums) instead of gathering V logits. Chapter 3's sharded softmax, applied to the
loss. Runs on every rank of a real job; the process group is already initialised.
Check your work:  make check EX=ch06.3
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int) -> float:
    """The mean over N tokens of cross_entropy(full_logits, targets), from this rank's columns only.

    local_logits (N, V_r): the logits of vocabulary ids vocab_start .. vocab_start + V_r - 1 (ranks hold
    different V_r; together, in rank order, they are the full (N, V)). targets (N,): ids in [0, V).
    Per token: loss = log(sum over ALL ids of exp(logit)) - logit[target]. Compute it stably:
      1. m = the GLOBAL max logit of each token (local max, all_reduce MAX);
      2. s = the sum over all ids of exp(logit - m) (local sum, all_reduce SUM);
      3. the target's logit: only the rank whose slice holds it contributes it, the others 0 (all_reduce SUM);
      loss = log(s) + m - target_logit, averaged over the N tokens. Never all_gather the logits.
    Must not overflow for logits around 1000.
    """
    raise NotImplementedError("TODO: all_reduce MAX of the row maxima, SUM of the exp sums, SUM of the masked "
                              "target logits")
