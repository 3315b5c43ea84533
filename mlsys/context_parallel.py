"""Context parallelism: one long sequence split over W ranks, attention computed without any rank holding it all.

Two ways, both exact (forward and backward equal full causal attention on one process):

- **Ring attention** ("Ring Attention with Blockwise Transformers for Near-Infinite Context", Liu et al.,
  https://arxiv.org/abs/2310.01889): each rank keeps its queries; the key/value blocks travel round a ring of
  ranks, and each arriving block is folded into the output by the online-softmax merge (`merge`). Backward sends
  the K/V round again, with their gradients travelling beside them. With a causal mask a contiguous split leaves
  the last rank most of the work, so the sequence is cut into 2W chunks and rank r takes chunks r and 2W-1-r
  (the "zigzag" split): every rank then does the same work (`causal_work`).
- **Ulysses** ("DeepSpeed Ulysses", Jacobs et al., https://arxiv.org/abs/2309.14509): an all-to-all turns
  "all heads, S/W tokens" into "H/W heads, all S tokens"; each rank runs ordinary attention on its heads; a second
  all-to-all turns it back. W must divide the number of heads.

Shapes follow torch's scaled_dot_product_attention: (B, H, S, D). A length that does not split evenly is padded
at the end (`padded_length`): under a causal mask no real query attends to a later position, so the padding
changes nothing the real tokens see, and its rows are dropped.

Layout: the computation (block attention, merge, its backward), then the communication (ring shift, all-to-all,
counted in `comm_log`), then the autograd functions that join them, then the formulas the tests hold them to.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mlsys.comm_log import comm_log  # noqa: F401  (cp.comm_log: the book's one log of transfers)
from mlsys.comm_log import record as _record

LAYOUTS = ("zigzag", "contiguous")
Chunk = tuple[int, int]  # [start, end) positions of one contiguous run of tokens


# ----------------------------------------------------------------------------------------------- who holds which tokens
def padded_length(seq: int, world_size: int, layout: str = "zigzag") -> int:
    """The length after padding at the end: a multiple of 2W for the zigzag split, of W for a contiguous one."""
    parts = 2 * world_size if layout == "zigzag" else world_size
    return -(-seq // parts) * parts


def shard_chunks(seq: int, world_size: int, rank: int, layout: str = "zigzag") -> list[Chunk]:
    """The runs of positions rank `rank` holds, in the order its local tensor stores them (seq already padded)."""
    if layout == "zigzag":
        c = seq // (2 * world_size)
        return [(rank * c, (rank + 1) * c), ((2 * world_size - 1 - rank) * c, (2 * world_size - rank) * c)]
    n = seq // world_size
    return [(rank * n, (rank + 1) * n)]


def shard(x: torch.Tensor, world_size: int, rank: int, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """This rank's tokens of a full (padded) tensor, chunks concatenated along `dim`."""
    return torch.cat([x.narrow(dim, a, b - a) for a, b in shard_chunks(x.shape[dim], world_size, rank, layout)], dim)


