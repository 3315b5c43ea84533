"""mlsys.kv_memory, the cases tests/test_kv_memory.py leaves open (issue 29: the mutants that survived it).

Expected numbers are counted by hand from what the cache stores (one K and one V vector per layer, KV head and
token); the GPT shape is checked against the weights of a real mlsys.model.GPT, and the error tests check that
each rejected input is named in its message.
"""

from __future__ import annotations

import pytest

from mlsys import kv_memory
from mlsys.model import GPT, GPTConfig

INT_MSG = "must be an integer >= 1"
NONNEG_MSG = "must be a finite number >= 0"


# ----------------------------------------------------------------------------------------------- the validators
@pytest.mark.parametrize("bad", [0, -2, True, 1.0, "3"])
def test_positive_int_rejects_what_is_not_a_positive_int(bad):
    with pytest.raises(ValueError, match=rf"^width {INT_MSG}, got "):
        kv_memory._positive_int("width", bad)


@pytest.mark.parametrize("ok", [1, 2, 9])
def test_positive_int_accepts_positive_ints(ok):
    assert kv_memory._positive_int("width", ok) == ok


@pytest.mark.parametrize("bad", [-1, -0.5, True, "3", float("inf"), float("-inf"), float("nan")])
def test_nonneg_rejects_what_is_not_a_finite_nonnegative_number(bad):
    with pytest.raises(ValueError, match=rf"^count {NONNEG_MSG}, got "):
        kv_memory._nonneg("count", bad)


@pytest.mark.parametrize("ok", [0, 0.0, 0.5, 1, 7])
def test_nonneg_accepts_finite_nonnegative_numbers(ok):
    assert kv_memory._nonneg("count", ok) == ok


def test_bytes_per_element_names_and_numbers():
    assert kv_memory.bytes_per_element("bf16") == 2
    assert kv_memory.bytes_per_element("int4") == 0.5
    assert kv_memory.bytes_per_element(1) == 1  # a number passes through
    assert kv_memory.bytes_per_element(0.25) == 0.25
    with pytest.raises(ValueError, match=r"^unknown dtype 'fp99'; choose from \['bf16', 'fp16', 'fp32', 'fp8', "
                                         r"'int4', 'int8'\]$"):
        kv_memory.bytes_per_element("fp99")
    with pytest.raises(ValueError, match=r"^dtype_bytes must be > 0$"):
        kv_memory.bytes_per_element(0)
    with pytest.raises(ValueError, match=rf"^dtype_bytes {NONNEG_MSG}, got -1$"):
        kv_memory.bytes_per_element(-1)


# ----------------------------------------------------------------------------------------------- bytes per token
def test_kv_bytes_per_token_hand_cases():
    # 3 layers * 5 KV heads * head_dim 7 = 105 values, once for K and once for V, 2 B each: 420
    assert kv_memory.kv_bytes_per_token(3, 5, 7, 2) == 420
    assert kv_memory.kv_bytes_per_token(3, 5, 7, "int4") == 105
    # 6 values at 0.3 B = 1.8 B: a token cannot hold part of a byte, rounded up to 2
    assert kv_memory.kv_bytes_per_token(1, 1, 3, 0.3) == 2


@pytest.mark.parametrize("i, name", list(enumerate(["num_layers", "num_kv_heads", "head_dim"])))
def test_kv_bytes_per_token_names_the_bad_argument(i, name):
    args = [3, 5, 7]
    args[i] = 0
    with pytest.raises(ValueError, match=rf"^{name} {INT_MSG}, got 0$"):
        kv_memory.kv_bytes_per_token(*args, 2)


SHAPE = kv_memory.ModelShape("toy", num_layers=2, hidden_size=32, num_heads=8, num_kv_heads=2, head_dim=4,
                             intermediate_size=64, vocab_size=100, num_params=0, source="test")


def test_shape_kv_bytes_per_token_gqa_mha_and_dtype():
    # GQA: 2 layers * 2 KV heads * 4 dims * (K, V) * bf16 = 64 B; as MHA 8 heads: 256 B; fp32 GQA: 128 B
    assert kv_memory.shape_kv_bytes_per_token(SHAPE) == 64
    assert kv_memory.shape_kv_bytes_per_token(SHAPE, mha=True) == 256
    assert kv_memory.shape_kv_bytes_per_token(SHAPE, "fp32") == 128
    assert kv_memory.shape_kv_bytes_per_token(SHAPE, dtype=1, mha=True) == 128


def test_kv_bytes_per_request_hand_cases():
    assert kv_memory.kv_bytes_per_request(10, 3, 4) == 70  # 3 prompt + 4 generated tokens, 10 B each
    assert kv_memory.kv_bytes_per_request(10, 3) == 30  # nothing generated unless asked
    with pytest.raises(ValueError, match=rf"^bytes_per_token {INT_MSG}"):
        kv_memory.kv_bytes_per_request(0, 3)
    with pytest.raises(ValueError, match=rf"^prompt_len {NONNEG_MSG}"):
        kv_memory.kv_bytes_per_request(10, -1)
    with pytest.raises(ValueError, match=rf"^max_new_tokens {NONNEG_MSG}"):
        kv_memory.kv_bytes_per_request(10, 3, -1)


