"""Exercise ch06.2 (warm-up) — what tensor parallelism costs per block: the bytes one rank sends, with and without
sequence parallelism, and the activations one rank keeps for backward. Pure arithmetic, from the lesson's counts.

Check your work:  make check EX=ch06.2
"""

from __future__ import annotations


def block_comm_bytes(batch: int, seq: int, hidden: int, tp: int, dtype_bytes: int,
                     sequence_parallel: bool) -> tuple[float, float]:
    """(forward, backward) bytes ONE rank sends for the activation collectives of one transformer block.

    N = batch * seq * hidden * dtype_bytes. Ring costs per rank: all-reduce 2(t-1)/t N, all-gather and
    reduce-scatter (t-1)/t N each.
      TP:       forward 2 all-reduces;  backward 2 all-reduces.
      TP + SP:  forward 2 x (all-gather + reduce-scatter);
                backward 2 x (all-gather + all-gather again for the saved shard + reduce-scatter).
    tp = 1 sends nothing. Example: N = 1000 bytes, t = 2, TP -> (2000.0, 2000.0).
    """
    raise NotImplementedError("TODO: count the collectives of each direction, times their ring cost")


def block_activation_bytes(batch: int, seq: int, hidden: int, heads: int, tp: int, dtype_bytes: int,
                           sequence_parallel: bool) -> float:
    """Bytes of activations one rank saves for backward in one block (sbh = seq*batch*hidden, sb = seq*batch):

      TP:       dtype_bytes * (sbh * (4 + 12/t) + 4 sb + heads * sb / t)
      TP + SP:  dtype_bytes * (sbh * 16/t + 4 sb/t + heads * sb / t)
    """
    raise NotImplementedError("TODO: the two formulas of the lesson")


def sp_saving(tp: int) -> float:
    """How many times fewer sbh-activations a rank keeps with SP than with plain TP (the main term only):
    (4 + 12/t) / (16/t). Examples: 1.25 at t = 2, 1.75 at t = 4."""
    raise NotImplementedError("TODO: simplify (4 + 12/t) / (16/t)")