def unshard(parts: list[torch.Tensor], layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The full tensor from every rank's shard (the inverse of `shard`)."""
    world_size, seq = len(parts), sum(p.shape[dim] for p in parts)
    pieces = []
    for rank, part in enumerate(parts):
        offset = 0
        for a, b in shard_chunks(seq, world_size, rank, layout):
            pieces.append((a, part.narrow(dim, offset, b - a)))
            offset += b - a
    return torch.cat([p for _, p in sorted(pieces, key=lambda item: item[0])], dim)


def causal_work(seq: int, world_size: int, layout: str) -> list[int]:
    """Query-key pairs each rank scores under a causal mask (a query at position i sees keys 0..i)."""
    def pairs(a: int, b: int) -> int:  # sum over queries a..b-1 of (i + 1)
        return (b * (b + 1) - a * (a + 1)) // 2
    return [sum(pairs(a, b) for a, b in shard_chunks(seq, world_size, r, layout)) for r in range(world_size)]


# ----------------------------------------------------------------------------------------------- the computation
# --8<-- [start:merge]
def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's partial attention into the running one, in place (the online-softmax merge).

    out is softmax(s_seen) @ v_seen for the keys seen so far and lse = log(sum(exp(s_seen))); the block brings
    the same two for its keys. The combined softmax weighs each side by its share of the total exp-sum.
    """
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(torch.exp(block_lse - new_lse).unsqueeze(-1) * block_out)
    lse.copy_(new_lse)
# --8<-- [end:merge]


def _chunk_pairs(q_chunks: list[Chunk], k_chunks: list[Chunk]) -> Iterator[tuple[int, Chunk, int, Chunk, bool]]:
    """(q offset, q chunk, k offset, k chunk, needs a mask) for every pair where some query sees some key."""
    q_off = 0
    for qa, qb in q_chunks:
        k_off = 0
        for ka, kb in k_chunks:
            if qb - 1 >= ka:  # else every key in the chunk comes after every query: skipped, the causal saving
                yield q_off, (qa, qb), k_off, (ka, kb), qa < kb - 1
            k_off += kb - ka
        q_off += qb - qa


def _scores(q: torch.Tensor, k: torch.Tensor, qa: int, ka: int, masked: bool, scale: float) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    if masked:
        q_pos = torch.arange(qa, qa + q.shape[-2], device=q.device)
        k_pos = torch.arange(ka, ka + k.shape[-2], device=q.device)
        s = s.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))
    return s


def block_attention(q, k, v, q_chunks, k_chunks, out, lse, scale: float, q_tile: int = 128) -> int:
    """Attend this rank's queries to one K/V block, merging into (out, lse) in place; returns the pairs scored.

    Queries go `q_tile` rows at a time, so no more than q_tile x (block length) scores exist at once.
    """
    scored = 0
    for q_off, (qa, qb), k_off, (ka, kb), masked in _chunk_pairs(q_chunks, k_chunks):
        kc, vc = k[..., k_off:k_off + kb - ka, :], v[..., k_off:k_off + kb - ka, :]
        for t in range(0, qb - qa, q_tile):
            rows = slice(q_off + t, q_off + min(t + q_tile, qb - qa))
            s = _scores(q[..., rows, :], kc, qa + t, ka, masked, scale)
            block_lse = torch.logsumexp(s, dim=-1)
            merge(out[..., rows, :], lse[..., rows], torch.exp(s - block_lse.unsqueeze(-1)) @ vc, block_lse)
            scored += int(torch.isfinite(s[(0,) * (s.dim() - 2)]).sum())
    return scored


def block_attention_backward(q, k, v, dout, lse, delta, q_chunks, k_chunks, dq, dk, dv, scale: float,
                             q_tile: int = 128) -> None:
    """Gradients of one K/V block's share of the attention, added into dq, dk, dv in place.

    With p = exp(s - lse) recomputed from the saved lse (the final one, so p is the true softmax row):
    dv += p^T dout, dp = dout v^T, ds = p * (dp - delta) with delta = rowsum(dout * out), dq += ds k * scale,
    dk += ds^T q * scale.
    """
    for q_off, (qa, qb), k_off, (ka, kb), masked in _chunk_pairs(q_chunks, k_chunks):
        keys = slice(k_off, k_off + kb - ka)
        kc, vc = k[..., keys, :], v[..., keys, :]
        for t in range(0, qb - qa, q_tile):
            rows = slice(q_off + t, q_off + min(t + q_tile, qb - qa))
            p = torch.exp(_scores(q[..., rows, :], kc, qa + t, ka, masked, scale) - lse[..., rows].unsqueeze(-1))
            dv[..., keys, :] += p.transpose(-1, -2) @ dout[..., rows, :]
            ds = p * (dout[..., rows, :] @ vc.transpose(-1, -2) - delta[..., rows].unsqueeze(-1))
            dq[..., rows, :] += (ds @ kc) * scale
            dk[..., keys, :] += (ds.transpose(-1, -2) @ q[..., rows, :]) * scale


# ----------------------------------------------------------------------------------------------- the communication
def start_ring_shift(tensors: list[torch.Tensor], group, phase: str, tag: int = 0) -> tuple[list, list[torch.Tensor]]:
    """Send `tensors` to the next rank and receive the previous rank's, without waiting: (requests, buffers).

    `tag` keeps two shifts in flight at once apart (backward moves K/V and their gradients together)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt, prev = dist.get_global_rank(group, (rank + 1) % world), dist.get_global_rank(group, (rank - 1) % world)
    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group, tag + i) for i, t in enumerate(tensors)]
    ops += [dist.P2POp(dist.irecv, b, prev, group, tag + i) for i, b in enumerate(bufs)]
    _record("ring_send", phase, sum(t.numel() * t.element_size() for t in tensors))
    return dist.batch_isend_irecv(ops), bufs


def ring_shift(tensors: list[torch.Tensor], group, phase: str, tag: int = 0) -> list[torch.Tensor]:
    reqs, bufs = start_ring_shift(tensors, group, phase, tag)
    for req in reqs:
        req.wait()
    return bufs


def all_to_all(x: torch.Tensor, group, phase: str) -> torch.Tensor:
    """x's first dim has W blocks: block j goes to rank j; returns the blocks received, block j from rank j."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    _record("all_to_all", phase, x.numel() * x.element_size() * (world - 1) // world)
    dist.all_to_all_single(out, x, group=group)
    return out


# ----------------------------------------------------------------------------------------------- ring attention
class RingAttention(torch.autograd.Function):
    """Causal ring attention over `group`; q, k, v are this rank's shard (B, H, L, D) of a `layout` split."""

    # --8<-- [start:ring_forward]
    @staticmethod
    def forward(ctx, q, k, v, group, layout: str, q_tile: int):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        seq, scale = q.shape[-2] * world, 1.0 / math.sqrt(q.shape[-1])
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        mine = shard_chunks(seq, world, rank, layout)
        kv, src = [k, v], rank
        for step in range(world):
            pending = start_ring_shift(kv, group, "forward") if step < world - 1 else None
            block_attention(q, kv[0], kv[1], mine, shard_chunks(seq, world, src, layout), out, lse, scale, q_tile)
            if pending:
                for req in pending[0]:
                    req.wait()
                kv, src = pending[1], (src - 1) % world
        # --8<-- [end:ring_forward]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.q_tile = group, layout, q_tile
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, layout = ctx.group, ctx.layout
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        seq, scale = q.shape[-2] * world, 1.0 / math.sqrt(q.shape[-1])
        mine = shard_chunks(seq, world, rank, layout)
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(q)
        kv, dkv, src = [k, v], [torch.zeros_like(k), torch.zeros_like(v)], rank
        for step in range(world):
            pending = start_ring_shift(kv, group, "backward") if step < world - 1 else None
            block_attention_backward(q, kv[0], kv[1], dout, lse, delta, mine, shard_chunks(seq, world, src, layout),
                                     dq, dkv[0], dkv[1], scale, ctx.q_tile)
            if world > 1:  # the gradient of this block travels on with it; after W hops it is home
                dkv = ring_shift(dkv, group, "backward", tag=2)
            if pending:
                for req in pending[0]:
                    req.wait()
                kv, src = pending[1], (src - 1) % world
        return dq, dkv[0], dkv[1], None, None, None


def ring_attention(q, k, v, group=None, layout: str = "zigzag", q_tile: int = 128) -> torch.Tensor:
    return RingAttention.apply(q, k, v, group, layout, q_tile)


# ----------------------------------------------------------------------------------------------- Ulysses
def seq_to_heads(x: torch.Tensor, group, phase: str) -> torch.Tensor:
    """(B, H, S/W, D), this rank's tokens -> (B, H/W, S, D), this rank's heads (contiguous split of the tokens)."""
    world = dist.get_world_size(group)
    b, h, n, d = x.shape
    blocks = x.reshape(b, world, h // world, n, d).transpose(0, 1)  # block j: the heads rank j will own
    got = all_to_all(blocks, group, phase)  # got[j]: rank j's tokens of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * n, d)


def heads_to_seq(x: torch.Tensor, group, phase: str) -> torch.Tensor:
    """The inverse: (B, H/W, S, D), this rank's heads -> (B, H, S/W, D), this rank's tokens."""
    world = dist.get_world_size(group)
    b, hw, s, d = x.shape
    blocks = x.reshape(b, hw, world, s // world, d).permute(2, 0, 1, 3, 4)  # block j: rank j's tokens
    got = all_to_all(blocks, group, phase)  # got[j]: my tokens of rank j's heads
    return got.transpose(0, 1).reshape(b, world * hw, s // world, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return seq_to_heads(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad, ctx.group, "backward"), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return heads_to_seq(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad, ctx.group, "backward"), None


def ulysses_attention(q, k, v, group=None) -> torch.Tensor:
    """Causal attention of this rank's tokens (B, H, S/W, D), contiguous split, via two all-to-alls."""
    qh, kh, vh = (_SeqToHeads.apply(t, group) for t in (q, k, v))
    return _HeadsToSeq.apply(F.scaled_dot_product_attention(qh, kh, vh, is_causal=True), group)


# ----------------------------------------------------------------------------------------------- formulas
def comm_bytes(method: str, seq: int, world_size: int, heads: int, head_dim: int, batch: int = 1,
               dtype_bytes: int = 4) -> dict[str, int]:
    """Bytes one rank sends for one attention layer, forward and backward (seq already padded).

    ring: forward W-1 K/V hops; backward W-1 K/V hops plus W hops of their gradients (none at W = 1).
    ulysses: forward q, k, v to heads and the output back, each all-to-all keeping 1/W of the shard at home;
    backward the same four with gradients.
    """
    shard = batch * heads * (seq // world_size) * head_dim * dtype_bytes  # one (B, H, S/W, D) tensor
    w = world_size
    if method == "ring":
        return {"forward": 2 * (w - 1) * shard, "backward": 2 * (2 * w - 1) * shard if w > 1 else 0}
    if method == "ulysses":
        return {"forward": 4 * shard * (w - 1) // w, "backward": 4 * shard * (w - 1) // w}
    raise ValueError(f"method must be 'ring' or 'ulysses', got {method!r}")
