"""Tensor parallelism (Megatron-LM style) for the tiny GPT of `mlsys.model`, with optional sequence parallelism.

Every weight matrix of a transformer block is split across the ranks of a tensor-parallel GROUP (any process group,
not only WORLD), and the communication lives inside autograd functions, so `loss.backward()` is right with no extra
calls:

    f = copy_to_tp       forward: identity           backward: all-reduce     (in front of a column-parallel layer)
    g = reduce_from_tp   forward: all-reduce         backward: identity       (after a row-parallel layer)
    gather_from_sp       forward: all-gather (seq)   backward: reduce-scatter (sequence parallelism replaces f ...)
    reduce_scatter_to_sp forward: reduce-scatter     backward: all-gather     (... and g by these two)

    tp = shard_gpt(dense_gpt, group, sequence_parallel=False)   # copies/shards the dense weights
    logits, loss = tp(idx, targets)   # like GPT.forward: full-vocabulary logits (B, T, V) on every rank of `group`

Layout (t = group size, r = rank in the group):
  * ColumnParallelLinear holds rows [r*out/t, (r+1)*out/t) of the dense weight (out, in) and of its bias; its output
    is split along the last dimension. The fused qkv projection is split per q, k and v (`chunks=3`), so rank r
    owns heads [r*H/t, (r+1)*H/t) of all three.
  * RowParallelLinear holds columns [r*in/t, (r+1)*in/t) of the dense weight; its partial products are summed by g
    (or reduce-scattered over the sequence); the bias is replicated and added once, after the sum.
  * Embedding and head: the vocabulary is padded to a multiple of t with zero rows and split by rows (Megatron's
    vocab-parallel embedding). A token outside rank r's rows looks up zeros there, and g sums the ranks. The head
    reuses the same shard (weights stay tied), computes (B, T, V_pad/t) logits and all-gathers them along the
    vocabulary, then drops the padding. Position embeddings and LayerNorms are replicated.
  * Sequence parallelism (Korthikanti et al., https://arxiv.org/abs/2205.05198): between the blocks' linear layers
    the activations are split along the sequence (B, T/t, C); LayerNorm, residual adds and dropout work on that
    shard. The column layer all-gathers its input but saves only the shard for backward (and all-gathers it again
    there), so every saved activation of a block shrinks by t. Replicated parameters used on a sequence shard
    (LayerNorm, row-layer bias, position table) get their gradient all-reduced by f inside autograd.

Dropout: the checks run with dropout 0. With dropout on, the ranks of a group must share their torch seed so that
the replicated regions draw identical masks; the masks of split regions (heads, sequence shards) are then correlated
across ranks, which Megatron avoids with a separate random state per rank for those regions (not done here).

`comm_log()` records every collective these functions run (op, forward/backward, bytes), so tests can count them.

The code is in three files, communication kept apart from computation: mlsys/tp_comm.py (f, g, the sequence-parallel
pair, comm_log), mlsys/tp_layers.py (the parallel layers and the sharded GPT) and mlsys/tp_formulas.py (communication
and memory formulas). This module gathers their public names: `from mlsys.tensor_parallel import ...` reaches them all.
Reference: Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism",
https://arxiv.org/abs/1909.08053 (section 3).
"""

from mlsys.tp_comm import *  # noqa: F403
from mlsys.tp_formulas import *  # noqa: F403
from mlsys.tp_layers import *  # noqa: F403
