"""Checker for ch09.2 — your sizing against mlsys.kv_memory (the book's calculator) and the published shapes."""

from __future__ import annotations

import math
import random

from mlsys import kv_memory as kvm
from mlsys.exercises import task


@task("kv_bytes_per_token: Llama-3-8B is 128 KiB in bf16 (GQA), and every published shape matches kv_memory")
def check_per_token(ex) -> None:
    got = ex.kv_bytes_per_token(32, 8, 128, 2)
    assert got == 131072, f"Llama-3-8B (32 layers, 8 KV heads, head_dim 128, bf16): {got}, want 131072"
    for name, s in kvm.MODEL_SHAPES.items():
        want = kvm.shape_kv_bytes_per_token(s, "bf16")
        got = ex.kv_bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim, 2)
        assert got == want, f"{name}: {got}, want {want} (kv_heads = {s.num_kv_heads}, not {s.num_heads})"


@task("max_sequences equals kv_memory.kv_capacity over GPUs, models, block sizes and lengths")
def check_capacity(ex) -> None:
    rng = random.Random(0)
    for name, s in kvm.MODEL_SHAPES.items():
        per_token = kvm.shape_kv_bytes_per_token(s, "bf16")
        weights = kvm.weight_bytes(s.num_params, "bf16")
        for gpu_gib in (24, 80, 141):
            bs, seq_len, reserve = rng.choice([1, 16, 32]), rng.choice([100, 2048, 4097]), rng.choice([0.0, 0.1])
            want = kvm.kv_capacity(gpu_gib * 2**30, weights, per_token, reserve, seq_len, bs)["max_sequences"]
            got = ex.max_sequences(gpu_gib * 2**30, weights, per_token, reserve, seq_len, bs)
            assert got == want, (f"{name} on {gpu_gib} GiB, block_size {bs}, seq_len {seq_len}, reserve {reserve}: "
                                 f"{got} sequences, want {want}")
    assert ex.max_sequences(1e9, 2e9, 1000, 0.1, 10, 16) == 0, "weights larger than the GPU: 0 sequences"


@task("waste: paged vs reserved equals kv_memory.fragmentation")
def check_waste(ex) -> None:
    rng = random.Random(1)
    many = [rng.randint(1, 500) for _ in range(50)]
    for lens, bs in [([10, 20, 30], 16), ([1], 16), ([17, 33, 64, 5], 4), (many, 16)]:
        want = kvm.fragmentation(lens, bs)
        paged, reserved = ex.waste(lens, bs)
        assert math.isclose(paged, want["paged_waste"], abs_tol=1e-12), f"{lens[:6]}, bs {bs}: paged {paged}"
        assert math.isclose(reserved, want["reserved_waste"], abs_tol=1e-12), f"{lens[:6]}: reserved {reserved}"
