"""Our engine against Hugging Face transformers: the same tokens, and how fast each produces them.

What it shows
    1. Oracle: a batch of prompts decoded greedily by our engine (paged KV cache, packed batch) gives exactly
       the tokens of transformers' generate running the same weights, token for token, for every prompt.
       <eos> is ignored on both sides so every row runs the full length. Two models (--model):
         gpt    the book's trained GPT, and GPT2LMHeadModel with its weights (mlsys.model.to_hf_model)
         llama  a small Llama-style model with grouped-query attention (8 query heads share 2 K/V heads), RoPE,
                RMSNorm and SwiGLU: transformers' LlamaForCausalLM with random weights (seeded, nothing is
                downloaded), written with save_pretrained into a temporary folder and read back by
                mlsys.checkpoint.load_pretrained for the engine; transformers runs the model it built.
                Random weights write gibberish: the point is that both sides write the same gibberish.
    2. Throughput: output tokens per second on that same batch for
         transformers  generate(use_cache=True), the whole batch at once
         mlsys.model   the book's own generate loop (contiguous KV cache, no scheduler)
         mlsys.engine  Engine.generate (scheduler, paged KV cache, sampling, detokenization every step)
       each the best and the median of --reps rounds after a warm-up round (a round runs all three once, so
       a slow spell of the machine hits all three), with the garbage collector held off, and the ratios
       engine / transformers and engine / mlsys.model, each with a verdict from that pair's own runs: faster or
       slower only when one's median run beat the other's best (the runs do not overlap), "about equal" when
       they overlap and the best runs lie within 10% of each other, "undecided" when they overlap with a
       larger gap (a third implementation's noise does not blur the pair); last, whether the engine's best run
       reached the speed goal of 1x transformers' best (a target for its per-step overhead, not a check: a
       static batch gives the engine's machinery nothing to do, so below 1x means its scheduler, block tables and
       detokenizer cost more per step than transformers' loop on this tiny model). Timings never fail the run;
       a token mismatch does (exit 1).
    Prompts in a batch have equal length, so transformers needs no padding (left-padding changes positions
    and would make the comparison about padding rather than about the engine). They are the starts of records
    of the book's corpus, in the book's tokenizer, for both models (the Llama model has the same 47 ids).

How to run
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/vs_transformers.py
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/vs_transformers.py --model llama
    python .../vs_transformers.py --batch-size 32 --max-tokens 128

Runtime on 2 idle cores: about 8 s for either model, 4 s with --smoke (two or three times that on a busy
machine).

Try next
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/vs_transformers.py --batch-size 1
        -> one sequence: the same tokens; every implementation is now dominated by per-step overhead
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/vs_transformers.py --batch-size 32 --max-tokens 128
        -> a bigger batch and longer answers: the tokens still match, and tokens/s rise for all three
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/vs_transformers.py --model llama --batch-size 1
        -> the Llama model one sequence at a time: every step is mostly fixed per-step work on both sides
"""

from __future__ import annotations

import statistics
import tempfile
import time
import typing
from dataclasses import dataclass

import torch

from mlsys import bench, checkpoint, cli, report
from mlsys.data import Tokenizer, make_corpus
from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.model import generate, to_hf_model
from mlsys.weights import load_pretrained


@dataclass
class Settings(cli.Args):
    model: typing.Literal["gpt", "llama"] = "gpt"
    """gpt: the book's trained GPT vs GPT2LMHeadModel; llama: a random-init Llama-style model with GQA, loaded
    from a checkpoint folder, vs LlamaForCausalLM."""
    batch_size: int = 16
    """Prompts in the batch."""
    prompt_len: int = 16
    """Characters of each prompt (a prefix of a JSON record); every prompt gets <bos> in front."""
    max_tokens: int = 64
    """Tokens generated per prompt."""
    reps: int = 5
    """Timed runs per implementation, after one warm-up; the best and the median are reported."""
    threads: int = 1
    """torch intra-op threads for all three (1: the tiny model's matrices are too small to split)."""

    def validate(self) -> None:
        if min(self.batch_size, self.prompt_len, self.max_tokens, self.reps, self.threads) < 1:
            raise cli.UsageError("--batch-size, --prompt-len, --max-tokens, --reps and --threads must be >= 1")
        if self.prompt_len > 50 or self.prompt_len + 1 + self.max_tokens > 256:
            raise cli.UsageError("--prompt-len must be <= 50 and prompt_len + 1 + max_tokens <= 256")


