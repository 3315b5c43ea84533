"""Checker for ch08.2 — pairs counted by brute force, FLOPs against torch's FlopCounterMode running the tiny GPT,
bytes against the sizes of the model's real weight and KV-cache tensors."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mlsys.exercises import task
from mlsys.model import GPT, GPTConfig


def brute_pairs(q: int, k: int) -> int:
    cached = k - q
    return sum(1 for i in range(q) for j in range(k) if j <= cached + i)


@task("attention_pairs equals a brute-force count of the causal mask (prefills, decodes, chunks)")
def check_pairs(ex) -> None:
    for q, k in [(1, 1), (1, 17), (5, 5), (8, 8), (3, 10), (16, 40), (64, 64)]:
        got, want = ex.attention_pairs(q, k), brute_pairs(q, k)
        assert got == want, f"attention_pairs({q}, {k}) = {got}, want {want}"


def counted(model: GPT, batch: int, length: int, decode: bool) -> int:
    cache = model.new_kv_cache(batch, length + 1)
    idx = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if decode:
            model(idx, kv_cache=cache)
        with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
            model(idx[:, :1] if decode else idx, kv_cache=cache, start_pos=length if decode else 0)
    return counter.get_total_flops()


@task("step_flops + the masked scores a dense kernel computes == torch's flop counter on the tiny GPT")
def check_flops(ex) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg).eval()
    for batch, length, decode in [(1, 37, False), (3, 20, False), (4, 50, True), (2, 9, True)]:
        q = [1 if decode else length] * batch
        kv = [length + 1 if decode else length] * batch
        logits = batch * (1 if decode else length)  # GPT.forward computes the head at every position
        masked = sum(qi * ki - brute_pairs(qi, ki) for qi, ki in zip(q, kv))  # scored, then masked away
        got = ex.step_flops(cfg.n_layer, cfg.n_embd, cfg.vocab_size, q, kv, logits)
        want = counted(model, batch, length, decode) - 4 * cfg.n_layer * cfg.n_embd * masked
        assert got == want, (f"{'decode' if decode else 'prefill'} B={batch} T={length}: step_flops = {got:,}, "
                             f"the flop counter's useful FLOPs = {want:,}")


@task("step_bytes equals the bytes of the real weight and KV tensors (prefill, decode, a mixed step)")
def check_bytes(ex) -> None:
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg)
    params = {id(p): p for p in model.parameters()}  # the tied head counted once
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    one = model.new_kv_cache(1, 1)  # one position: every layer's K and V
    per_position = sum(c.k.numel() * c.k.element_size() + c.v.numel() * c.v.element_size() for c in one)
    num_params = sum(p.numel() for p in params.values())
    for q, kv in [([30], [30]), ([1, 1, 1], [12, 40, 7]), ([16, 1], [16, 33])]:
        got = ex.step_bytes(num_params, cfg.n_layer, cfg.n_embd, q, kv)
        want = weight_bytes + per_position * (sum(kv) + sum(q))
        assert got == want, f"q_lens {q}, kv_lens {kv}: step_bytes = {got:,}, want {want:,}"
    got = ex.step_bytes(1000, 2, 8, [1], [5], dtype_bytes=2)
    assert got == 1000 * 2 + 2 * 2 * 8 * 2 * 6, f"bf16: step_bytes(1000, 2, 8, [1], [5], 2) = {got}, want 2384"


@task("memory_bound: a batch-1 decode is memory-bound on an H100, a long prefill is not")
def check_bound(ex) -> None:
    peak, bw = 989e12, 3.35e12  # H100 SXM: dense bf16 FLOP/s, HBM bytes/s; ridge ~295 FLOP/B
    params = 8_000_000_000
    assert ex.memory_bound(2 * params, 2 * params, peak, bw), "decode, 1 FLOP per byte: memory-bound"
    assert not ex.memory_bound(2 * params * 4096, 2 * params, peak, bw), "4096-token prefill: compute-bound"
    assert ex.memory_bound(290.0, 1.0, peak, bw) and not ex.memory_bound(300.0, 1.0, peak, bw), (
        "the ridge point is peak / bandwidth ~ 295 FLOP per byte")
