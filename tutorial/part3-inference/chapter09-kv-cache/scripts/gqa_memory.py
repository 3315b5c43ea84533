"""MHA against GQA in the same KV memory: bytes per token measured on the engine's own pool, and how many requests
that memory keeps running.

What it shows
    Two Llama-style models (mlsys.llama) that differ only in --kv-heads: multi-head attention (every query head
    has its own K and V head) and grouped-query attention (--heads / --kv-heads query heads share one). Their
    weights are random: memory depends on shapes only, and every request runs its full --max-tokens
    (ignore_eos), so both serve exactly the same amount of work.
    1. Each engine gets the same KV budget in bytes (--kv-kib); the engine sizes its pool in whole blocks from
       the model's K/V heads. Bytes per token are read off the pool the engine allocated (its tensors' bytes over
       the token slots they hold) and checked against 2 * layers * kv_heads * head_dim * bytes per element.
    2. The same --num-requests requests, all queued at once, run through both engines: steps taken, sequences
       running per step (mean and most), preemptions.

How to run
    python tutorial/part3-inference/chapter09-kv-cache/scripts/gqa_memory.py
    python tutorial/part3-inference/chapter09-kv-cache/scripts/gqa_memory.py --kv-heads 1 --json out.json

Runtime on 2 idle cores: about 2 s, 2 s with --smoke (several times that on a busy machine).

Try next
    python tutorial/part3-inference/chapter09-kv-cache/scripts/gqa_memory.py --kv-heads 1
        -> multi-query attention: an eighth of the bytes per token, and the budget no longer limits the batch
    python tutorial/part3-inference/chapter09-kv-cache/scripts/gqa_memory.py --kv-kib 8192
        -> a budget large enough for every request with MHA too (16 requests of 64 tokens at 8 KiB per token):
           both run the same batch, and the step counts meet
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlsys import cli, report
from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.engine.tokenizer import TokenIdsOnly
from mlsys.llama import Llama, LlamaConfig


@dataclass
class Settings(cli.Args):
    layers: int = 4
    """Decoder layers of both models."""
    hidden: int = 256
    """Hidden size of both models."""
    heads: int = 8
    """Query heads of both models (head_dim = hidden / heads)."""
    kv_heads: int = 2
    """K/V heads of the GQA model (the MHA model has --heads of them); must divide --heads."""
    kv_kib: int = 1024
    """KV budget of each engine in KiB (float32 K and V of every layer)."""
    block_size: int = 16
    """Tokens per KV block."""
    num_requests: int = 16
    """Requests, all queued at once."""
    prompt_len: int = 32
    """Prompt tokens per request."""
    max_tokens: int = 32
    """Tokens each request generates."""

    def validate(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "kv_kib", "block_size", "num_requests", "prompt_len",
                     "max_tokens"):
            if getattr(self, name) < 1:
                raise cli.UsageError(f"--{name.replace('_', '-')} must be >= 1")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise cli.UsageError(f"--hidden {self.hidden} must split into --heads {self.heads} heads of an even size")
        if self.heads % self.kv_heads:
            raise cli.UsageError(f"--kv-heads {self.kv_heads} must divide --heads {self.heads}")
        if self.prompt_len + self.max_tokens > 512:
            raise cli.UsageError("--prompt-len + --max-tokens must be at most 512")
        mha_bytes = 2 * self.layers * self.hidden * 4  # per token, float32 K and V with every head
        blocks_per_seq = -(-(self.prompt_len + self.max_tokens) // self.block_size)
        need_kib = -(-mha_bytes * self.block_size * blocks_per_seq // 1024)
        if self.kv_kib < need_kib:
            raise cli.UsageError(f"--kv-kib {self.kv_kib} cannot hold one {self.prompt_len + self.max_tokens}-token "
                                 f"sequence of the MHA model: it needs at least {need_kib} KiB")


def build(args: Settings, kv_heads: int) -> Llama:
    torch.manual_seed(args.seed)
    return Llama(LlamaConfig(vocab_size=64, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                             num_hidden_layers=args.layers, num_attention_heads=args.heads,
                             num_key_value_heads=kv_heads, max_position_embeddings=512)).eval()


# --8<-- [start:serve]
def serve(model: Llama, args: Settings) -> dict:
    """Size the pool from the byte budget, run every request, record what ran in each step."""
    c = model.config
    formula = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4  # K and V, float32
    num_blocks = args.kv_kib * 1024 // (formula * args.block_size)
    seq_len = args.prompt_len + args.max_tokens
    engine = Engine(model, TokenIdsOnly(c.vocab_size), EngineConfig(block_size=args.block_size, num_blocks=num_blocks,
                                                            max_num_seqs=args.num_requests, max_model_len=seq_len))
    measured = engine.runner.kv_cache_bytes / (num_blocks * args.block_size)  # the tensors it really allocated
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, 64, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    running = []
    while engine.has_unfinished():
        engine.step()
        running.append(engine.last_step_timing["num_seqs"])
    stats = engine.stats()
    return {"kv_heads": c.num_key_value_heads, "bytes_per_token": measured, "formula_bytes_per_token": formula,
            "num_blocks": num_blocks, "pool_bytes": engine.runner.kv_cache_bytes,
            "full_requests_that_fit": num_blocks // -(-seq_len // args.block_size),
            "steps": stats["num_steps"], "mean_running": sum(running) / len(running), "max_running": max(running),
            "preemptions": stats["num_preemptions"], "generated": stats["num_generated_tokens"]}
# --8<-- [end:serve]


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"layers": 2, "hidden": 128, "kv_kib": 256, "num_requests": 8,
                                                "prompt_len": 16, "max_tokens": 16})
    torch.set_num_threads(1)  # tiny matmuls: one thread is faster than two fighting
    mha_model = build(args, args.heads)
    c = mha_model.config  # the shape both models share, for the lesson's bytes-per-token check
    shape = {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "heads": c.num_attention_heads,
             "head_dim": c.head_dim, "bytes_per_element": next(mha_model.parameters()).element_size()}
    print(f"Both models: {shape['layers']} layers, {shape['heads']} query heads of head_dim {shape['head_dim']} "
          f"(hidden {shape['hidden']}), {shape['bytes_per_element']} bytes per number; K/V heads "
          f"{args.heads} (MHA) and {args.kv_heads} (GQA)\n")
    runs = {"MHA": serve(mha_model, args), "GQA": serve(build(args, args.kv_heads), args)}
    print(report.table([{"model": name, **{k: v for k, v in r.items()}} for name, r in runs.items()]))
    for name, r in runs.items():
        report.expect_equal(f"{name}: bytes per token of the pool = 2 * L * H_kv * D * 4", r["bytes_per_token"],
                            r["formula_bytes_per_token"])
        report.expect_equal(f"{name}: every request ran to its length", r["generated"],
                            args.num_requests * args.max_tokens)
    mha, gqa = runs["MHA"], runs["GQA"]
    results = {"shape": shape, "runs": runs, "bytes_ratio": gqa["bytes_per_token"] / mha["bytes_per_token"],
               "blocks_ratio": gqa["num_blocks"] / mha["num_blocks"],
               "running_ratio": gqa["mean_running"] / mha["mean_running"],
               "steps_ratio": gqa["steps"] / mha["steps"]}
    print(f"\nGQA with {args.kv_heads} of {args.heads} K/V heads: {results['bytes_ratio']:.3g}x the bytes per token, "
          f"{results['blocks_ratio']:.3g}x the blocks in the same {args.kv_kib} KiB, "
          f"{results['running_ratio']:.3g}x the sequences running per step on average, "
          f"{results['steps_ratio']:.3g}x the steps")
    if args.json:
        report.write_json(args.json, results, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
