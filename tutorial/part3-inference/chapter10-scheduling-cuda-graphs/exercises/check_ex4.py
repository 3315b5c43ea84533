"""Checker for ch10.4 — the K/V heads and weight slices of each rank against the engine's own sharding
(mlsys.engine.tp.shard_model on a random Llama), the attention of the shards summed over ranks against the dense
layer, and the bytes per step against a count of the all-reduce calls, layer by layer (tests/test_tp_serving.py
checks the same count against what a running engine all-reduced)."""

from __future__ import annotations

import torch

from mlsys.engine.tp import shard_model
from mlsys.exercises import task
from mlsys.llama import Llama, LlamaConfig

SHAPES = [(8, 2, 2), (8, 2, 4), (8, 2, 8), (8, 8, 4), (4, 1, 2), (6, 3, 3), (8, 4, 2)]  # (H, H_kv, N)


def model(H: int, H_kv: int) -> Llama:
    torch.manual_seed(H * 10 + H_kv)
    return Llama(LlamaConfig(vocab_size=16, hidden_size=8 * H, intermediate_size=48, num_hidden_layers=1,
                             num_attention_heads=H, num_key_value_heads=H_kv, max_position_embeddings=16))


@task("kv_heads_of_rank: the K/V heads each rank's query heads read, split or replicated")
def check_heads(ex) -> None:
    for H, H_kv, N in SHAPES:
        group = H // H_kv
        for r in range(N):
            want = sorted({h // group for h in range(r * H // N, (r + 1) * H // N)})
            got = ex.kv_heads_of_rank(r, N, H, H_kv)
            assert list(got) == want, f"H={H}, H_kv={H_kv}, N={N}, rank {r}: {got}, want {want}"


@task("shard_attention: the slices the engine's shard_model keeps, and the ranks' outputs sum to the dense one")
def check_shards(ex) -> None:
    for H, H_kv, N in SHAPES:
        m = model(H, H_kv)
        a = m.blocks[0].self_attn
        x = torch.randn(5, 8 * H)
        total = torch.zeros(5, 8 * H)
        for r in range(N):
            wq, wk, wv, wo = ex.shard_attention(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
                                                a.o_proj.weight, r, N, H, H_kv)
            engine = shard_model(m, r, N).blocks[0]
            for name, got, want in (("q", wq, engine.wq), ("k", wk, engine.wk), ("v", wv, engine.wv),
                                    ("o", wo, engine.wo)):
                assert got.shape == want.shape and torch.equal(got, want), \
                    f"H={H}, H_kv={H_kv}, N={N}, rank {r}: the {name} slice differs from the engine's"
            total += (x @ wq.t()) @ wo.t()  # each rank's q heads through its o_proj columns: a partial sum
        dense = (x @ a.q_proj.weight.t()) @ a.o_proj.weight.t()
        assert torch.allclose(total, dense, atol=1e-5), f"H={H}, N={N}: the partial sums do not add up"


@task("all_reduce_bytes_per_step: two (tokens, hidden) all-reduces per layer")
def check_bytes(ex) -> None:
    for L, T, C, b in ((4, 16, 128, 4), (32, 1, 4096, 2), (1, 7, 64, 4)):
        want = sum(T * C * b for _layer in range(L) for _sublayer in ("attention", "mlp"))
        got = ex.all_reduce_bytes_per_step(L, T, C, b)
        assert got == want, f"{L} layers, {T} tokens, hidden {C}, {b} bytes: {got}, want {want}"
