"""A Llama-style decoder: RoPE, RMSNorm, SwiGLU and grouped-query attention, with optional qkv bias (Qwen2).

The book's GPT (mlsys.model) is GPT-2-shaped; the checkpoints people serve at work are not. This module is the
other family, written for one device like the GPT and with the same calling convention, so that
`mlsys.model.generate` and the tests drive both alike:

    cache = model.new_kv_cache(batch_size=B, max_len=T0 + n)   # KV heads only: GQA's saving
    logits, _ = model(prompt, kv_cache=cache)                  # prefill: (B, T0, V)
    logits, _ = model(next_ids, kv_cache=cache, start_pos=T0)  # decode:  (B, 1, V)

What differs from GPT-2, block by block:

    GPT-2                                   Llama / Qwen2
    learned position table (wpe)            rotary embedding of q and k by position (no table)
    LayerNorm (mean and variance, bias)     RMSNorm (root mean square only, no bias)
    fused c_attn, H heads for q, k and v    q_proj (H heads), k_proj and v_proj (H_kv <= H heads each)
    GELU MLP, 4C wide                       SwiGLU: down(silu(gate(x)) * up(x)), intermediate_size wide
    head tied to the embedding              tied or not (tie_word_embeddings)

Parameter names are those of Hugging Face's LlamaForCausalLM and Qwen2ForCausalLM, so a checkpoint's state dict
loads as it is (mlsys.checkpoint reads the folder). Grouped-query attention: each of the H_kv key/value heads
serves H / H_kv query heads, so the KV cache holds H_kv heads per layer, not H.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from mlsys.model import KVCache, causal_attention


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int | None = None  # hidden_size // num_attention_heads unless given
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None (plain RoPE) or Llama 3's {"rope_type": "llama3", ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: q, k, v have biases, o does not
    o_bias: bool = False  # Llama's attention_bias puts a bias on all four projections
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                                 f"num_attention_heads={self.num_attention_heads}")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def block_size(self) -> int:  # the name mlsys.model.generate reads
        return self.max_position_embeddings

    @property
    def n_layer(self) -> int:
        return self.num_hidden_layers

    @property
    def n_head(self) -> int:
        return self.num_attention_heads

    @property
    def n_kv_head(self) -> int:
        return self.num_key_value_heads


def rope_frequencies(config: LlamaConfig) -> torch.Tensor:
    """(head_dim / 2,) angular frequency of each pair of dimensions: theta^(-2i / head_dim), and with Llama 3's
    scaling, long wavelengths slowed down by `factor` (smoothly between the low and high frequency bounds)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2).float() / d))  # fp32, as the reference
    s = config.rope_scaling
    if s is None or s.get("rope_type", s.get("type")) == "default":
        return inv_freq
    if s.get("rope_type", s.get("type")) != "llama3":
        raise ValueError(f"rope scaling {s!r} is not supported (plain RoPE or rope_type 'llama3')")
    factor, low, high, old = (s["factor"], s["low_freq_factor"], s["high_freq_factor"],
                              s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old / wavelen - low) / (high - low)).clamp(0, 1)  # 0: long wavelengths, 1: short ones
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return scaled


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., T, D) by each position's angles. Dimension i is paired with i + D/2 (the half-split
    layout Hugging Face's Llama uses, not adjacent pairs); cos, sin are (T, D) with each angle twice."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # the mean square in fp32 even for bf16 weights, as the reference does
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.head_dim = c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.o_bias)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (..., T, C) -> q (..., T, H, D), k and v (..., T, H_kv, D); q and k rotated to their positions."""
        *lead, T, _ = x.shape
        q = self.q_proj(x).view(*lead, T, -1, self.head_dim)
        k = self.k_proj(x).view(*lead, T, -1, self.head_dim)
        v = self.v_proj(x).view(*lead, T, -1, self.head_dim)
        cos, sin = cos[:, None], sin[:, None]  # (T, 1, D): the same angle for every head
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, kv_cache: KVCache | None = None, start_pos: int = 0) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x, cos, sin))  # (B, H or H_kv, T, D)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v, start_pos)
        group = q.size(1) // k.size(1)  # query heads per KV head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # KV head j serves q heads
        y = causal_attention(q, k, v)  # j*group .. (j+1)*group-1
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, kv_cache=None, start_pos: int = 0) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, start_pos)
        return x + self.mlp(self.post_attention_layernorm(x))

    # The serving seams, as mlsys.model.Block's: the engine's runner attends over its paged cache in between.
    def attention_qkv(self, x: torch.Tensor, pos: tuple[torch.Tensor, torch.Tensor]):
        """x (N, C) -> q (N, H, D), k and v (N, H_kv, D), rotated to the rows' positions (pos = cos, sin)."""
        return self.self_attn.qkv(self.input_layernorm(x), *pos)

    def attention_out(self, y: torch.Tensor) -> torch.Tensor:
        return self.self_attn.o_proj(y)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Llama(nn.Module):
    """LlamaForCausalLM / Qwen2ForCausalLM on one device: `model.*` is the backbone, `lm_head` the head."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_frequencies(config), persistent=False)
        for module in self.modules():  # random init (tests); checkpoints overwrite it
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin (T, head_dim), in the activations' dtype."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # (T, D/2)
        angles = torch.cat([angles, angles], dim=-1)  # (T, D): dimension i and i + D/2 share an angle
        dtype = self.model.embed_tokens.weight.dtype
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, ids: torch.Tensor, positions: torch.Tensor):
        """Packed ids and positions (N,) -> rows (N, C) and the rotary angles (cos, sin) of those positions."""
        return self.model.embed_tokens(ids), self.rope(positions)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(x))

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> list[KVCache]:
        """One empty cache per layer with num_key_value_heads heads: H_kv / H of an MHA cache."""
        c, p = self.config, self.model.embed_tokens.weight
        return [KVCache(batch_size, c.num_key_value_heads, max_len or c.max_position_embeddings, c.head_dim,
                        p.device, p.dtype) for _ in range(c.num_hidden_layers)]

    def forward(self, idx, targets=None, kv_cache: list[KVCache] | None = None, start_pos: int = 0):
        """idx (B, T) at positions start_pos.. -> (logits (B, T, V), loss or None), as mlsys.model.GPT."""
        B, T = idx.shape
        if start_pos + T > self.config.max_position_embeddings:
            raise ValueError(f"positions up to {start_pos + T} exceed max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        cos, sin = self.rope(torch.arange(start_pos, start_pos + T, device=idx.device))
        x = self.model.embed_tokens(idx)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, None if kv_cache is None else kv_cache[i], start_pos)
        logits = self.lm_head(self.model.norm(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss
