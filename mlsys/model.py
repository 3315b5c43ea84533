"""A small GPT-2-shaped decoder for one device, with a contiguous KV cache.

The model Parts II-IV shard, serve and fine-tune; written for one device, so
that parallelism is applied to it from outside. Names and layouts match Hugging
Face `GPT2LMHeadModel` one to one (learned positions, pre-LayerNorm, fused qkv,
tanh GELU, final LayerNorm, head tied to the token embedding, biases), so the
tests can use transformers as the oracle. Decoding, in vLLM's words:

    cache = model.new_kv_cache(batch_size=B, max_len=T0 + n)   # one KVCache per layer
    logits, _ = model(prompt, kv_cache=cache)                  # prefill: (B, T0, V)
    logits, _ = model(next_ids, kv_cache=cache, start_pos=T0)  # decode:  (B, 1, V)

Attention reaches the cache only through `update(k, v, start_pos)`, so the
paged cache of a later chapter can stand in without touching the blocks.

    python -m mlsys.model     # the presets and their parameter counts (< 1 s)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from mlsys.data import Tokenizer

PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=32, block_size=64),  # tests
    "small": dict(n_layer=4, n_head=4, n_embd=128, block_size=256),  # the target model
    "draft": dict(n_layer=2, n_head=2, n_embd=64, block_size=256),  # speculative decoding
}


@dataclass
class GPTConfig:
    vocab_size: int = field(default_factory=lambda: Tokenizer().vocab_size)
    block_size: int = 256  # max sequence length (rows of the position table)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # GPT-2 has biases in every Linear and LayerNorm

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_kv_head(self) -> int:  # key/value heads: as many as query heads (mlsys.llama has fewer with GQA)
        return self.n_head

    @classmethod
    def preset(cls, name: str, vocab_size: int | None = None, **overrides) -> GPTConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        if vocab_size is not None:
            overrides["vocab_size"] = vocab_size
        return cls(**{**PRESETS[name], **overrides})


class KVCache:
    """Keys and values of ONE layer, preallocated: k, v are (B, n_head, max_len, head_dim)."""

    def __init__(self, batch_size, n_head, max_len, head_dim, device=None, dtype=torch.float32):
        shape = (batch_size, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def max_len(self) -> int:
        return self.k.size(2)

    def update(self, k, v, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H, T, D) at positions start_pos..start_pos+T-1; return all
        positions so far, 0..start_pos+T-1, as (B, H, start_pos+T, D) views."""
        end = start_pos + k.size(2)
        if end > self.max_len:
            raise ValueError(f"cache holds {self.max_len} positions, asked to write up to {end}")
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


