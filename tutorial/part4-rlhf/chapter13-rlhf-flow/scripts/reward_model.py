"""The reward model: a GPT trunk with a scalar head, trained on rule-labelled preference pairs (Bradley-Terry).

What it shows
    1. The preference rule (mlsys.reward_model.rule_score) and a few of the pairs it labels: two records for the same
       name, the one the rule prefers first. Malformed records here are cut short, as a response that runs out
       of tokens is.
    2. Training: the `draft` GPT's trunk plus a zero-initialised linear head, scored at the last token, trained
       with -log sigmoid(r_chosen - r_rejected). The loss is checked against a hand computation on the first
       batch. Then the scores are normalised (mean 0, std 1 on held-out records), as Ziegler et al. do.
    3. Held-out pairwise accuracy (pairs drawn with another seed), overall and per kind of pair, and the scores
       of a few hand-written records, including kinds of fault the model never saw in training.
    4. The four models of PPO-based RLHF built from it: actor, critic, reward model, reference.
    The default run saves the model where mlsys.reward_model.load_reward_model looks (.cache/weights/reward-draft.pt),
    so the next scripts use exactly this model; --smoke trains a few steps and saves nothing.

How to run
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/reward_model.py
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/reward_model.py --steps 200 --plot-dir /tmp/rm

Runtime on 2 cores: about 13-35 s, the upper end at a load average of 7 (a tqdm bar on a terminal); --smoke
about 12 s on a quiet machine, longer on a busy one.

Try next
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/reward_model.py --steps 200 --plot-dir /tmp/rm
        -> twice the default 100 training steps: compare the held-out accuracy and the probes' scores with the
           default run's
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/reward_model.py --seed 1
        -> other pairs: does the blind spot (four or repeated languages scored like good records) stay?
    Only the default seed and recipe save the model the RLHF scripts load, so these leave it alone.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch

from mlsys import cli, plot, report
from mlsys.reward_model import (
    TOKENIZER,
    RewardRecipe,
    ScalarHeadModel,
    encode_records,
    make_preference_pairs,
    pair_scores,
    pairwise_accuracy,
    reward_model_path,
    rule_score,
    train_reward_model,
)
from mlsys.rlhf import build_models
from mlsys.weights import load_pretrained, save_checkpoint


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    steps: int = RewardRecipe.steps
    """Optimizer steps (batches of --batch-size pairs)."""
    batch_size: int = RewardRecipe.batch_size
    """Preference pairs per step."""
    lr: float = RewardRecipe.lr
    """AdamW learning rate (whole model: trunk and head)."""
    num_eval_pairs: int = 1000
    """Held-out pairs for the accuracy (drawn with another seed)."""

    def validate(self) -> None:
        if self.steps < 1 or self.batch_size < 2 or self.num_eval_pairs < 10:
            raise cli.UsageError("--steps must be >= 1, --batch-size >= 2, --num-eval-pairs >= 10")
        if not 0 < self.lr < 1:
            raise cli.UsageError(f"--lr must be in (0, 1), got {self.lr}")


def kind(text: str) -> str:
    score = rule_score(text)
    return "malformed" if score == 0 else f"{score} lang" + "s" * (score > 1)


# --8<-- [start:bt_by_hand]
def check_loss_by_hand(rm, pairs) -> float:
    """The Bradley-Terry loss of one batch, recomputed one pair at a time with math.log/math.exp."""
    from mlsys.reward_model import bradley_terry_loss

    with torch.no_grad():
        chosen, rejected = pair_scores(rm, pairs)  # (P,), (P,)
        loss = bradley_terry_loss(chosen, rejected).item()
    by_hand = sum(-math.log(1 / (1 + math.exp(-(c - r)))) for c, r in zip(chosen.tolist(), rejected.tolist()))
    report.expect_close("Bradley-Terry loss vs a per-pair hand computation", loss, by_hand / len(pairs), 1e-5)
    return loss
# --8<-- [end:bt_by_hand]


def accuracy_by_kind(rm, pairs) -> list[dict]:
    groups = defaultdict(list)
    for pair in pairs:
        groups[(kind(pair[0]), kind(pair[1]))].append(pair)
    return [{"chosen": c, "rejected": r, "pairs": len(g), "accuracy %": 100 * pairwise_accuracy(rm, g)}
            for (c, r), g in sorted(groups.items())]


PROBES = [
    '{"name": "ada", "age": 34, "city": "london", "langs": ["c"]}',
    '{"name": "ada", "age": 34, "city": "london", "langs": ["c", "go"]}',
    '{"name": "ada", "age": 34, "city": "london", "langs": ["c", "go", "rust"]}',
    '{"name": "ada", "age": 34, "city": "london", "langs": ["c", "go", "ru',
    '{"name": "ada", "age": 34, "city": "london", "langs": ["c", "go", "lua", "rust"]}',
    '{"name": "ada", "age": 34, "city": "london", "langs": ["go", "go", "rust"]}',
    '{"name": "ada", "age": 34, "city": "lodnon", "langs": ["c", "go", "rust"]}',
]  # three kinds of fault at the end that no training pair showed


def plot_history(history, args) -> None:
    plt = plot.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    steps = [h["step"] for h in history]
    ax1.plot(steps, [h["loss"] for h in history])
    ax1.set(xlabel="step", ylabel="Bradley-Terry loss", title="loss per batch")
    ax2.plot(steps, [100 * h["batch_accuracy"] for h in history])
    ax2.set(xlabel="step", ylabel="% pairs ranked right", title="batch accuracy", ylim=(0, 102))
    print(f"figure: {plot.save(fig, args, 'training')}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"steps": 8, "num_eval_pairs": 64})
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # tiny model: one thread beats two fighting over small matmuls

    # 1. the rule and some pairs
    pairs = make_preference_pairs(4, seed=args.seed)
    print("1. Pairs labelled by the rule (chosen first; score = 0 if malformed, else the number of languages):")
    for chosen, rejected in pairs:
        print(f"   {rule_score(chosen)} > {rule_score(rejected)}:  {chosen}\n{'':12}{rejected}")

    # 2. train with the Bradley-Terry loss
    recipe = RewardRecipe(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    sft = load_pretrained("draft")
    untrained = ScalarHeadModel(copy.deepcopy(sft))  # head initialised to zero: every score is 0
    first = check_loss_by_hand(untrained, make_preference_pairs(recipe.num_pairs, seed=args.seed)[: args.batch_size])
    report.expect_close("loss of an all-zero head is log 2", first, math.log(2), 1e-6)
    rm, history = train_reward_model(sft, recipe, progress=True)
    print(f"\n2. Trained {args.steps} steps of {args.batch_size} pairs: loss {history[0]['loss']:.3f} "
          f"(log 2 = {math.log(2):.3f} at the start: every score 0) -> {history[-1]['loss']:.4f} on the last batch")
    plot_history(history, args)

    # 3. held-out accuracy
    held_out = make_preference_pairs(args.num_eval_pairs, seed=args.seed + 12345)
    accuracy = pairwise_accuracy(rm, held_out)
    rows = accuracy_by_kind(rm, held_out)
    print(f"\n3. Held-out pairwise accuracy: {100 * accuracy:.1f}% of {len(held_out)} pairs (the check: >= 90%)")
    print("   " + report.table(rows, floatfmt=".1f").replace("\n", "\n   "))
    with torch.no_grad():
        ids, lengths = encode_records(PROBES)
        scores = rm.score(ids, lengths)
    print("\n   Scores of hand-written records (normalised: mean 0, std 1 over held-out records):")
    probe_rows = [{"score": s, "rule": rule_score(t), "record": t} for t, s in zip(PROBES, scores.tolist())]
    print("   " + report.table(probe_rows, floatfmt="+.2f").replace("\n", "\n   "))
    if not args.smoke:
        report.expect_equal("held-out accuracy >= 90%", accuracy >= 0.9, True)

    # 4. the four models
    models = build_models(sft, rm)
    print("\n4. The four models of PPO-based RLHF:")
    table = models.table()
    print("   " + report.table(table).replace("\n", "\n   "))
    print(f"   C = {len(TOKENIZER.itos)}: the vocabulary size, one logit per token")
    if not args.smoke and args.seed == 0 and recipe == RewardRecipe():
        save_checkpoint(reward_model_path("draft"), rm, {"recipe": asdict(recipe), "accuracy": accuracy,
                                                         "final_loss": history[-1]["loss"]})
        print(f"\n   saved to {reward_model_path('draft')} (mlsys.reward_model.load_reward_model reads it)")
    if args.json:
        report.write_json(args.json, {"accuracy": accuracy, "by_kind": rows, "probes": probe_rows,
                                      "first_loss": history[0]["loss"], "last_loss": history[-1]["loss"],
                                      "models": table}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
