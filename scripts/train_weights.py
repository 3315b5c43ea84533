"""Train the pretrained checkpoints (`make weights`) and show what they learned.

For each preset (default: small, then draft) this trains with the recipe in
`mlsys.weights.RECIPES`, writes `.cache/weights/<name>.pt` (or under
`$MLSYS_CACHE`), and prints the final losses, a few greedy samples, and how
many generated lines pass `mlsys.data.is_valid_record`. A checkpoint that
already exists is only evaluated, unless `--force` (also needed for
`--steps`/`--seed` to replace an existing checkpoint).

    python scripts/train_weights.py                  # both presets
    python scripts/train_weights.py --only draft --force
    MLSYS_CACHE=/tmp/c python scripts/train_weights.py --steps 5   # smoke run, seconds
    python scripts/train_weights.py --if-missing     # build what is absent, evaluate nothing (make test/book)

`--if-missing` also builds chapter 13's reward model (`mlsys.reward_model.load_reward_model`, on the draft trunk) and
the byte-level BPE tokenizer that chapter 8 streams through its detokenizer (`mlsys.bpe`, well under a second).

Runtime on a 2-core CPU (torch 2.13, no other load): `small` (0.83 M params,
700 steps of 8 x 256 tokens) about 100-110 s, `draft` (0.12 M params, 800
steps of 16 x 256 tokens) about 50 s. Greedy samples: one per name, prompted
with `<bos>{"name": "<name>`; sampled ones start from `<bos>` alone.
"""

from __future__ import annotations

import argparse
import time

import torch

from mlsys.bpe import bpe_path, build_bpe, load_bpe
from mlsys.data import PEOPLE, Tokenizer, is_consistent_record, is_valid_record
from mlsys.model import GPT, generate, num_params
from mlsys.weights import RECIPES, build_weights, checkpoint_path, load_checkpoint

MAX_RECORD_TOKENS = 120  # the longest record in the grammar is under 100 characters


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(RECIPES), help="build just this preset")
    parser.add_argument("--steps", type=int, help="override the recipe's step count (e.g. 5 for a smoke run)")
    parser.add_argument("--seed", type=int, help="override the recipe's seed (default: 0)")
    parser.add_argument("--force", action="store_true", help="retrain even if the checkpoint exists")
    parser.add_argument("--num-samples", type=int, default=64, help="sampled lines scored (default: 64)")
    parser.add_argument("--if-missing", action="store_true",
                        help="build only what is missing (both presets and chapter 13's reward model), no evaluation: "
                             "what `make test` and `make book` run first, so no test trains a model under its timeout")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def greedy_records(model: GPT, tok: Tokenizer) -> list[str]:
    """One greedy completion per name, so greedy decoding does not repeat one line."""
    prompts = [tok.encode('{"name": "' + name, bos=True) for name in sorted(PEOPLE)]
    lines = []
    for p in prompts:  # prompts differ in length, so one at a time (no padding needed)
        idx = torch.tensor([p])  # (1, T0)
        lines.append(tok.decode(generate(model, idx, MAX_RECORD_TOKENS, eos_id=tok.eos_id)[0]))
    return lines


def sampled_records(model: GPT, tok: Tokenizer, num: int, seed: int = 0) -> list[str]:
    """`num` lines sampled at temperature 1 from `<bos>`, in one batch."""
    idx = torch.full((num, 1), tok.bos_id)  # (num, 1)
    gen = torch.Generator().manual_seed(seed)
    out = generate(model, idx, MAX_RECORD_TOKENS, temperature=1.0, generator=gen, eos_id=tok.eos_id)
    return [tok.decode(row) for row in out]


def fraction(lines: list[str], check) -> str:
    hits = sum(map(check, lines))
    return f"{hits}/{len(lines)} ({hits / len(lines):.0%})"


def report(name: str, model: GPT, meta: dict, num_samples: int) -> None:
    tok = Tokenizer()
    print(
        f"{name}: {num_params(model):,} params, {meta['steps']} steps (seed {meta['seed']}) "
        f"in {meta['train_seconds']:.1f} s; train loss {meta['final_train_loss']:.4f}, "
        f"val loss {meta['final_val_loss']:.4f}  [{checkpoint_path(name)}]"
    )
    greedy = greedy_records(model, tok)
    for line in greedy[:4]:
        print(f"  {'ok ' if is_valid_record(line) else 'BAD'} {line[:100]}")
    sampled = sampled_records(model, tok, num_samples)
    print(f"  valid records: greedy {fraction(greedy, is_valid_record)}, sampled {fraction(sampled, is_valid_record)}")
    print(f"  consistent   : greedy {fraction(greedy, is_consistent_record)}, "
          f"sampled {fraction(sampled, is_consistent_record)}")


def build_missing() -> None:
    """Every checkpoint the book loads, trained only if absent (or, for the reward model, made by another recipe)."""
    for name in RECIPES:
        if not checkpoint_path(name).exists():
            start = time.perf_counter()
            build_weights(name)
            print(f"{name}: built in {time.perf_counter() - start:.1f} s")
    from mlsys.reward_model import load_reward_model  # chapter 13's reward model, on the draft trunk

    load_reward_model()
    if not bpe_path().exists():
        bpe()


def bpe() -> None:
    """(Re)build the BPE tokenizer file (deterministic: the same bytes each time) and say what it holds."""
    start = time.perf_counter()
    path = build_bpe()
    seconds = time.perf_counter() - start
    tok = load_bpe()
    print(f"bpe: {tok.vocab_size} tokens, built in {seconds:.2f} s  [{path}]")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.if_missing:
        build_missing()
        return
    for name in [args.only] if args.only else list(RECIPES):
        path = checkpoint_path(name)
        if args.force or not path.exists():
            start = time.perf_counter()
            build_weights(name, steps=args.steps, seed=args.seed)
            print(f"{name}: built in {time.perf_counter() - start:.1f} s (data + training + save)")
        else:
            print(f"{name}: {path} exists, evaluating it (--force retrains)")
        model, meta = load_checkpoint(path)
        report(name, model, meta, args.num_samples)
    if not args.only:
        bpe()


if __name__ == "__main__":
    main()