# --8<-- [start:oracle]
def hf_greedy(hf, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """transformers' greedy generate of n tokens for a (B, T) batch without padding -> (B, n)."""
    with torch.no_grad():
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n, min_new_tokens=0,
                          do_sample=False, eos_token_id=None, pad_token_id=Tokenizer().pad_id)
    return out[:, prompts.size(1) :]


def engine_greedy(engine: Engine, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """Our engine on the same batch -> (B, n): all requests queued at once, stepped to completion."""
    outs = engine.generate(prompts.tolist(), SamplingParams(max_tokens=n, ignore_eos=True))
    return torch.tensor([o.token_ids for o in outs])
# --8<-- [end:oracle]


def save_quietly(hf, folder: str) -> None:
    """hf.save_pretrained(folder) without transformers' "Writing model shards" progress bar in the output."""
    from transformers.utils import logging

    bar = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        hf.save_pretrained(folder)
    finally:
        if bar:
            logging.enable_progress_bar()


# --8<-- [start:llama]
# A Llama-style model with grouped-query attention, about the size of the book's GPT (4 layers, 128 wide)
LLAMA = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
             initializer_range=0.2)  # 10x the default 0.02, under which greedy decoding repeats one id


def llama_pair(seed: int, folder: str):
    """transformers' LlamaForCausalLM with random weights, saved into `folder` and read back by
    mlsys.checkpoint -> (ours: mlsys.llama.Llama, theirs: the transformers model that wrote the folder)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=Tokenizer().vocab_size, **LLAMA)
    hf = transformers.LlamaForCausalLM(config).eval()
    save_quietly(hf, folder)
    hf.generation_config.eos_token_id = None  # greedy runs the full length (our side: ignore_eos)
    ours, _ = checkpoint.load_pretrained(folder)
    return ours, hf
# --8<-- [end:llama]


def load_models(args: Settings, folder: str):
    """(our model, the transformers model with the same weights, its class name) for --model."""
    if args.model == "llama":
        ours, hf = llama_pair(args.seed, folder)
        return ours, hf, "LlamaForCausalLM"
    model = load_pretrained("small")
    return model, to_hf_model(model), "GPT2LMHeadModel"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


NEAR = 0.10  # best runs within 10% of each other: close enough to call "about equal" when the runs overlap


def compare(engine: dict[str, float], other: dict[str, float], repeats: int) -> str:
    """A verdict on the engine against another implementation, from each one's {"best_s", "median_s"}. One is
    faster only when its typical (median) run beat the other's fastest: their runs do not overlap. Runs that
    overlap are "about equal" when the best runs lie within NEAR of each other, and undecided otherwise."""
    if repeats < 3:
        return "undecided: too few runs to measure their spread"
    if engine["median_s"] < other["best_s"]:
        return "the engine is faster: its median run beat the other's best run"
    if other["median_s"] < engine["best_s"]:
        return "the engine is slower: the other's median run beat the engine's best run"
    if abs(other["best_s"] / engine["best_s"] - 1) <= NEAR:
        return f"about equal: the runs overlap and the best ones lie within {NEAR:.0%} of each other"
    return "undecided: the runs overlap, so at this load the gap is noise"


def pair_verdict(times: dict[str, dict[str, float]], other: str) -> tuple[float, float, str]:
    """Engine against `other` from {name: {"best_s", "median_s", "repeats"}} -> (ratio of tokens/s by the best
    runs, the spread of these two implementations' runs (how far the higher of their medians sits above its
    best), the verdict). A third implementation's noisy runs say nothing about this pair, so they are left out."""
    engine = times["mlsys.engine"]
    ratio = times[other]["best_s"] / engine["best_s"]
    spread = max(times[name]["median_s"] / times[name]["best_s"] for name in (other, "mlsys.engine")) - 1
    return ratio, spread, compare(engine, times[other], int(engine.get("repeats", 3)))


