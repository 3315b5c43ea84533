"""Tensor parallelism, the arithmetic: bytes communicated per layer and activation bytes per block, with and without
sequence parallelism, and a measurement of what autograd saves (to test the formulas against). The overview:
mlsys/tensor_parallel.py."""

from __future__ import annotations

import torch


# ----------------------------------------------------------------------------------------------- formulas
# --8<-- [start:comm_formula]
def layer_comm_volume(batch: int, seq: int, hidden: int, tp: int, dtype_bytes: int = 4,
                      sequence_parallel: bool = False) -> dict:
    """The activation collectives of ONE transformer block (attention + MLP), and the bytes one rank sends.

    N = batch * seq * hidden * dtype_bytes is the size of one full activation (B, T, C).
      TP:  forward  2 all-reduce(N)                 backward 2 all-reduce(N)
      SP:  forward  2 x [all-gather(N), reduce-scatter(N)]
           backward 2 x [all-gather(N) (g's backward), all-gather(N) (re-gather the saved shard), reduce-scatter(N)]
    Ring cost per rank: all-reduce sends 2(t-1)/t * N, all-gather and reduce-scatter (t-1)/t * N each, so SP's
    forward moves exactly what TP's does. The small all-reduces of replicated-parameter gradients are left out.
    """
    from mlsys.collectives import comm_volume

    n = batch * seq * hidden * dtype_bytes
    if tp == 1:
        forward, backward = [], []
    elif sequence_parallel:
        forward = [("all_gather", n), ("reduce_scatter", n)] * 2
        backward = [("all_gather", n), ("all_gather", n), ("reduce_scatter", n)] * 2
    else:
        forward, backward = [("all_reduce", n)] * 2, [("all_reduce", n)] * 2

    def sent(ops: list) -> float:
        return sum(comm_volume(op, nbytes, tp)["sent"] for op, nbytes in ops)

    return {"activation_bytes": n, "forward": forward, "backward": backward,
            "forward_sent_per_rank": sent(forward), "backward_sent_per_rank": sent(backward)}
# --8<-- [end:comm_formula]


# --8<-- [start:memory_formula]
def block_activation_bytes(batch: int, seq: int, hidden: int, heads: int, tp: int, dtype_bytes: int = 4,
                           sequence_parallel: bool = False) -> dict:
    """Bytes of activations one rank saves for backward in ONE block (dropout off, fused attention kernel).

    Counted tensor by tensor (sbh = seq * batch * hidden elements):
      replicated under TP (split by t only with SP):  LN1 input, LN1 output, LN2 input, LN2 output = 4 sbh
                                                      and the mean and 1/std of both LayerNorms = 4 sb
      split by t in both:  q, k, v (3 sbh), attention output = c_proj input (sbh), GELU input (4 sbh),
                           GELU output = c_proj input (4 sbh) = 12 sbh, and the attention log-sum-exp (heads * sb)
      TP:      dtype * (sbh * (4 + 12/t) + 4 sb + a sb / t)
      TP + SP: dtype * (sbh * 16/t + 4 sb/t + a sb / t)
    The paper's count for 16-bit training with dropout masks and the attention matrix stored is
    sbh (10 + 24/t + 5as/(ht)) without SP and sbh/t (34 + 5as/h) with it (Korthikanti et al., section 4).
    """
    sbh, sb = seq * batch * hidden, seq * batch
    if sequence_parallel:
        elements = sbh * 16 / tp + 4 * sb / tp + heads * sb / tp
    else:
        elements = sbh * (4 + 12 / tp) + 4 * sb + heads * sb / tp
    return {"bytes": elements * dtype_bytes, "replicated_fraction": 0.0 if sequence_parallel or tp == 1
            else (4 * sbh + 4 * sb) / elements}
# --8<-- [end:memory_formula]


def saved_activation_bytes(fn, params: list[torch.Tensor]) -> tuple:
    """(fn(), bytes autograd saved for backward while fn ran), counting each storage once and skipping the
    parameters' storages (measured with torch.autograd.graph.saved_tensors_hooks)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())
