"""KV-cache calculator: bytes per token and per request, and how many sequences fit on a GPU after the weights.

What it shows
    1. For each published model shape (mlsys.kv_memory.MODEL_SHAPES, numbers from each model's config.json):
       bytes per token = 2 * layers * kv_heads * head_dim * dtype_bytes, beside what full multi-head attention
       (one KV head per query head) would cost. Grouped-query attention is where the 4x comes from.
       gqa_heads.png draws two of the shapes, Llama-2-7B (MHA) and Llama-3-8B (GQA): the K/V head each query
       head reads, and what one layer's cache row holds for one token.
    2. Per request: a prompt of --prompt-len tokens plus --max-new-tokens generated tokens.
    3. Capacity on --gpu (or --gpu-mem-gib): budget = memory * (1 - reserve) - weights; how many tokens, and how
       many requests of that length, fit in blocks of --block-size tokens. Weights that do not fit give 0.
    4. A self-check against real tensors: the engine's KV pool for the mlsys `small` model (fp32) is allocated and
       its bytes divided by its token slots must equal the formula.

How to run
    python tutorial/part3-inference/chapter09-kv-cache/scripts/kv_calculator.py
    python tutorial/part3-inference/chapter09-kv-cache/scripts/kv_calculator.py --model llama-3-70b --gpu h200 \\
        --prompt-len 4000 --max-new-tokens 1000

    python -c "from transformers import LlamaConfig; LlamaConfig(hidden_size=4096, intermediate_size=14336, \\
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256\\
        ).save_pretrained('/tmp/llama3-8b')"
    python tutorial/part3-inference/chapter09-kv-cache/scripts/kv_calculator.py --config /tmp/llama3-8b/config.json

Runtime on 2 idle cores: about 2 s (importing torch dominates), the same with --smoke
(several times that on a busy machine).

Try next
    python tutorial/part3-inference/chapter09-kv-cache/scripts/kv_calculator.py --config /tmp/llama3-8b/config.json
        -> a model from its config.json: the one the `python -c` line under "How to run" writes has
           Llama-3-8B's shape and gives the built-in llama-3-8b row; pass your own model's config.json (from its
           Hugging Face page; Llama- or Mistral-style decoders) the same way
    python tutorial/part3-inference/chapter09-kv-cache/scripts/kv_calculator.py --dtype fp8
        -> an 8-bit cache and 8-bit weights: half the KiB per token, MiB per request and weight GiB; the budget
           left after the weights grows, so more than twice the requests fit, and Llama-3-70B now fits on one GPU
    python tutorial/part3-inference/chapter09-kv-cache/scripts/kv_calculator.py --model llama-3-8b --kv-heads 1
        -> a multi-query variant: 8x less cache per token than Llama-3-8B's 8 KV heads, 8x the requests
    python tutorial/part3-inference/chapter09-kv-cache/scripts/kv_calculator.py --prompt-len 32000 --max-new-tokens 1000
        -> long-context requests: the requests that fit fall to a handful per GPU
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from mlsys import cli, plot, report
from mlsys import kv_memory as kvm


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    model: str = "all"
    """A name from mlsys.kv_memory.MODEL_SHAPES, or 'all'."""
    dtype: str = "bf16"
    """KV-cache and weight dtype: fp32, bf16, fp16, fp8, int8 or int4."""
    gpu: str = "h100-80gb"
    """GPU preset (nominal GiB): l4, rtx4090, a100-40gb, a100-80gb, h100-80gb, h200."""
    gpu_mem_gib: float = 0.0
    """GPU memory in GiB; overrides --gpu when > 0."""
    reserve_fraction: float = 0.1
    """Fraction of GPU memory kept back for activations, the CUDA context and fragmentation (0 <= f < 1)."""
    prompt_len: int = 1024
    """Prompt tokens per request."""
    max_new_tokens: int = 1024
    """Generated tokens per request."""
    block_size: int = 16
    """Tokens per KV block: capacity is counted in whole blocks."""
    kv_heads: int = 0
    """Override the number of KV heads (e.g. 1 for a multi-query variant); 0 keeps the model's."""
    config: str = ""
    """Path to a Hugging Face config.json of a Llama-style model (your own): its row replaces --model."""

    def validate(self) -> None:
        if self.model != "all" and self.model not in kvm.MODEL_SHAPES:
            raise cli.UsageError(f"--model must be 'all' or one of {sorted(kvm.MODEL_SHAPES)}, got {self.model!r}")
        if self.dtype not in kvm.DTYPE_BYTES:
            raise cli.UsageError(f"--dtype must be one of {sorted(kvm.DTYPE_BYTES)}, got {self.dtype!r}")
        if self.gpu not in kvm.GPU_MEMORY_GIB:
            raise cli.UsageError(f"--gpu must be one of {sorted(kvm.GPU_MEMORY_GIB)}, got {self.gpu!r}")
        if not self.gpu_mem_gib >= 0 or self.gpu_mem_gib == float("inf"):
            raise cli.UsageError(f"--gpu-mem-gib must be a finite number >= 0, got {self.gpu_mem_gib}")
        if not 0 <= self.reserve_fraction < 1:
            raise cli.UsageError(f"--reserve-fraction must be in [0, 1), got {self.reserve_fraction}")
        if self.prompt_len < 1 or self.max_new_tokens < 0:
            raise cli.UsageError("--prompt-len must be >= 1 and --max-new-tokens >= 0")
        if self.block_size < 1 or self.kv_heads < 0:
            raise cli.UsageError("--block-size must be >= 1 and --kv-heads >= 0")
        if self.config:
            shape_from_hf_config(self.config)  # raises UsageError with the reason


