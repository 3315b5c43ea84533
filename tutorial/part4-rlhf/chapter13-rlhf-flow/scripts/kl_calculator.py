"""KL calculator: the k1, k2, k3 estimators of KL(pi || pi_ref) against the exact value, then on real tokens.

What it shows
    1. A small categorical: policy p and reference q over 5 tokens, close together (1a) and far apart (1b). The exact
       KL(p||q) = sum_x p(x) log p(x)/q(x); the exact expectation of each estimator under p (sum over the 5
       outcomes, no sampling); and --num-samples draws from p: sample mean, standard deviation, and how many
       single samples are negative. k1 and k3 are unbiased, k2 is not; only k1 goes negative.
    2. The same on a language model's tokens: policy = the `small` GPT, reference = the `draft` GPT. For
       --num-sequences responses sampled from the policy, the KL of a response is summed over its tokens; three
       estimates per response: sum of k1, sum of k3, and the sum of the exact per-step KL over the whole 47-token
       vocabulary (given the sampled prefix). All three estimate the same sequence KL; their spread differs.
    3. Per-token reward shaping on one of those responses: r_t = -beta * k1_t, plus the score on the last token,
       and the check sum_t r_t = score - beta * (log pi(y) - log pi_ref(y)).

How to run
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/kl_calculator.py
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/kl_calculator.py --num-samples 100000 --beta 0.1

Runtime on 2 cores: about 2 s (3 s with --smoke). --seed changes the samples.

Try next
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/kl_calculator.py --num-samples 100
        -> few samples: the sample means wander from the exact values; which estimator wanders most depends on
           the draw (compare each mean's distance from its exact value)
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/kl_calculator.py --beta 0.5
        -> ten times the default beta in section 3: the KL part of every r_t grows tenfold, the sum check still holds
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/kl_calculator.py --seed 1
        -> other samples and another response: compare each estimator's spread with the default run's; with only
           a few responses the ordering by spread can change from seed to seed
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mlsys import cli, report
from mlsys.data import Tokenizer
from mlsys.model import generate
from mlsys.reward_model import make_prompts
from mlsys.rlhf import kl_estimators, shape_rewards
from mlsys.weights import load_pretrained


@dataclass
class Settings(cli.Args):
    num_samples: int = 20_000
    """Draws from the policy in section 1."""
    num_sequences: int = 64
    """Responses sampled from the `small` GPT in section 2."""
    max_tokens: int = 72
    """Longest response in section 2 (a record needs about 45-65 tokens)."""
    beta: float = 0.05
    """KL coefficient of the shaping example (section 3)."""
    score: float = 1.0
    """The score the reward model would give the section-3 response (any number: the sums are what is checked)."""

    def validate(self) -> None:
        if self.num_samples < 100 or self.num_sequences < 2:
            raise cli.UsageError("--num-samples must be >= 100 and --num-sequences >= 2")
        if not 1 <= self.max_tokens <= 200:
            raise cli.UsageError(f"--max-tokens must be in 1..200, got {self.max_tokens}")
        if not self.beta >= 0 or math.isinf(self.beta):
            raise cli.UsageError(f"--beta must be a finite number >= 0, got {self.beta}")


# --8<-- [start:categorical]
def categorical_case(p: torch.Tensor, q: torch.Tensor, num_samples: int, gen: torch.Generator) -> list[dict]:
    """Exact KL(p||q), each estimator's exact mean under p, and its Monte Carlo statistics. p, q: (K,) float64."""
    exact = float((p * (p / q).log()).sum())
    all_x = kl_estimators(p.log(), q.log())  # (K,) each: the estimator's value if token x is drawn
    x = torch.multinomial(p, num_samples, replacement=True, generator=gen)  # (N,) samples from the policy
    drawn = kl_estimators(p.log()[x], q.log()[x])  # (N,) each
    rows = []
    for name in ("k1", "k2", "k3"):
        rows.append({"estimator": name, "exact KL": exact, "E_p[k] exact": float((p * all_x[name]).sum()),
                     "sample mean": drawn[name].mean().item(), "sample std": drawn[name].std().item(),
                     "negative %": 100 * (drawn[name] < 0).double().mean().item()})
    return rows
# --8<-- [end:categorical]


@torch.no_grad()
def sequence_kl(policy, reference, ids: torch.Tensor, prompt_len: int, mask: torch.Tensor) -> dict:
    """ids (B, T) = prompt (same length for all rows) + sampled response; mask (B, L) real response tokens.

    Per response: sum_t k1_t, sum_t k3_t, and sum_t KL(pi(.|y<t) || pi_ref(.|y<t)) over the whole vocabulary."""
    logp_all = F.log_softmax(policy(ids)[0][:, prompt_len - 1 : -1].double(), -1)  # (B, L, V)
    ref_all = F.log_softmax(reference(ids)[0][:, prompt_len - 1 : -1].double(), -1)  # (B, L, V)
    tokens = ids[:, prompt_len:, None]  # (B, L, 1) the sampled response tokens
    logp, ref_logp = logp_all.gather(2, tokens).squeeze(2), ref_all.gather(2, tokens).squeeze(2)  # (B, L)
    k = kl_estimators(logp, ref_logp)
    full = (logp_all.exp() * (logp_all - ref_all)).sum(-1)  # (B, L) exact KL of each step's distribution
    return {"k1": (k["k1"] * mask).sum(1), "k3": (k["k3"] * mask).sum(1), "full": (full * mask).sum(1),
            "per_token": {"logp": logp, "ref_logp": ref_logp, "k1": k["k1"], "k3": k["k3"]}}


