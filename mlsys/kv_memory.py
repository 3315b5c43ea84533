"""KV-cache memory arithmetic for serving (chapter 9; the ch07 planner reuses the shapes).

Every decoder layer stores one key and one value vector per KV head for every token it has seen, so

    bytes per token = 2 (K and V) * num_layers * num_kv_heads * head_dim * dtype_bytes

With grouped-query attention ("GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
Checkpoints", https://arxiv.org/abs/2305.13245) several query heads share one KV head, so `num_kv_heads` is the
number that counts, not `num_heads` (Llama-3-8B: 32 query heads, 8 KV heads -> 4x less cache than full MHA).

    python -m mlsys.kv_memory     # the published shapes and their bytes per token (< 1 s)

All functions validate their inputs (ValueError) and never divide by zero: a budget that the weights already
exhaust gives a capacity of 0 tokens, not a negative or infinite one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlsys.model import GPTConfig

KIB, MIB, GIB = 1024, 1024**2, 1024**3

DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}

# Nominal memory of common accelerators in GiB (the driver and CUDA context keep a few hundred MiB of it).
GPU_MEMORY_GIB: dict[str, float] = {
    "l4": 24, "rtx4090": 24, "a100-40gb": 40, "a100-80gb": 80, "h100-80gb": 80, "h200": 141,
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads: == num_heads for MHA, 1 for MQA, in between for GQA
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: int  # published total (embeddings included)
    source: str  # URL of the config.json or paper the numbers come from

    @property
    def attention(self) -> str:
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"


def gpt_num_params(c: GPTConfig) -> int:
    """Parameters of mlsys.model.GPT (GPT-2 layout, lm_head tied to wte), from the config alone."""
    C, b = c.n_embd, int(c.bias)
    ln = C + b * C
    block = ln + (3 * C * C + b * 3 * C) + (C * C + b * C) + ln + (4 * C * C + b * 4 * C) + (4 * C * C + b * C)
    return c.vocab_size * C + c.block_size * C + c.n_layer * block + ln


def llama_num_params(s: ModelShape) -> int:
    """Parameters of a Llama/Mistral-style decoder from its shape: untied embedding and lm_head, q/k/v/o without
    bias (k and v are num_kv_heads * head_dim wide), a gated MLP of three matrices, two RMSNorms per layer + 1."""
    kv = s.num_kv_heads * s.head_dim
    attn = s.hidden_size * (s.num_heads * s.head_dim) * 2 + s.hidden_size * kv * 2
    layer = attn + 3 * s.hidden_size * s.intermediate_size + 2 * s.hidden_size
    return 2 * s.vocab_size * s.hidden_size + s.num_layers * layer + s.hidden_size


def shape_from_gpt_config(name: str, c: GPTConfig) -> ModelShape:
    """The ModelShape of one of this repository's GPT presets (MHA: every head has its own K and V)."""
    return ModelShape(name, c.n_layer, c.n_embd, c.n_head, c.n_head, c.head_dim, 4 * c.n_embd, c.vocab_size,
                      gpt_num_params(c), "mlsys/model.py (PRESETS)")


_HF = "https://huggingface.co/{}/blob/main/config.json"

MODEL_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        # 8,030,261,248 params: 2 x 128256 x 4096 embeddings (untied) + 32 x 218,112,000 per layer + final norm
        ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8_030_261_248,
                   _HF.format("meta-llama/Meta-Llama-3-8B")),
        ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, 70_553_706_496,
                   _HF.format("meta-llama/Meta-Llama-3-70B")),
        ModelShape("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32000, 7_241_732_096,
                   _HF.format("mistralai/Mistral-7B-v0.1")),
        # full multi-head attention, for contrast: 32 KV heads -> 4x the cache of Llama-3-8B per token
        ModelShape("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000, 6_738_415_616,
                   _HF.format("meta-llama/Llama-2-7b-hf")),
        shape_from_gpt_config("mlsys-small", GPTConfig.preset("small")),
    )
}


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _nonneg(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return value


def bytes_per_element(dtype: str | float) -> float:
    """Bytes per element of a dtype name ("bf16", ...) or a positive number passed through."""
    if isinstance(dtype, str):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPE_BYTES)}")
        return DTYPE_BYTES[dtype]
    if _nonneg("dtype_bytes", dtype) == 0:
        raise ValueError("dtype_bytes must be > 0")
    return dtype


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float) -> int:
    """Bytes of K and V that one token occupies across all layers: 2 * layers * kv_heads * head_dim * bytes."""
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        _positive_int(name, v)
    return math.ceil(2 * num_layers * num_kv_heads * head_dim * bytes_per_element(dtype_bytes))