def causal_attention(q, k, v, dropout_p: float = 0.0) -> torch.Tensor:
    """q (B, H, Tq, D) holds the LAST Tq of the Tk positions in k, v (B, H, Tk, D).

    Query i sits at absolute position Tk - Tq + i and sees keys 0..that position.
    Returns (B, H, Tq, D).
    """
    Tq, Tk = q.size(2), k.size(2)
    if Tq == Tk:  # no cached prefix: is_causal lets the fused kernel skip masked tiles
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim, self.dropout = config.n_head, config.head_dim, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # fused q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.core = causal_attention  # softmax(q k^T) v; chapter 5 swaps in a recomputed (checkpointed) version

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # the head count follows from the width: fewer heads on a tensor-parallel rank
        return x.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)

    def forward(self, x, kv_cache: KVCache | None = None, start_pos: int = 0) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=2)  # 3 x (B, T, C)
        q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)  # (B, H, T, D)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v, start_pos)  # (B, H, start_pos + T, D)
        y = self.core(q, k, v, self.dropout if self.training else 0.0)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, -1)  # heads side by side again: (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # tanh GELU is GPT-2's "gelu_new"; the exact erf form differs by ~1e-3
        h = F.gelu(self.c_fc(x), approximate="tanh")  # (B, T, 4C)
        return self.dropout(self.c_proj(h))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm: normalise the input of each sublayer, add to the residual stream."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache: KVCache | None = None, start_pos: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, start_pos)
        return x + self.mlp(self.ln_2(x))

    # The serving seams: the engine's runner computes attention itself, over its paged cache, on packed (N, C)
    # rows; these give it the block's own pieces around that attention (mlsys.llama has the same three).
    def attention_qkv(self, x: torch.Tensor, pos=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, C) residual rows -> q, k, v (N, H, D) each: the input norm and the projections."""
        q, k, v = self.attn.c_attn(self.ln_1(x)).chunk(3, dim=-1)
        return tuple(t.unflatten(-1, (-1, self.attn.head_dim)) for t in (q, k, v))

    def attention_out(self, y: torch.Tensor) -> torch.Tensor:
        """Attention output (N, H * D) -> (N, C): the output projection."""
        return self.attn.c_proj(y)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, C) residual rows -> the MLP's contribution (N, C), norm included."""
        return self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one (V, C) matrix reads and writes tokens
        self.apply(self._init_weights)
        for block in self.h:  # GPT-2 scales residual-output weights by 1/sqrt(2 * n_layer)
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.h

    # The two ends of the model, used by forward, the serving engine, the pipeline stages and the RLHF trunk.
    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Token ids (N,) or (B, T) and their positions (N,) or (T,) -> residual rows (..., C), and what
        attention needs to know of the positions besides (nothing: GPT-2's positions are in the rows already)."""
        return self.wte(ids) + self.wpe(positions), None

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Residual rows (..., C) -> logits (..., V): the final norm and the head."""
        return self.lm_head(self.ln_f(x))

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> list[KVCache]:
        """One empty `KVCache` per layer, on the model's device and dtype."""
        c, p = self.config, self.wte.weight
        max_len = max_len or c.block_size
        return [KVCache(batch_size, c.n_head, max_len, c.head_dim, p.device, p.dtype) for _ in self.h]

    def forward(self, idx, targets=None, kv_cache: list[KVCache] | None = None, start_pos: int = 0):
        """idx (B, T) token ids at positions start_pos..start_pos+T-1.

        Returns (logits (B, T, V), loss or None). With `kv_cache`, earlier
        positions are read from the cache and this call's k, v are written to it.
        """
        B, T = idx.shape
        if start_pos + T > self.config.block_size:
            raise ValueError(f"positions up to {start_pos + T} exceed block_size={self.config.block_size}")
        pos = torch.arange(start_pos, start_pos + T, device=idx.device)  # (T,)
        x = self.drop(self.embed(idx, pos)[0])  # (B, T, C): token + position embeddings, (T, C) broadcast
        for i, block in enumerate(self.h):
            x = block(x, None if kv_cache is None else kv_cache[i], start_pos)
        logits = self.head(x)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # over B*T tokens
        return logits, loss


def num_params(model: nn.Module, non_embedding: bool = False) -> int:
    """Parameter count; the tied head is counted once (parameters() deduplicates)."""
    n = sum(p.numel() for p in model.parameters())
    return n - model.wpe.weight.numel() if non_embedding else n


# ------------------------------------------------------------- generation


def filter_logits(logits, temperature: float, top_k: int | None = None, top_p: float | None = None):
    """The logits (B, V) a sampler draws from: divided by the temperature, then everything outside the top k
    and outside the nucleus (the fewest most likely tokens whose probability reaches top_p) set to -inf."""
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = F.softmax(ordered, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
        remove = before >= top_p  # (a top_p below float32's range rounds to 0 here and would remove them all)
        remove[..., 0] = False  # the most likely token always stays
        ordered = ordered.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    return logits


def sample_next(logits, temperature: float = 0.0, top_k: int | None = None, generator=None,
                top_p: float | None = None):
    """logits (B, V) -> next ids (B,). temperature 0 means greedy (argmax)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = F.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


@torch.no_grad()
def generate(
    model: GPT, idx, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
    generator: torch.Generator | None = None, use_cache: bool = True, eos_id: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Extend the prompt idx (B, T0) by up to max_new_tokens -> (B, T0 + n). A row that
    emitted eos_id repeats it; all rows done ends the loop. Dropout on? Call model.eval()."""
    B, T0 = idx.shape
    if T0 + max_new_tokens > model.config.block_size:
        raise ValueError(f"{T0} + {max_new_tokens} tokens exceed block_size={model.config.block_size}")
    cache = model.new_kv_cache(B, T0 + max_new_tokens) if use_cache else None
    done = torch.zeros(B, dtype=torch.bool, device=idx.device)
    logits, _ = model(idx, kv_cache=cache)  # prefill: (B, T0, V)
    for _ in range(max_new_tokens):
        next_id = sample_next(logits[:, -1], temperature, top_k, generator, top_p)  # (B,)
        if eos_id is not None:
            next_id = next_id.masked_fill(done, eos_id)
            done |= next_id == eos_id
        idx = torch.cat([idx, next_id[:, None]], dim=1)  # (B, T + 1)
        if idx.size(1) == T0 + max_new_tokens or bool(done.all()):
            break
        if use_cache:  # decode: feed one token, the cache supplies the rest
            logits, _ = model(next_id[:, None], kv_cache=cache, start_pos=idx.size(1) - 1)
        else:  # recompute the whole prefix: the reference the cache must match
            logits, _ = model(idx)
    return idx


# ------------------------------------------------------ Hugging Face mapping

# HF GPT-2 stores these as Conv1D, weight (in, out): the transpose of nn.Linear's (out, in).
_CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_config(config: GPTConfig):
    from transformers import GPT2Config  # lazy: transformers is a test-only dependency

    if not config.bias:
        raise ValueError("HF GPT-2 always has biases; use bias=True to map onto it")
    c, tok, p = config, Tokenizer(), config.dropout
    return GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
        n_head=c.n_head, n_inner=4 * c.n_embd, activation_function="gelu_new", layer_norm_epsilon=1e-5,
        resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, tie_word_embeddings=True,
        bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
    )


def to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our state dict under `GPT2LMHeadModel`'s names and layouts."""
    sd = {}
    for name, t in model.state_dict().items():
        t = t.t() if name.endswith(_CONV1D_SUFFIXES) else t
        sd[name if name == "lm_head.weight" else "transformer." + name] = t.detach().clone().contiguous()
    return sd


def from_hf_state_dict(config: GPTConfig, sd: dict[str, torch.Tensor]) -> GPT:
    """Build our GPT from a `GPT2LMHeadModel` state dict (the inverse of the above)."""
    ours = {}
    for hf_name, t in sd.items():
        name = hf_name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers kept by older transformers versions
        ours[name] = t.t() if name.endswith(_CONV1D_SUFFIXES) else t
    ours.setdefault("lm_head.weight", ours["wte.weight"])  # tied: often saved once
    model = GPT(config)
    model.load_state_dict(ours)
    return model


def to_hf_model(model: GPT):
    """A `transformers.GPT2LMHeadModel` holding a copy of our weights, in eval mode."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel(hf_config(model.config))
    hf.load_state_dict(to_hf_state_dict(model))
    return hf.eval()


if __name__ == "__main__":
    for name in PRESETS:
        cfg = GPTConfig.preset(name)
        print(f"{name:6s} {num_params(GPT(cfg)):>9,d} params  {asdict(cfg)}")
