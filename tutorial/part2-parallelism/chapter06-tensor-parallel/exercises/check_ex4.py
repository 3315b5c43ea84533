"""Checker for ch06.4 — your row order against the weight read head by head, and a tensor-parallel attention
computed from each rank's block against the dense mlsys.model attention."""

from __future__ import annotations

import torch

from mlsys.exercises import task
from mlsys.model import CausalSelfAttention, GPTConfig


def _order(head_order, C: int, tp: int) -> torch.Tensor:
    order = torch.as_tensor(head_order(C, tp))
    assert order.shape == (3 * C,), f"C={C}, tp={tp}: head_order returned shape {tuple(order.shape)}, want ({3 * C},)"
    assert sorted(order.tolist()) == list(range(3 * C)), f"C={C}, tp={tp}: not a permutation of range({3 * C})"
    return order.long()


@task("head_order: each of the tp blocks holds its heads' q rows, then k rows, then v rows (H=4, 6, 8; tp=1, 2, 3, 4)")
def check_blocks(ex) -> None:
    for H, D, tp in [(4, 2, 2), (4, 3, 4), (6, 2, 3), (8, 1, 2), (4, 2, 1)]:
        C = H * D
        w = torch.arange(3 * C, dtype=torch.float64)[:, None].expand(3 * C, 2)  # row i holds i: rows readable
        by_head = w.view(3, H, D, 2)  # (q|k|v, head, row within head, in)
        per = H // tp
        for r, block in enumerate(w[_order(ex.head_order, C, tp)].chunk(tp)):
            want = torch.cat([by_head[part, r * per:(r + 1) * per].reshape(-1, 2) for part in range(3)])
            assert torch.equal(block, want), (
                f"H={H}, head dim {D}, tp={tp}: rank {r}'s block has rows {block[:, 0].long().tolist()}, want "
                f"{want[:, 0].long().tolist()} (its heads' q rows, then k, then v)")


@task("head_order: attention computed per rank from its block, outputs summed, equals the dense attention (tp = 2, 4)")
def check_attention(ex) -> None:
    torch.manual_seed(0)
    config = GPTConfig(n_head=4, n_embd=32, block_size=16, dropout=0.0)
    dense = CausalSelfAttention(config).eval()
    x = torch.randn(2, 8, 32)
    want = dense(x)
    for tp in (2, 4):
        order = _order(ex.head_order, 32, tp)
        total = dense.c_proj.bias.detach().clone()
        for r, (w, b) in enumerate(zip(dense.c_attn.weight[order].chunk(tp), dense.c_attn.bias[order].chunk(tp),
                                       strict=True)):
            part = CausalSelfAttention(GPTConfig(n_head=4 // tp, n_embd=32 // tp, block_size=16, dropout=0.0))
            part.head_dim = 8  # the rank's heads keep their width; the module reads the head count from the input
            q, k, v = (x @ w.T + b).chunk(3, dim=2)
            y = part.core(part.split_heads(q), part.split_heads(k), part.split_heads(v), 0.0)
            y = y.transpose(1, 2).reshape(2, 8, -1)
            cols = slice(r * 32 // tp, (r + 1) * 32 // tp)  # row-parallel c_proj: this rank's input columns
            total = total + y @ dense.c_proj.weight[:, cols].T
        err = (total - want).abs().max().item()
        assert err < 1e-5, f"tp={tp}: the ranks' attention outputs, summed, differ from the dense layer by {err:.3g}"
