"""The task of chapter 13: the SFT model writes records, and a rule anyone can read says which one a person prefers.

What it shows
    1. Prompts: the start of a record of the book's corpus, '{"name": "ada", ' (mlsys.reward_model.make_prompts).
    2. Responses: the `draft` GPT (the SFT model the RLHF loop starts from) completes --num-prompts of them with the
       inference engine, sampling at temperature 1, as the RLHF loop will.
    3. The rule (mlsys.reward_model.rule_score), the stand-in for the human: 0 for a malformed record, else its
       number of languages. Any well-formed record beats any malformed one; between two well-formed ones, more
       languages win. Every record the rule scores 0 is sorted by how it breaks the schema (mlsys.rlhf.response_kind).
    The figure records.png shows a few of the responses with the rule's verdict, and how many of all the
    responses got each score: the room the RLHF loop has to improve, and the malformed kinds it could drift into.

How to run
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/preference_rule.py
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/preference_rule.py --max-tokens 40

What it prints
    A few responses with their rule score and kind, then the count of responses per rule score (0 to 3) and the
    count of malformed ones per kind.

Runtime on 2 cores: about 4 s on an idle machine (most of it imports), two or three times that on a busy one;
--smoke about 3 s. The first run trains and caches the draft GPT (a few minutes, once).

Try next
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/preference_rule.py --max-tokens 40
        -> too few tokens for a whole record (45 to 65): the responses are cut short, not JSON, and score 0
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/preference_rule.py --temperature 0.5
        -> a sharper distribution: fewer malformed records, and more of the most likely choice, three languages
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlsys import cli, plot, report
from mlsys.reward_model import make_prompts, rule_score
from mlsys.rlhf import KINDS, generate_rollouts, response_kind


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    num_prompts: int = 256
    """Prompts the SFT model answers, one sampled response each."""
    max_tokens: int = 72
    """Longest response (the RLHF loop's limit; a whole record needs about 45 to 65 tokens)."""
    temperature: float = 1.0
    """Sampling temperature (1: the model's own distribution, as RLHF samples)."""
    examples: int = 6
    """Responses shown in the figure and the output."""

    def validate(self) -> None:
        if self.num_prompts < 1 or self.examples < 1 or not 8 <= self.max_tokens <= 200:
            raise cli.UsageError("--num-prompts and --examples must be >= 1 and --max-tokens in 8..200")
        if not 0 < self.temperature <= 5:
            raise cli.UsageError(f"--temperature must be in (0, 5], got {self.temperature}")


# --8<-- [start:judge]
def judge(prompts: list[str], texts: list[str], examples: int) -> dict:
    """The rule's verdict on every response: its score and, for a score of 0, how it breaks the schema. Returns
    what records.png draws: the counts per score and per kind, and a few examples (one per score and kind first,
    in the order they were sampled)."""
    scores = [rule_score(t) for t in texts]
    kinds = [response_kind(t) for t in texts]
    order, seen = [], set()
    for i, (s, k) in enumerate(zip(scores, kinds)):  # one of each (score, kind) first, then the rest in order
        if (s, k) not in seen:
            seen.add((s, k))
            order.append(i)
    order += [i for i in range(len(texts)) if i not in order]
    shown = sorted(order[:examples], key=lambda i: (-scores[i], i))
    return {"num_responses": len(texts), "prompts": prompts, "texts": texts, "scores": scores, "kinds": kinds,
            "per_score": {str(s): scores.count(s) for s in range(4)},
            "per_kind": {k: kinds.count(k) for k in KINDS}, "examples": shown,
            "mean_rule_score": sum(scores) / len(scores), "well_formed": sum(s > 0 for s in scores) / len(scores)}
# --8<-- [end:judge]


def draw(verdict: dict, args: Settings) -> None:
    """Left: a few responses, prompt in grey and the model's part in black, with the rule's score. Right: how many
    responses got each score, the malformed ones stacked by kind."""
    plt = plot.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 3.8), width_ratios=(2.6, 1))
    left.axis("off")
    left.set(xlim=(0, 1), ylim=(0, len(verdict["examples"]) + 0.6))
    for row, i in enumerate(verdict["examples"]):
        y = len(verdict["examples"]) - row - 0.5
        prompt, text, score = verdict["prompts"][i], verdict["texts"][i], verdict["scores"][i]
        verdict_text = f"{score} lang" + "s" * (score > 1) if score else "0: " + verdict["kinds"][i].replace("_", " ")
        left.text(0.0, y, verdict_text, fontsize=8.5, fontweight="bold", va="center", color="C2" if score else "C3")
        left.text(0.36, y, prompt, family="monospace", fontsize=7.5, va="center", ha="right", color="0.55")
        left.text(0.36, y, " " + text[len(prompt):], family="monospace", fontsize=7.5, va="center")
    left.set_title("the rule's score of a few SFT responses (grey: the prompt; black: what the model wrote)",
                   fontsize=10, loc="left")
    counts = verdict["per_score"]
    bottom = 0
    for j, kind in enumerate(k for k in KINDS if k != "well_formed"):
        n = verdict["per_kind"][kind]
        right.bar(0, n, bottom=bottom, color=f"C{j + 3}", label=f"0: {kind.replace('_', ' ')} ({n})")
        bottom += n
    right.bar([1, 2, 3], [counts[str(s)] for s in (1, 2, 3)], color="C0")
    for s in range(4):
        right.text(s, counts[str(s)], str(counts[str(s)]), ha="center", va="bottom", fontsize=8)
    right.set(xticks=range(4), xticklabels=["0\nmalformed", "1 lang", "2 langs", "3 langs"], ylabel="responses",
              title=f"rule score of all {len(verdict['texts'])} responses")
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # beside the bars: no count hidden
    print(f"figure: {plot.save(fig, args, 'records')}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"num_prompts": 96})  # enough for a few malformed records
    from mlsys.engine import Engine, EngineConfig
    from mlsys.weights import load_pretrained

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a tiny model: one thread beats two fighting over small matmuls
    engine = Engine(load_pretrained("draft"), config=EngineConfig(max_num_seqs=64))
    prompts = make_prompts(args.num_prompts, seed=args.seed)
    batch = generate_rollouts(engine, prompts, args.max_tokens, temperature=args.temperature, seed=args.seed)
    verdict = judge(prompts, batch.texts, args.examples)
    print(f"The SFT model (draft GPT) answers {args.num_prompts} prompts, temperature {args.temperature:g}, at most "
          f"{args.max_tokens} tokens; a few of its responses, with the rule's score:")
    for i in verdict["examples"]:
        print(f"   {verdict['scores'][i]}  {verdict['kinds'][i]:<15} {verdict['texts'][i]}")
    print("\nResponses per rule score (0 = malformed, else the number of languages):")
    print(report.table([{"rule score": s, "responses": verdict["per_score"][str(s)]} for s in range(4)]))
    print("\nMalformed responses by how they break the schema:")
    print(report.table([{"kind": k, "responses": n} for k, n in verdict["per_kind"].items() if k != "well_formed"]))
    print(f"\nmean rule score {verdict['mean_rule_score']:.2f} languages per response (malformed records score 0); "
          f"{verdict['well_formed']:.0%} well formed")
    draw(verdict, args)
    if args.json:
        report.write_json(args.json, verdict, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
