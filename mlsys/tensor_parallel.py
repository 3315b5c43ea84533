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
Reference: Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism",
https://arxiv.org/abs/1909.08053 (section 3).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mlsys.model import GPT, GPTConfig, causal_attention


# ----------------------------------------------------------------------------------------------- recording collectives
@dataclass(frozen=True)
class CommEvent:
    op: str  # "all_reduce", "all_gather" or "reduce_scatter"
    phase: str  # "forward" or "backward"
    nbytes: int  # size of the FULL buffer: all_reduce's tensor, all_gather's output, reduce_scatter's input
    tag: str = "activation"  # "activation", or "param_grad" for the small gradient all-reduces of replicated params


_LOG: list[CommEvent] | None = None


@contextlib.contextmanager
def comm_log() -> Iterator[list[CommEvent]]:
    """Record every collective run by this module (in this process) while the block is active."""
    global _LOG
    previous, _LOG = _LOG, []
    try:
        yield _LOG
    finally:
        _LOG = previous


def _record(op: str, phase: str, nbytes: int, tag: str = "activation") -> None:
    if _LOG is not None:
        _LOG.append(CommEvent(op, phase, int(nbytes), tag))


def _size(group) -> int:
    return dist.get_world_size(group)


def _rank(group) -> int:
    return dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group, phase: str, tag: str = "activation") -> torch.Tensor:
    if _size(group) == 1:
        return x
    out = x.contiguous().clone()
    _record("all_reduce", phase, out.numel() * out.element_size(), tag)
    dist.all_reduce(out, group=group)
    return out


def _all_gather(x: torch.Tensor, dim: int, group, phase: str) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (in rank order)."""
    w = _size(group)
    if w == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(w)]
    _record("all_gather", phase, w * x.numel() * x.element_size())
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group, phase: str) -> torch.Tensor:
    """Sum `x` over the ranks and keep this rank's chunk along `dim`."""
    w = _size(group)
    if w == 1:
        return x
    chunks = [c.contiguous() for c in x.chunk(w, dim=dim)]
    out = torch.empty_like(chunks[_rank(group)])
    _record("reduce_scatter", phase, x.numel() * x.element_size())
    dist.reduce_scatter(out, chunks, group=group)
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's chunk of `x` along `dim` (no communication)."""
    return x.chunk(_size(group), dim=dim)[_rank(group)].contiguous()


# ----------------------------------------------------------------------------------------------- Megatron's f and g
# --8<-- [start:f_and_g]
class CopyToTP(torch.autograd.Function):
    """f: the input of a column-parallel layer. Forward: identity. Backward: all-reduce, because every rank's
    partial input gradient (from its own columns) must be summed to give the full gradient."""

    @staticmethod
    def forward(ctx, x, group, tag="activation"):
        ctx.group, ctx.tag = group, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, "backward", ctx.tag), None, None


class ReduceFromTP(torch.autograd.Function):
    """g: the output of a row-parallel layer. Forward: all-reduce the partial sums. Backward: identity, because
    the gradient of a sum with respect to each term is the gradient of the sum itself."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None
# --8<-- [end:f_and_g]


# --8<-- [start:sp_pair]
class GatherFromSP(torch.autograd.Function):
    """Sequence parallelism's f: all-gather the sequence shards (dim 1) forward; reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, 1, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 1, ctx.group, "backward"), None