# ----------------------------------------------------------------------------------------------- fragmentation
def test_fragmentation_names_the_bad_argument():
    with pytest.raises(ValueError, match=rf"^block_size {INT_MSG}, got 0$"):
        kv_memory.fragmentation([3, 5], 0)
    with pytest.raises(ValueError, match=rf"^seq_len {NONNEG_MSG}, got -1$"):
        kv_memory.fragmentation([3, -1], 4)
    with pytest.raises(ValueError, match=r"^reserve_len=4 is shorter than the longest sequence 5$"):
        kv_memory.fragmentation([3, 5], 4, reserve_len=4)


# ----------------------------------------------------------------------------------------------- shapes
def test_shape_from_gpt_config_matches_the_built_model():
    """Every field of the ModelShape against the tensors of a real mlsys.model.GPT built from the same config."""
    cfg = GPTConfig(vocab_size=37, block_size=16, n_layer=3, n_head=2, n_embd=12)
    model = GPT(cfg)
    shape = kv_memory.shape_from_gpt_config("toy-gpt", cfg)
    block = model.h[0]
    assert shape.name == "toy-gpt"
    assert shape.num_layers == len(model.h) == 3
    assert shape.hidden_size == model.wte.weight.shape[1] == 12
    assert shape.num_heads == shape.num_kv_heads == 2  # MHA: the fused qkv holds as many K and V heads as Q heads
    assert shape.num_kv_heads * shape.head_dim == block.attn.c_attn.weight.shape[0] // 3
    assert shape.head_dim == 6
    assert shape.intermediate_size == block.mlp.c_fc.weight.shape[0] == 48
    assert shape.vocab_size == model.wte.weight.shape[0] == 37
    assert shape.num_params == sum(p.numel() for p in model.parameters())  # the tied head counted once
    assert shape.source == "mlsys/model.py (PRESETS)"
    assert shape.attention == "MHA"


def test_main_prints_the_table(capsys):
    kv_memory.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["model", "attn", "layers", "kv_heads", "head_dim", "KiB/token", "bf16", "if",
                                "MHA", "source"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    # Llama-3-8B: 32 layers * 8 KV heads * 128 dims * (K, V) * 2 B = 131072 B = 128 KiB; with 32 KV heads 512 KiB
    assert rows["llama-3-8b"][:7] == ["llama-3-8b", "GQA", "32", "8", "128", "128.00", "512.00"]
    assert rows["llama-3-8b"][7] == "https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json"
    # Llama-2-7B is MHA: 32 KV heads, 512 KiB either way
    assert rows["llama-2-7b"][1:7] == ["MHA", "32", "32", "128", "512.00", "512.00"]
    assert len(rows) == len(kv_memory.MODEL_SHAPES)


# ------------------------------------------------------------------------------- which argument an error names
CAPACITY = dict(gpu_bytes=1000, weight_bytes=100, bytes_per_token=10, reserve_fraction=0.1, seq_len=4, block_size=2)
BAD = {"gpu_bytes": -1, "weight_bytes": -1, "bytes_per_token": 0, "block_size": 0, "reserve_fraction": -0.5,
       "seq_len": 0}


@pytest.mark.parametrize("name", list(BAD))
def test_kv_capacity_names_the_bad_argument(name):
    with pytest.raises(ValueError, match=rf"^{name} must be "):
        kv_memory.kv_capacity(**{**CAPACITY, name: BAD[name]})


def test_a_reserve_of_everything_is_refused_in_words():
    with pytest.raises(ValueError, match=r"^reserve_fraction must be in \[0, 1\), got 1\.0$"):
        kv_memory.kv_capacity(**{**CAPACITY, "reserve_fraction": 1.0})


@pytest.mark.parametrize("name, bad", [("num_tokens", -1), ("block_size", 0)])
def test_blocks_for_tokens_names_the_bad_argument(name, bad):
    args = {"num_tokens": 5, "block_size": 2, name: bad}
    with pytest.raises(ValueError, match=rf"^{name} must be "):
        kv_memory.blocks_for_tokens(**args)


def test_kv_capacity_counts_single_token_blocks_by_default():
    """No block size given: every token its own block. 1000 bytes, no weights, no reserve, 10 bytes a token: 100."""
    out = kv_memory.kv_capacity(1000, 0, 10, reserve_fraction=0.0)
    assert out["num_blocks"] == 100 and out["max_tokens"] == 100


def test_kv_capacity_never_counts_a_block_that_does_not_fit():
    """A budget one representable step below k whole blocks holds k - 1 of them. Floating-point division rounds
    that quotient up to k here (a budget of 5.7e16 bytes, blocks of 414,083); floor division does not."""
    import math

    block, k = 414083, 137438953474
    budget = math.nextafter(float(block * k), 0.0)
    assert budget < block * k
    assert kv_memory.kv_capacity(budget, 0, block, reserve_fraction=0.0)["num_blocks"] == k - 1


def test_weight_bytes_defaults_to_bf16_and_names_a_bad_count():
    """Two bytes a parameter unless told otherwise (the checkpoints' and the planners' dtype)."""
    assert kv_memory.weight_bytes(1000) == 2000
    with pytest.raises(ValueError, match=r"^num_params must be "):
        kv_memory.weight_bytes(-1)
