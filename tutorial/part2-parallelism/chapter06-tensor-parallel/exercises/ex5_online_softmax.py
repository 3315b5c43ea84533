"""Exercise ch06.5 (build) — the two pieces of ring attention that need no communication: the online-softmax
merge that folds one key/value block into a query's running output, and the zigzag split that gives every rank
the same causal work. Then use your merge to compute causal attention one key block at a time, as one rank of
the ring does while the blocks arrive.
Check your work:  make check EX=ch06.5
"""

from __future__ import annotations

import torch


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The combined (out, lse) of two partial attentions of the same queries over DISJOINT sets of keys.

    For one set of keys with scores s (one row per query): out = softmax(s) @ v over that set, shape (..., Q, D),
    and lse = logsumexp(s) per query row, shape (..., Q). Return the same two for the union of the two sets,
    as if softmax had run over the concatenated scores. Each side's softmax was normalised by its own exp-sum
    exp(lse); in the union each side counts in proportion to its share of the total exp-sum.
    A row whose lse is -inf saw no key on that side (its out is 0 by convention): the result for that row is
    then the other side, exactly, and never NaN. Stay finite for scores around 1000: never form exp(lse) itself.
    """
    raise NotImplementedError("TODO: new lse = log(exp(lse) + exp(block_lse)), computed stably; weigh each out by "
                              "exp(its lse - new lse)")


def zigzag_chunks(seq: int, world_size: int, rank: int) -> list[tuple[int, int]]:
    """The [start, end) runs of positions rank `rank` holds under the zigzag split, early run first.

    seq (divisible by 2 * world_size) is cut into 2W equal chunks, chunk i = positions i*c .. (i+1)*c - 1 with
    c = seq / 2W; rank r takes chunks r and 2W - 1 - r. Example: seq = 16, W = 2: rank 0 holds [(0, 4), (12, 16)],
    rank 1 holds [(4, 8), (8, 12)].
    """
    raise NotImplementedError("TODO: c = seq // (2 * world_size); two runs of c positions each")


def attention_by_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    """Causal attention of q, k, v (B, H, S, D), scale 1/sqrt(D), computed by visiting the keys `block` at a time.

    Start from out = 0 (B, H, S, D) and lse = -inf (B, H, S). For each key block in order (keys a .. b-1, the
    last block may be shorter): score all S queries against its keys, mask with -inf every key after its query,
    compute the block's own (block_out, block_lse) and fold it in with YOUR merge; call merge for every block,
    the first included. A query row before the block's first key sees none of its keys: it must bring
    block_lse = -inf and block_out = 0 (softmax of an all -inf row is NaN). Return out. The result must equal
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), to rounding.
    """
    raise NotImplementedError("TODO: loop over key blocks: scores, causal mask, logsumexp, exp(s - lse) @ v, merge")