def shape_kv_bytes_per_token(shape: ModelShape, dtype: str | float = "bf16", mha: bool = False) -> int:
    """kv_bytes_per_token for a ModelShape; mha=True pretends every query head had its own KV head."""
    heads = shape.num_heads if mha else shape.num_kv_heads
    return kv_bytes_per_token(shape.num_layers, heads, shape.head_dim, dtype)


def kv_bytes_per_request(bytes_per_token: int, prompt_len: int, max_new_tokens: int = 0) -> int:
    """Bytes one sequence holds at its longest: every prompt and generated token keeps its K and V."""
    _positive_int("bytes_per_token", bytes_per_token)
    _nonneg("prompt_len", prompt_len)
    _nonneg("max_new_tokens", max_new_tokens)
    return int(bytes_per_token * (prompt_len + max_new_tokens))


def weight_bytes(num_params: int, dtype: str | float = "bf16") -> int:
    """Bytes of the weights at `dtype` (no quantization scales, no activations)."""
    _nonneg("num_params", num_params)
    return math.ceil(num_params * bytes_per_element(dtype))


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Fixed-size blocks a sequence of `num_tokens` needs: ceil(num_tokens / block_size)."""
    _nonneg("num_tokens", num_tokens)
    _positive_int("block_size", block_size)
    return -(-int(num_tokens) // block_size)


def kv_capacity(gpu_bytes: float, weight_bytes: float, bytes_per_token: int, reserve_fraction: float = 0.1,
                seq_len: int | None = None, block_size: int = 1) -> dict[str, float]:
    """What fits in the KV cache after the weights on one GPU.

    budget = gpu_bytes * (1 - reserve_fraction) - weight_bytes   (clamped at 0; the reserve covers activations,
    the CUDA context, fragmentation). The budget is cut into blocks of `block_size` tokens; `max_sequences` counts
    sequences of `seq_len` tokens, each needing ceil(seq_len / block_size) whole blocks.
    Returns kv_budget_bytes, num_blocks, max_tokens, max_sequences (None when seq_len is None).
    """
    _nonneg("gpu_bytes", gpu_bytes)
    _nonneg("weight_bytes", weight_bytes)
    _positive_int("bytes_per_token", bytes_per_token)
    _positive_int("block_size", block_size)
    if _nonneg("reserve_fraction", reserve_fraction) >= 1:
        raise ValueError(f"reserve_fraction must be in [0, 1), got {reserve_fraction!r}")
    budget = max(0.0, gpu_bytes * (1 - reserve_fraction) - weight_bytes)
    num_blocks = int(budget // (bytes_per_token * block_size))
    out = {"kv_budget_bytes": budget, "num_blocks": num_blocks, "max_tokens": num_blocks * block_size,
           "max_sequences": None}
    if seq_len is not None:
        out["max_sequences"] = num_blocks // blocks_for_tokens(_positive_int("seq_len", seq_len), block_size)
    return out


def fragmentation(seq_lens: list[int], block_size: int, reserve_len: int | None = None) -> dict[str, float]:
    """Memory held vs memory used (in tokens) for one batch of sequences, paged vs max-length reservation.

    paged: each sequence holds ceil(len / block_size) blocks, so only its last block is partly empty (internal
    fragmentation < block_size tokens per sequence). reserved: each sequence holds `reserve_len` slots (default:
    the longest length) from the start. waste = 1 - used / held (0 for an empty workload).
    """
    _positive_int("block_size", block_size)
    used = sum(int(_nonneg("seq_len", n)) for n in seq_lens)
    reserve_len = max(seq_lens, default=0) if reserve_len is None else reserve_len
    if seq_lens and reserve_len < max(seq_lens):
        raise ValueError(f"reserve_len={reserve_len} is shorter than the longest sequence {max(seq_lens)}")
    paged = sum(blocks_for_tokens(n, block_size) for n in seq_lens) * block_size
    reserved = len(seq_lens) * reserve_len
    return {"used_tokens": used, "paged_tokens": paged, "reserved_tokens": reserved,
            "paged_waste": 1 - used / paged if paged else 0.0,
            "reserved_waste": 1 - used / reserved if reserved else 0.0}


def main() -> None:
    print(f"{'model':<12} {'attn':>4} {'layers':>6} {'kv_heads':>8} {'head_dim':>8} {'KiB/token bf16':>14} "
          f"{'if MHA':>8}  source")
    for s in MODEL_SHAPES.values():
        print(f"{s.name:<12} {s.attention:>4} {s.num_layers:>6} {s.num_kv_heads:>8} {s.head_dim:>8} "
              f"{shape_kv_bytes_per_token(s) / KIB:>14.2f} {shape_kv_bytes_per_token(s, mha=True) / KIB:>8.2f}  "
              f"{s.source}")


if __name__ == "__main__":
    main()