def sample_responses(policy, n: int, max_tokens: int, seed: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """n samples (temperature 1) after one prompt; returns ids (n, T), prompt length, response mask (n, L)."""
    tok = Tokenizer()
    prompt = torch.tensor([tok.encode(make_prompts(1, seed)[0], bos=True)] * n)  # (n, P)
    ids = generate(policy, prompt, max_tokens, temperature=1.0, generator=torch.Generator().manual_seed(seed),
                   eos_id=tok.eos_id)  # (n, P + L); a finished row repeats <eos>
    resp = ids[:, prompt.size(1) :]  # (n, L)
    is_eos = (resp == tok.eos_id).long()
    after_first_eos = (is_eos.cumsum(1) - is_eos) > 0  # strictly after the first <eos>: padding
    return ids, prompt.size(1), (~after_first_eos).double()


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"num_samples": 2000, "num_sequences": 8})
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(args.seed)

    # 1. a small categorical, close and far
    cases = {"close": ([2.0, 1.0, 0.5, 0.0, -1.0], [1.8, 1.1, 0.6, 0.1, -0.9]),
             "far": ([3.0, 1.0, 0.0, -1.0, -2.0], [0.0, 0.5, 1.0, 1.5, 2.0])}  # logits of p and q
    results: dict = {"categorical": {}, "distributions": {}}
    for label, (name, (lp, lq)) in zip("ab", cases.items()):
        p, q = (torch.tensor(v, dtype=torch.float64).softmax(0) for v in (lp, lq))
        rows = categorical_case(p, q, args.num_samples, gen)
        print(f"1{label}. {name}: p = {[round(v, 3) for v in p.tolist()]}, q = {[round(v, 3) for v in q.tolist()]}, "
              f"{args.num_samples} samples from p")
        shown = [{**r, "negative %": f"{r['negative %']:.1f}"} for r in rows]  # a share: one decimal
        print("   " + report.table(shown, floatfmt=".4f").replace("\n", "\n   ") + "\n")
        for r in rows:
            if r["estimator"] in ("k1", "k3"):  # unbiased: the exact expectation IS the KL
                report.expect_close(f"{name}: E_p[{r['estimator']}] vs KL", r["E_p[k] exact"], r["exact KL"], 1e-9)
        results["categorical"][name] = rows
        results["distributions"][name] = {"p": p.tolist(), "q": q.tolist()}

    # 2. on a language model's tokens
    policy, reference = load_pretrained("small"), load_pretrained("draft")
    ids, prompt_len, mask = sample_responses(policy, args.num_sequences, args.max_tokens, args.seed)
    kl = sequence_kl(policy, reference, ids, prompt_len, mask)
    rows = [{"estimate of KL per response": f"sum of {k}", "mean": kl[k].mean().item(), "std": kl[k].std().item(),
             "min": kl[k].min().item()} for k in ("k1", "k3", "full")]
    print(f"2. policy = small GPT, reference = draft GPT, {args.num_sequences} responses sampled from the policy "
          f"after {Tokenizer().decode(ids[0, :prompt_len])!r}, {mask.sum(1).mean().item():.1f} tokens on average")
    print("   " + report.table(rows, floatfmt=".3f").replace("\n", "\n   ") + "\n")
    report.expect_equal("k3 >= 0 on every token", bool((kl["per_token"]["k3"] >= 0).all()), True)
    report.expect_equal("full per-step KL >= 0 on every response", bool((kl["full"] >= -1e-12).all()), True)
    results["sequences"] = rows

    # 3. per-token shaping on response 0
    n = int(mask[0].sum())
    pt = {k: v[0, :n] for k, v in kl["per_token"].items()}
    score = torch.tensor([args.score], dtype=torch.float64)
    rewards = shape_rewards(score, pt["k1"][None], mask[0:1, :n], args.beta)[0]  # (n,)
    tok = Tokenizer()
    rows = [{"t": t, "token": repr(tok.decode([int(ids[0, prompt_len + t])], skip_special=False)),
             "log pi": pt["logp"][t].item(), "log pi_ref": pt["ref_logp"][t].item(), "k1": pt["k1"][t].item(),
             "k3": pt["k3"][t].item(), "reward r_t": rewards[t].item()} for t in range(n)]
    shown = [r for r in rows[:-1] if abs(r["k1"]) > 0.01][:12] + rows[-1:]  # the rest have k1 near 0
    print(f"3. Per-token rewards of response 0 (score {args.score} at the last token, beta {args.beta}); the "
          f"tokens with |k1| > 0.01 and the last one, {n - len(shown)} tokens with k1 ~ 0 not shown:")
    print("   " + report.table(shown, floatfmt=".4f").replace("\n", "\n   "))
    total = rewards.sum().item()
    seq_kl = (pt["logp"].sum() - pt["ref_logp"].sum()).item()
    report.expect_close("sum_t r_t vs score - beta * log(pi(y)/pi_ref(y))", total, args.score - args.beta * seq_kl,
                        rtol=1e-9, atol=1e-9)
    print(f"   sum_t r_t = {total:.4f} = score {args.score} - beta {args.beta} x log pi(y)/pi_ref(y) {seq_kl:.4f}")
    results["shaping"] = {"sum_rewards": total, "sequence_log_ratio": seq_kl, "num_tokens": n,
                          "prompt_len": prompt_len, "ids": ids[0, : prompt_len + n].tolist()}
    if args.json:
        report.write_json(args.json, results, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
