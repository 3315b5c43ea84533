"""Tensor parallelism, the computation: column- and row-parallel linear layers, the sharded attention, MLP,
embedding and GPT, and the helpers that shard a dense model. Their communication: mlsys/tp_comm.py; the overview:
mlsys/tensor_parallel.py."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mlsys.model import GPT, GPTConfig, causal_attention
from mlsys.tp_comm import (
    ColumnSPLinearFn,
    _rank,
    _size,
    copy_to_tp,
    gather_last_dim,
    reduce_from_tp,
    reduce_scatter_to_sp,
    replicated_param,
)


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
