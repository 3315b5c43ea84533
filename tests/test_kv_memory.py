"""mlsys.kv_memory: every formula against a hand-computed case, the published shapes against their parameter counts."""

from __future__ import annotations

import pytest

from mlsys import kv_memory as kvm
from mlsys.model import GPT, GPTConfig, num_params


def test_llama3_8b_is_128_kib_per_token_in_bf16():
    # 2 (K, V) * 32 layers * 8 KV heads * 128 dims * 2 bytes = 131072 B = 128 KiB
    s = kvm.MODEL_SHAPES["llama-3-8b"]
    assert kvm.kv_bytes_per_token(32, 8, 128, 2) == 131072
    assert kvm.shape_kv_bytes_per_token(s, "bf16") == 128 * 1024
    assert kvm.shape_kv_bytes_per_token(s, "bf16", mha=True) == 512 * 1024  # 32 KV heads if it were MHA
    assert s.attention == "GQA"


@pytest.mark.parametrize("name, kib_bf16", [
    ("llama-3-70b", 2 * 80 * 8 * 128 * 2 / 1024),   # 320 KiB
    ("mistral-7b", 2 * 32 * 8 * 128 * 2 / 1024),    # 128 KiB
    ("llama-2-7b", 2 * 32 * 32 * 128 * 2 / 1024),   # 512 KiB (MHA)
    ("mlsys-small", 2 * 4 * 4 * 32 * 2 / 1024),     # 2 KiB
])
def test_published_shapes_bytes_per_token(name, kib_bf16):
    assert kvm.shape_kv_bytes_per_token(kvm.MODEL_SHAPES[name], "bf16") == kib_bf16 * 1024


def test_dtypes_scale_linearly_and_mqa():
    assert kvm.kv_bytes_per_token(32, 8, 128, "fp32") == 2 * 131072
    assert kvm.kv_bytes_per_token(32, 8, 128, "fp8") == 65536
    assert kvm.kv_bytes_per_token(32, 8, 128, "int4") == 32768
    assert kvm.kv_bytes_per_token(1, 1, 1, 0.5) == 1  # 2 * 0.5 bytes
    assert kvm.kv_bytes_per_token(32, 1, 128, 2) == 16384  # MQA: one KV head


@pytest.mark.parametrize("name", ["llama-3-8b", "llama-3-70b", "mistral-7b", "llama-2-7b"])
def test_published_param_counts_match_the_shapes(name):
    s = kvm.MODEL_SHAPES[name]
    assert kvm.llama_num_params(s) == s.num_params
    assert s.head_dim * s.num_heads == s.hidden_size and s.num_heads % s.num_kv_heads == 0
    assert s.source.startswith("https://huggingface.co/")


def test_mlsys_small_matches_the_real_model():
    c = GPTConfig.preset("small")
    s = kvm.MODEL_SHAPES["mlsys-small"]
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.vocab_size) == (c.n_layer, c.n_head, c.head_dim, c.vocab_size)
    assert s.num_params == num_params(GPT(c)) == kvm.gpt_num_params(c)


def test_per_request_and_weights():
    assert kvm.kv_bytes_per_request(131072, 1000, 24) == 131072 * 1024  # 1024 tokens of Llama-3-8B = 128 MiB
    assert kvm.weight_bytes(8_030_261_248, "bf16") == 16_060_522_496
    assert kvm.blocks_for_tokens(0, 16) == 0 and kvm.blocks_for_tokens(16, 16) == 1
    assert kvm.blocks_for_tokens(17, 16) == 2


def test_capacity_after_weights_hand_computed():
    # 80 GiB, 10 % reserved -> 72 GiB; minus 16 GiB weights -> 56 GiB = 458752 tokens of 128 KiB
    out = kvm.kv_capacity(80 * kvm.GIB, 16 * kvm.GIB, 131072, reserve_fraction=0.1, seq_len=8192, block_size=16)
    assert out["kv_budget_bytes"] == 56 * kvm.GIB
    assert out["max_tokens"] == 458752 and out["num_blocks"] == 458752 // 16
    assert out["max_sequences"] == 56  # 8192 tokens = 1 GiB each
    # block rounding: 17-token sequences take 2 blocks of 16
    out = kvm.kv_capacity(64, 0, 1, reserve_fraction=0, seq_len=17, block_size=16)
    assert (out["num_blocks"], out["max_sequences"]) == (4, 2)


def test_capacity_never_negative_or_infinite():
    out = kvm.kv_capacity(10 * kvm.GIB, 40 * kvm.GIB, 131072, seq_len=100)  # weights do not fit
    assert out == {"kv_budget_bytes": 0.0, "num_blocks": 0, "max_tokens": 0, "max_sequences": 0}
    assert kvm.kv_capacity(0, 0, 1)["max_tokens"] == 0


def test_fragmentation_hand_computed():
    # lengths 1, 16, 17 with blocks of 16: paged holds 16 + 16 + 32 = 64 slots for 34 tokens;
    # reservation at the longest (17) holds 51 slots
    f = kvm.fragmentation([1, 16, 17], block_size=16)
    assert (f["used_tokens"], f["paged_tokens"], f["reserved_tokens"]) == (34, 64, 51)
    assert f["paged_waste"] == pytest.approx(1 - 34 / 64)
    assert f["reserved_waste"] == pytest.approx(1 - 34 / 51)
    assert kvm.fragmentation([], 16) == {"used_tokens": 0, "paged_tokens": 0, "reserved_tokens": 0,
                                         "paged_waste": 0.0, "reserved_waste": 0.0}


@pytest.mark.parametrize("call", [
    lambda: kvm.kv_bytes_per_token(0, 8, 128, 2),
    lambda: kvm.kv_bytes_per_token(32, 0, 128, 2),
    lambda: kvm.kv_bytes_per_token(32, 8, 128, 0),
    lambda: kvm.kv_bytes_per_token(32, 8, 128, "bf17"),
    lambda: kvm.kv_bytes_per_token(32.5, 8, 128, 2),
    lambda: kvm.kv_capacity(80, 1, 0),
    lambda: kvm.kv_capacity(80, 1, 1, reserve_fraction=1.0),
    lambda: kvm.kv_capacity(-1, 1, 1),
    lambda: kvm.kv_capacity(80, 1, 1, seq_len=0),
    lambda: kvm.blocks_for_tokens(10, 0),
    lambda: kvm.fragmentation([10, 20], 16, reserve_len=15),
    lambda: kvm.weight_bytes(float("nan")),
])
def test_rejects_bad_inputs(call):
    with pytest.raises(ValueError):
        call()


def test_paged_waste_is_under_one_block_per_sequence():
    import random

    rng = random.Random(0)
    for bs in (1, 4, 16, 64):
        lens = [rng.randint(1, 500) for _ in range(50)]
        f = kvm.fragmentation(lens, bs)
        assert 0 <= f["paged_tokens"] - f["used_tokens"] < len(lens) * bs
        assert all(kvm.blocks_for_tokens(n, bs) * bs - n < bs for n in lens)
        assert f["reserved_tokens"] - f["used_tokens"] == sum(max(lens) - n for n in lens)