def shape_from_hf_config(path: str) -> kvm.ModelShape:
    """A ModelShape from a Hugging Face config.json (Llama, Mistral and similar decoders). The KV
    shape is exact; the parameter count is rebuilt from the shape (kvm.llama_num_params: untied embeddings, gated
    MLP, no biases), so for other layouts (tied embeddings, biases) the weights are approximate."""
    try:
        with open(path) as f:
            c = json.load(f)
        heads = int(c["num_attention_heads"])
        shape = kvm.ModelShape(
            name=str(c.get("_name_or_path") or c.get("model_type") or "config"), num_layers=int(c["num_hidden_layers"]),
            hidden_size=int(c["hidden_size"]), num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
            intermediate_size=int(c["intermediate_size"]), vocab_size=int(c["vocab_size"]),
            num_params=0, source=path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise cli.UsageError(f"--config {path}: cannot read a Llama-style config.json ({err!r})") from None
    return dataclasses.replace(shape, num_params=kvm.llama_num_params(shape))


FIGURE_MODELS = ("llama-2-7b", "llama-3-8b")  # the same 32 query heads, with 32 K/V heads (MHA) and with 8 (GQA)


def head_groups(shape: kvm.ModelShape, dtype: str) -> dict:
    """The K/V head each query head reads (q -> q // group, heads in order), and one layer's cache row per token."""
    group, row = shape.num_heads // shape.num_kv_heads, 2 * shape.num_kv_heads * shape.head_dim  # K and V
    nbytes = row * kvm.DTYPE_BYTES[dtype]
    return {"model": shape.name, "heads": shape.num_heads, "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
            "layers": shape.num_layers, "query_to_kv": [q // group for q in range(shape.num_heads)],
            "row_numbers": row, "row_bytes": nbytes, "token_kib": nbytes * shape.num_layers / kvm.KIB}


def draw_gqa(pictures: list[dict], args: Settings) -> None:
    """Per model: query heads (top) joined to the K/V head they read, and one layer's cache row for one token."""
    plt = plot.pyplot()
    fig, axes = plt.subplots(len(pictures), 1, figsize=(10, 2.3 * len(pictures)))
    for ax, p in zip(axes, pictures):
        h, kv, colour = p["heads"], p["kv_heads"], lambda k: plt.cm.tab10(k % 10)
        qx, kx = [(q + 0.5) * 32 / h for q in range(h)], [(k + 0.5) * 32 / kv for k in range(kv)]
        for q, k in enumerate(p["query_to_kv"]):
            ax.plot([qx[q], kx[k]], [2, 1.1], color=colour(k), lw=0.8)
        ax.scatter(qx, [2] * h, marker="s", s=45, color=[colour(k) for k in p["query_to_kv"]])
        ax.scatter(kx, [1.1] * kv, marker="s", s=45, color=[colour(k) for k in range(kv)], edgecolors="k")
        for i in range(2 * kv):  # the row: K of every K/V head, then V of every K/V head
            ax.add_patch(plt.Rectangle((i * 16 / kv, 0), 16 / kv, 0.45, fc=colour(i % kv), ec="0.3", alpha=0.6))
        for x, name in ((8, "K"), (24, "V")):
            ax.text(x, 0.22, f"{name}: {kv} heads x {p['head_dim']}", ha="center", va="center", fontsize=8,
                    bbox={"fc": "white", "ec": "none", "pad": 1})
        for y, label in ((2, "query heads"), (1.1, "K/V heads"), (0.22, "cache row")):
            ax.text(-0.5, y, label, ha="right", va="center", fontsize=8)
        ax.set_title(f"{p['model']}: {h} query heads read {kv} K/V heads ({h // kv} per K/V head); one layer's row: "
                     f"{p['row_numbers']} numbers = {p['row_bytes']:g} B in {args.dtype}; x {p['layers']} layers = "
                     f"{p['token_kib']:g} KiB per token", fontsize=9, loc="left")
        ax.set(xlim=(-5, 32.5), ylim=(-0.1, 2.3))
        ax.axis("off")
    fig.tight_layout()
    print(f"\nfigure: {plot.save(fig, args, 'gqa_heads')}")


# --8<-- [start:row]
def model_row(shape: kvm.ModelShape, args: Settings, gpu_bytes: float) -> dict:
    """One model's KV arithmetic on one GPU (sizes in MiB/GiB for printing, bytes in the JSON)."""
    kv_heads = args.kv_heads or shape.num_kv_heads
    per_token = kvm.kv_bytes_per_token(shape.num_layers, kv_heads, shape.head_dim, args.dtype)
    mha_per_token = kvm.shape_kv_bytes_per_token(shape, args.dtype, mha=True)
    seq_len = args.prompt_len + args.max_new_tokens
    per_request = kvm.kv_bytes_per_request(per_token, args.prompt_len, args.max_new_tokens)
    weights = kvm.weight_bytes(shape.num_params, args.dtype)
    cap = kvm.kv_capacity(gpu_bytes, weights, per_token, args.reserve_fraction, seq_len, args.block_size)
    return {
        "model": shape.name, "attn": f"{shape.num_heads}q/{kv_heads}kv",
        "KiB/token": per_token / kvm.KIB, "KiB/token MHA": mha_per_token / kvm.KIB,
        "MiB/request": per_request / kvm.MIB, "weights GiB": weights / kvm.GIB,
        "KV budget GiB": cap["kv_budget_bytes"] / kvm.GIB, "max tokens": cap["max_tokens"],
        "max requests": cap["max_sequences"],
        "_bytes": {"per_token": per_token, "per_token_mha": mha_per_token, "per_request": per_request,
                   "weights": weights, "kv_budget": cap["kv_budget_bytes"], "seq_len": seq_len,
                   "num_blocks": cap["num_blocks"], "block_mib": per_token * args.block_size / kvm.MIB,
                   "blocks_per_request": kvm.blocks_for_tokens(seq_len, args.block_size)},
    }
# --8<-- [end:row]


# --8<-- [start:selfcheck]
def check_against_real_pool(block_size: int = 16, num_blocks: int = 8) -> dict:
    """Allocate the engine's KV pool for the real `small` GPT and compare its size with the formula."""
    from mlsys.engine import ModelRunner
    from mlsys.model import GPT, GPTConfig

    model = GPT(GPTConfig.preset("small")).eval()
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size)  # real zeros, fp32
    measured = runner.kv_cache_bytes / (num_blocks * block_size)  # bytes per token slot
    shape = kvm.MODEL_SHAPES["mlsys-small"]
    formula = kvm.shape_kv_bytes_per_token(shape, "fp32")
    report.expect_equal("engine KV pool bytes per token vs formula", measured, formula)
    return {"pool_bytes": runner.kv_cache_bytes, "bytes_per_token_measured": measured, "formula": formula}
# --8<-- [end:selfcheck]


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={})
    gpu_gib = args.gpu_mem_gib or kvm.GPU_MEMORY_GIB[args.gpu]
    gpu_name = f"{gpu_gib:g} GiB" if args.gpu_mem_gib else f"{args.gpu} ({gpu_gib:g} GiB nominal)"
    shapes = dict(kvm.MODEL_SHAPES)
    if args.config:
        own = shape_from_hf_config(args.config)
        shapes[own.name] = own
        print(f"{args.config}: {own.num_layers} layers, {own.num_heads} query / {own.num_kv_heads} KV heads of "
              f"{own.head_dim}, about {own.num_params / 1e9:.2f} B parameters (rebuilt from the shape)")
    names = [own.name] if args.config else list(kvm.MODEL_SHAPES) if args.model == "all" else [args.model]
    rows = [model_row(shapes[n], args, gpu_gib * kvm.GIB) for n in names]
    print(f"KV cache in {args.dtype} on {gpu_name}, {args.reserve_fraction:.0%} reserved, requests of "
          f"{args.prompt_len} + {args.max_new_tokens} tokens, blocks of {args.block_size}\n")
    print(report.table([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows], floatfmt=".4g"))
    for r in rows:
        if r["KV budget GiB"] == 0:
            print(f"\n{r['model']}: the weights ({r['weights GiB']:.1f} GiB) do not fit in "
                  f"{gpu_gib * (1 - args.reserve_fraction):.1f} GiB: no room for any KV cache "
                  "(shard it over more GPUs, chapter 6, or quantize the weights).")
    for s in (shapes[n] for n in names):
        if s.num_kv_heads != s.num_heads and not args.kv_heads:
            print(f"\n{s.name}: GQA, {s.num_heads // s.num_kv_heads} query heads share each KV head, so its cache "
                  f"is {s.num_heads // s.num_kv_heads}x smaller than the same model with full multi-head attention.")
            break
    pictures = [head_groups(kvm.MODEL_SHAPES[n], args.dtype) for n in FIGURE_MODELS]
    draw_gqa(pictures, args)
    real = check_against_real_pool()
    print(f"\nself-check: the engine's KV pool for mlsys-small (fp32, whatever --dtype says) holds "
          f"{real['pool_bytes']} bytes for "
          f"{8 * 16} token slots = {real['bytes_per_token_measured']:.0f} B/token = formula "
          f"2 * 4 layers * 4 heads * 32 dims * 4 B = {real['formula']} B  OK")
    if args.json:
        results = {"models": {r["model"]: {**{k: v for k, v in r.items() if not k.startswith("_")}, **r["_bytes"]}
                              for r in rows},
                   "gqa_picture": pictures, "gpu_gib": gpu_gib, "usable_gib": gpu_gib * (1 - args.reserve_fraction),
                   "self_check": real}
        report.write_json(args.json, results, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