def interleaved(runs: dict[str, typing.Callable[[], object]], reps: int) -> dict[str, dict[str, float]]:
    """One warm-up round, then `reps` rounds that run every implementation once each: a slow spell of the machine
    hits all of them, not only the one that happened to be running. -> {name: best_s, median_s, repeats}."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            times[name].append(timed(fn))
    return {name: {"best_s": min(ts), "median_s": statistics.median(ts), "repeats": len(ts)}
            for name, ts in times.items()}


def main() -> None:
    args = cli.parse(Settings, __doc__, smoke={"batch_size": 2, "max_tokens": 8, "reps": 1})
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        model, hf, hf_name = load_models(args, folder)
    torch.manual_seed(args.seed)
    tok = Tokenizer()
    lines = make_corpus(args.batch_size, seed=args.seed).splitlines()
    prompts = torch.tensor([tok.encode(line[: args.prompt_len], bos=True) for line in lines])  # (B, T)
    engine = Engine(model, config=EngineConfig(max_num_seqs=args.batch_size))
    n = args.max_tokens

    ours, theirs = engine_greedy(engine, prompts, n), hf_greedy(hf, prompts, n)
    same_rows = int((ours == theirs).all(dim=1).sum())
    c = model.config
    if args.model == "llama":
        print(f"Llama-style model with random weights: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
              f"{c.num_attention_heads} query heads sharing {c.num_key_value_heads} K/V heads (GQA), "
              f"vocabulary {c.vocab_size}; loaded from a save_pretrained folder by mlsys.checkpoint")
        print("(random weights write gibberish; what matters is that both sides write the same)")
    else:
        print(f"the book's trained GPT: {c.n_layer} layers, n_embd {c.n_embd}, {c.n_head} heads")
    print(f"{args.batch_size} prompts of {prompts.size(1)} tokens, {n} greedy tokens each "
          f"(<eos> ignored on both sides)")
    for i in range(min(3, args.batch_size)):
        print(f"  {tok.decode(prompts[i])!r} -> {tok.decode(ours[i])!r}")
    print(f"engine == transformers {hf_name}.generate token for token: {same_rows}/{args.batch_size} rows, "
          f"{int((ours == theirs).sum())}/{ours.numel()} tokens")
    report.expect_equal(f"engine tokens vs {hf_name}.generate", ours, theirs)

    runs = {"transformers generate": lambda: hf_greedy(hf, prompts, n),
            "mlsys.model.generate": lambda: generate(model, prompts, n),
            "mlsys.engine": lambda: engine_greedy(engine, prompts, n)}
    with bench.steady_timing():
        times = interleaved(runs, args.reps)
    tokens = args.batch_size * n
    rows = [{"implementation": name, "best_s": t["best_s"], "median_s": t["median_s"],
             "output_tokens_per_s": tokens / t["best_s"]} for name, t in times.items()]
    print(f"\nbest and median of {args.reps} rounds (each runs all three once), {bench.load_average()}")
    print(report.table(rows, floatfmt=".4g"))
    vs_hf, hf_spread, hf_verdict = pair_verdict(times, "transformers generate")
    vs_plain, plain_spread, verdict = pair_verdict(times, "mlsys.model.generate")
    spread = max(t["median_s"] / t["best_s"] for t in times.values()) - 1  # how far a median sits above its best
    gap = abs(vs_plain - 1)
    goal = "met" if vs_hf >= 1 else "not met"  # the goal: at least transformers' tokens/s
    print(f"\nmedians sit up to {spread:.0%} above the best runs; each verdict uses its own pair's spread only")
    print(f"engine / transformers tokens/s: {vs_hf:.3f}x (spread {hf_spread:.0%}): {hf_verdict}")
    print(f"engine / mlsys.model.generate tokens/s: {vs_plain:.2f}x (spread {plain_spread:.0%}): {verdict}")
    print(f"speed goal (a target, not a check), judged on the best runs alone: engine >= 1x transformers' "
          f"tokens/s: {vs_hf:.3f}x, {goal} in this run")
    engine.check_invariants()
    if args.json:
        report.write_json(args.json, {"model": args.model, "rows_equal": same_rows, "batch_size": args.batch_size,
                                      "max_tokens": n,
                                      "tokens_per_s": {r["implementation"]: r["output_tokens_per_s"] for r in rows},
                                      "rows": rows, "engine_vs_transformers": vs_hf, "engine_vs_plain": vs_plain,
                                      "engine_vs_plain_gap": gap, "median_spread": spread,
                                      "engine_vs_plain_spread": plain_spread,
                                      "engine_vs_transformers_spread": hf_spread,
                                      "engine_vs_plain_verdict": verdict,
                                      "engine_vs_transformers_verdict": hf_verdict,
                                      "goal_met": vs_hf >= 1, "goal": goal,
                                      "load_average": bench.load_average()}, args)


if __name__ == "__main__":
    cli.run(main)