class ReduceScatterToSP(torch.autograd.Function):
    """Sequence parallelism's g: sum the partial outputs and keep this rank's sequence shard; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, 1, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 1, ctx.group, "backward"), None
# --8<-- [end:sp_pair]


class GatherLastDim(torch.autograd.Function):
    """All-gather along the last dimension (the head's vocabulary shards); backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, -1, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


# --8<-- [start:column_sp_fn]
class ColumnSPLinearFn(torch.autograd.Function):
    """y = all_gather_seq(x) @ W^T + b, saving only the sequence shard x (B, T/t, in) for backward.

    Backward all-gathers x again to form dW, and reduce-scatters dX so each rank gets the gradient of its shard.
    Saving the gathered (B, T, in) input instead would keep a replicated activation alive and undo the memory saving.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group = group
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        full = _all_gather(x, 1, group, "forward")  # (B, T, in)
        return F.linear(full, weight, bias)  # (B, T, out/t)

    @staticmethod
    def backward(ctx, grad):  # grad: (B, T, out/t)
        x, weight = ctx.saved_tensors
        full = _all_gather(x, 1, ctx.group, "backward")  # recomputed, not stored
        grad_weight = grad.flatten(0, 1).t() @ full.flatten(0, 1)  # (out/t, in)
        grad_bias = grad.sum((0, 1)) if ctx.has_bias else None
        grad_x = _reduce_scatter(grad @ weight, 1, ctx.group, "backward")  # (B, T/t, in)
        return grad_x, grad_weight, grad_bias, None
# --8<-- [end:column_sp_fn]


def copy_to_tp(x: torch.Tensor, group, tag: str = "activation") -> torch.Tensor:
    return CopyToTP.apply(x, group, tag)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return ReduceFromTP.apply(x, group)


def gather_from_sp(x: torch.Tensor, group) -> torch.Tensor:
    return GatherFromSP.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    return ReduceScatterToSP.apply(x, group)


def gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    return GatherLastDim.apply(x, group)


def replicated_param(p: torch.Tensor | None, group, sequence_parallel: bool) -> torch.Tensor | None:
    """A replicated parameter as used inside a block: under sequence parallelism each rank sees only part of the
    sequence, so the parameter's gradient is partial and f all-reduces it in backward."""
    if p is None or not sequence_parallel:
        return p
    return copy_to_tp(p, group, "param_grad")


# ----------------------------------------------------------------------------------------------- the linear layers
def shard_rows(t: torch.Tensor, rank: int, size: int, chunks: int = 1) -> torch.Tensor:
    """Rank's rows of `t` (out, ...): with chunks=k the rows are k stacked blocks (q, k, v) split one by one."""
    if t.shape[0] % (chunks * size):
        raise ValueError(f"{t.shape[0]} rows do not split into {chunks} x {size} equal parts")
    blocks = t.chunk(chunks, dim=0)
    return torch.cat([b.chunk(size, dim=0)[rank] for b in blocks], dim=0).clone()


def shard_cols(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank's columns of a weight (out, in)."""
    if t.shape[1] % size:
        raise ValueError(f"{t.shape[1]} columns do not split into {size} equal parts")
    return t.chunk(size, dim=1)[rank].clone()


# --8<-- [start:column]
class ColumnParallelLinear(nn.Module):
    """Y_r = X W_r^T + b_r with W_r the rank's rows of the dense weight: output split along its last dimension."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, gather_output: bool = False,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.weight = nn.Parameter(weight)  # (out/t, in)
        self.bias = nn.Parameter(bias) if bias is not None else None  # (out/t,)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group, gather_output: bool = False, sequence_parallel: bool = False,
                   chunks: int = 1) -> ColumnParallelLinear:
        r, t = _rank(group), _size(group)
        bias = None if linear.bias is None else shard_rows(linear.bias.detach(), r, t, chunks)
        return cls(shard_rows(linear.weight.detach(), r, t, chunks), bias, group, gather_output, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # x: (B, T/t, in) -> gathered inside, shard saved
            y = ColumnSPLinearFn.apply(x, self.weight, self.bias, self.group)
        else:  # x: (B, T, in), replicated
            y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)  # (B, T, out/t)
        return gather_last_dim(y, self.group) if self.gather_output else y
# --8<-- [end:column]


# --8<-- [start:row]
class RowParallelLinear(nn.Module):
    """Y = sum_r X_r W_r^T + b with X_r the rank's slice of the input features and W_r its columns of the weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(weight)  # (out, in/t)
        self.bias = nn.Parameter(bias) if bias is not None else None  # (out,), replicated

    @classmethod
    def from_dense(cls, linear: nn.Linear, group, sequence_parallel: bool = False) -> RowParallelLinear:
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(shard_cols(linear.weight.detach(), _rank(group), _size(group)), bias, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, in/t)
        partial = F.linear(x, self.weight)  # (B, T, out): this rank's share of the sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sp(partial, self.group)  # (B, T/t, out)
        else:
            y = reduce_from_tp(partial, self.group)  # (B, T, out)
        bias = replicated_param(self.bias, self.group, self.sequence_parallel)
        return y if bias is None else y + bias  # added once, after the sum
# --8<-- [end:row]


# ----------------------------------------------------------------------------------------------- the model
def check_divisible(config: GPTConfig, tp: int) -> None:
    """ValueError (one line) when heads or hidden sizes do not split over `tp` ranks."""
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
    if config.n_head % tp:
        raise ValueError(f"n_head={config.n_head} is not divisible by tensor-parallel size {tp}")
    if (4 * config.n_embd) % tp or config.n_embd % tp:
        raise ValueError(f"hidden sizes n_embd={config.n_embd}, 4*n_embd={4 * config.n_embd} "
                         f"are not divisible by tensor-parallel size {tp}")


def check_tp_run(config: GPTConfig, world_size: int, tp_sizes, batch: int, seq: int,
                 sequence_parallel: bool = False) -> None:
    """ValueError (one line) unless a job of `world_size` ranks can run every size in `tp_sizes` on this GPT with
    batches of (batch, seq) tokens; with sequence parallelism the sequence is split over the tp ranks too."""
    for name, value in (("n_layer", config.n_layer), ("n_head", config.n_head), ("n_embd", config.n_embd),
                        ("batch", batch), ("seq", seq)):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if seq > config.block_size:
        raise ValueError(f"--seq {seq} exceeds the model's block_size {config.block_size}")
    if config.n_embd % config.n_head:
        raise ValueError(f"--n-embd {config.n_embd} is not divisible by --n-head {config.n_head}")
    for t in tp_sizes:
        if t < 1 or world_size % t:
            raise ValueError(f"tensor-parallel size {t} does not divide the world size {world_size}")
        if sequence_parallel and seq % t:
            raise ValueError(f"--seq {seq} is not divisible by tensor-parallel size {t}")
        check_divisible(config, t)


def _layer_norm(ln: nn.LayerNorm, x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    w = replicated_param(ln.weight, group, sequence_parallel)
    b = replicated_param(ln.bias, group, sequence_parallel)
    return F.layer_norm(x, ln.normalized_shape, w, b, ln.eps)


# --8<-- [start:mlp]
class TPMLP(nn.Module):
    """c_fc column-parallel (4C/t hidden units per rank), GELU on the local units, c_proj row-parallel.
    One collective forward (g after c_proj) and one backward (f before c_fc)."""

    def __init__(self, mlp: nn.Module, group, sequence_parallel: bool = False):
        super().__init__()
        self.c_fc = ColumnParallelLinear.from_dense(mlp.c_fc, group, sequence_parallel=sequence_parallel)
        self.c_proj = RowParallelLinear.from_dense(mlp.c_proj, group, sequence_parallel=sequence_parallel)
        self.dropout = nn.Dropout(mlp.dropout.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.c_fc(x), approximate="tanh")  # (B, T, 4C/t): no communication needed for GELU
        return self.dropout(self.c_proj(h))  # (B, T, C), or (B, T/t, C) with sequence parallelism
# --8<-- [end:mlp]


# --8<-- [start:attention]
class TPAttention(nn.Module):
    """Heads split across ranks: rank r computes heads [r*H/t, (r+1)*H/t) from its q, k, v rows of c_attn, and
    c_proj (row-parallel) mixes the heads back with one all-reduce."""

    def __init__(self, attn: nn.Module, group, sequence_parallel: bool = False):
        super().__init__()
        t = _size(group)
        if attn.n_head % t:
            raise ValueError(f"n_head={attn.n_head} is not divisible by tensor-parallel size {t}")
        self.n_head, self.dropout = attn.n_head // t, attn.dropout  # local heads
        self.c_attn = ColumnParallelLinear.from_dense(attn.c_attn, group, sequence_parallel=sequence_parallel,
                                                      chunks=3)
        self.c_proj = RowParallelLinear.from_dense(attn.c_proj, group, sequence_parallel=sequence_parallel)
        self.resid_dropout = nn.Dropout(attn.resid_dropout.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, T, 3C/t): T is the full sequence even when x is a sequence shard
        B, T, C3 = qkv.shape
        q, k, v = (z.view(B, T, self.n_head, C3 // 3 // self.n_head).transpose(1, 2)  # (B, H/t, T, D)
                   for z in qkv.split(C3 // 3, dim=2))
        y = causal_attention(q, k, v, self.dropout if self.training else 0.0)  # (B, H/t, T, D)
        y = y.transpose(1, 2).reshape(B, T, C3 // 3)  # (B, T, C/t): this rank's heads side by side
        return self.resid_dropout(self.c_proj(y))
# --8<-- [end:attention]


class TPBlock(nn.Module):
    """Pre-LayerNorm block; LayerNorms replicated (and run on the sequence shard under sequence parallelism)."""

    def __init__(self, block: nn.Module, group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.ln_1 = _copy_layer_norm(block.ln_1)
        self.attn = TPAttention(block.attn, group, sequence_parallel)
        self.ln_2 = _copy_layer_norm(block.ln_2)
        self.mlp = TPMLP(block.mlp, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C), or (B, T/t, C) with sequence parallelism
        x = x + self.attn(_layer_norm(self.ln_1, x, self.group, self.sequence_parallel))
        return x + self.mlp(_layer_norm(self.ln_2, x, self.group, self.sequence_parallel))


def _copy_layer_norm(ln: nn.LayerNorm) -> nn.LayerNorm:
    new = nn.LayerNorm(ln.normalized_shape, eps=ln.eps, elementwise_affine=True, bias=ln.bias is not None)
    new = new.to(device=ln.weight.device, dtype=ln.weight.dtype)  # same device and dtype as the dense model
    new.load_state_dict(ln.state_dict())
    return new


# --8<-- [start:vocab]
class VocabParallelEmbedding(nn.Module):
    """Rows [r*V_pad/t, (r+1)*V_pad/t) of the (zero-padded) token table. Returns a PARTIAL embedding: zeros for the
    tokens another rank owns; the caller sums the ranks (g, or a reduce-scatter under sequence parallelism)."""

    def __init__(self, wte: nn.Embedding, group):
        super().__init__()
        V, C = wte.weight.shape
        t, r = _size(group), _rank(group)
        self.vocab_size, self.padded_vocab = V, math.ceil(V / t) * t
        self.per_rank = self.padded_vocab // t
        self.start = r * self.per_rank
        padded = torch.zeros(self.padded_vocab, C, dtype=wte.weight.dtype, device=wte.weight.device)
        padded[:V] = wte.weight.detach()
        self.weight = nn.Parameter(padded[self.start:self.start + self.per_rank].clone())  # (V_pad/t, C)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # idx (B, T) -> partial (B, T, C)
        local = idx - self.start
        mine = (local >= 0) & (local < self.per_rank)
        x = F.embedding(local.clamp(0, self.per_rank - 1), self.weight)
        return x * mine.unsqueeze(-1)
# --8<-- [end:vocab]


class TPGPT(nn.Module):
    """A tensor-parallel copy of `mlsys.model.GPT`; forward(idx, targets=None) -> (logits (B, T, V), loss)."""

    def __init__(self, model: GPT, group, sequence_parallel: bool = False):
        super().__init__()
        check_divisible(model.config, _size(group))
        self.config, self.group, self.sequence_parallel = model.config, group, sequence_parallel
        self.wte = VocabParallelEmbedding(model.wte, group)
        self.wpe = nn.Embedding.from_pretrained(model.wpe.weight.detach().clone(), freeze=False)
        self.drop = nn.Dropout(model.drop.p)
        self.h = nn.ModuleList(TPBlock(b, group, sequence_parallel) for b in model.h)
        self.ln_f = _copy_layer_norm(model.ln_f)
        # the head shares the embedding's shard: tied weights stay tied, each rank scores its own vocabulary rows
        self.lm_head = ColumnParallelLinear(self.wte.weight, None, group, gather_output=True,
                                            sequence_parallel=sequence_parallel)
        self.lm_head.weight = self.wte.weight

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) -> (B, T, C), or this rank's sequence shard (B, T/t, C) under sequence parallelism."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"positions up to {T} exceed block_size={self.config.block_size}")
        partial = self.wte(idx)  # (B, T, C), zeros where another rank owns the token
        pos = torch.arange(T, device=idx.device)
        if self.sequence_parallel:
            t = _size(self.group)
            if T % t:
                raise ValueError(f"sequence length {T} is not divisible by tensor-parallel size {t}")
            x = reduce_scatter_to_sp(partial, self.group)  # (B, T/t, C)
            pos = pos.chunk(t)[_rank(self.group)]
        else:
            x = reduce_from_tp(partial, self.group)
        wpe = replicated_param(self.wpe.weight, self.group, self.sequence_parallel)
        return self.drop(x + F.embedding(pos, wpe))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and the vocab-parallel head: (B, T[/t], C) -> full logits (B, T, V) on every rank."""
        x = _layer_norm(self.ln_f, x, self.group, self.sequence_parallel)
        return self.lm_head(x)[..., :self.config.vocab_size]  # drop the padding rows' logits

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.embed(idx)
        for block in self.h:
            x = block(x)
        logits = self.head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def shard_gpt(model: GPT, group=None, sequence_parallel: bool = False) -> TPGPT:
    """A tensor-parallel copy of the dense `model` over `group` (None: WORLD). Every rank of the group must pass the
    same dense weights and the same `idx`. Raises ValueError when heads or hidden sizes do not divide."""
    group = group if group is not None else dist.group.WORLD
    return TPGPT(model, group, sequence_parallel).train(model.training)  # same train/eval mode as the dense model


def tp_groups(tp: int) -> tuple[dist.ProcessGroup, int]:
    """Split WORLD into world_size/tp groups of `tp` consecutive ranks; returns (this rank's group, its index).

    Collective: every rank must call it (each dist.new_group call is), with the same `tp`.
    """
    world = dist.get_world_size()
    if tp < 1 or world % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide the world size {world}")
    mine, index = None, 0
    for g in range(world // tp):
        ranks = list(range(g * tp, (g + 1) * tp))
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine, index = group, g
    return mine, index


def grads_as_model(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose parameters hold the original's gradients (zeros where None).

    Sharding this copy with the same code that sharded the weights gives, on each rank, the dense gradient slices
    the tensor-parallel parameters must equal: the oracle for TP gradients.
    """
    import copy

    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p_src, p_dst in zip(model.parameters(), clone.parameters()):
            p_dst.copy_(p_src.grad if p_src.grad is not None else torch.zeros_like(p_src))
    return clone


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
