"""Speculative decoding with the book's draft (119k params) and target (832k params): correctness first.

What it shows
    1. One step, traced: the draft proposes k tokens one forward at a time, the target scores all of them in ONE
       forward over k+1 positions, the agreeing prefix is kept plus one target token, and both KV caches are
       rolled back to the accepted length.
    2. Greedy speculative decoding gives token for token the target's own greedy decoding
       (mlsys.model.generate), for every prompt and every k; each k's acceptance rate alpha, tokens per target
       forward, and the formula (1 - alpha^(k+1)) / (1 - alpha) at the measured alpha.
    3. Acceptance per draft position i: P(draft i accepted | drafts before it accepted).
    4. Sampling mode (temperature 1): the acceptance rule min(1, p/q) with the residual max(0, p - q) keeps the
       target's distribution. Checked on explicit small p and q by sampling the rule many times (total
       variation distance to p), then run on the real models.
    5. Hugging Face assisted generation (`generate(..., assistant_model=...)`) on the same two models
       (mlsys.model.to_hf_model) gives the same greedy tokens.
    FIGURES (into --plot-dir) steps.png: the first steps of a greedy run with --k on the first prompt, one row
    per step: accepted drafts, the rejected draft, drafts never judged, and the target's correction or bonus.
    rollback.png: the target's and the draft's KV cache at the four moments of the first step with a
    rejection (before, after drafting, after verification, after the rollback), read off the caches' own lengths.
    Speed is measured by spec_vs_k.py.

How to run
    python tutorial/part3-inference/chapter11-speculative-constrained/scripts/speculative.py
    python tutorial/part3-inference/chapter11-speculative-constrained/scripts/speculative.py --k 6 --num-prompts 8

Runtime on 2 cores: about 10 s, 4 s with --smoke (the first run trains the two models once, a few minutes).

Try next
    python tutorial/part3-inference/chapter11-speculative-constrained/scripts/speculative.py --k 8 --plot-dir /tmp/k8
        -> figures into /tmp/k8/ (by default they go to .cache/figures/speculative/, overwritten by each run);
           a longer guess in the traced step (the first with a rejection, so it may accept no more than at k = 4):
           more grey (never judged) drafts after the pink miss, all thrown away, in rollback.png and steps.png;
           steps.png also runs past <eos> into the <bos> of a new record (the figure's run does not stop there)
    python tutorial/part3-inference/chapter11-speculative-constrained/scripts/speculative.py --ks 1 16
        -> k = 16: still exactly the target's tokens; tokens per target forward still rise from k = 8 to 16, but
           stay far below k + 1, because a late draft survives only if every draft before it did
    python tutorial/part3-inference/chapter11-speculative-constrained/scripts/speculative.py --num-samples 200000
        -> ten times the draws of the acceptance rule: the empirical distribution sits even closer to p; the run
           takes about twice as long as the default run, more on a busy machine
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from mlsys import cli, plot, report
from mlsys.data import Tokenizer, format_record, sample_record
from mlsys.model import generate, num_params, to_hf_model
from mlsys.speculative import CachedModel, expected_tokens_per_step, spec_step, speculative_generate, verify_sampled
from mlsys.weights import load_pretrained


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    num_prompts: int = 4
    """Prompts: <bos> and the first few characters of a record drawn from the data grammar."""
    max_new_tokens: int = 72
    """Tokens generated per prompt (greedy decoding stops earlier at <eos>)."""
    k: int = 4
    """Draft tokens per step in sections 1, 3, 4 and 5."""
    ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """Values of k checked against the target's greedy decoding in section 2."""
    num_samples: int = 20_000
    """Draws of the acceptance rule on explicit p, q in section 4."""

    def validate(self) -> None:
        if self.num_prompts < 1 or not 1 <= self.max_new_tokens <= 160:
            raise cli.UsageError("--num-prompts must be >= 1 and --max-new-tokens in 1..160")
        if not all(1 <= k <= 16 for k in [self.k, *self.ks]):
            raise cli.UsageError("--k and --ks must be in 1..16")
        if self.num_samples < 100:
            raise cli.UsageError(f"--num-samples must be >= 100, got {self.num_samples}")


def make_prompts(n: int, seed: int) -> list[list[int]]:
    """<bos> + the first 2..20 characters of a fresh record (not a copy of the training stream's seed)."""
    rng, tok = random.Random(seed + 11), Tokenizer()
    return [tok.encode(format_record(sample_record(rng))[: rng.randint(2, 20)], bos=True) for _ in range(n)]


# --8<-- [start:trace]
def trace_one_step(target, draft, prompt: list[int], k: int) -> dict:
    """Prefill both caches with prompt[:-1], run one spec_step, report what happened to the caches."""
    tok = Tokenizer()
    max_len = len(prompt) + 2 * (k + 1)
    tgt, drf = CachedModel(target, max_len), CachedModel(draft, max_len)
    tgt.feed(prompt[:-1])
    drf.feed(prompt[:-1])
    before = tgt.cache_len
    new, j, drafts = spec_step(tgt, drf, list(prompt), k, temperature=0.0)
    return {"context": tok.decode(prompt), "drafts": tok.decode(drafts, skip_special=False), "accepted": j,
            "new": tok.decode(new, skip_special=False), "target_cache": f"{before} -> {before + k + 1} -> "
            f"{tgt.cache_len}", "draft_cache": f"{before} -> {before + k} -> {drf.cache_len}"}
# --8<-- [end:trace]


def record_steps(target, draft, prompt: list[int], k: int, max_new: int) -> list[dict]:
    """Greedy spec_step from the prompt until max_new tokens: each step's drafts, accepted count and new tokens."""
    cap = len(prompt) + max_new + k + 1
    tgt, drf = CachedModel(target, cap), CachedModel(draft, cap)
    tgt.feed(prompt[:-1])
    drf.feed(prompt[:-1])
    seq, steps = list(prompt), []
    while len(seq) - len(prompt) < max_new:
        new, j, drafts = spec_step(tgt, drf, seq, k, temperature=0.0)
        steps.append({"drafts": drafts, "accepted": j, "new": new})
        seq += new
    return steps


def draw_steps(steps: list[dict], k: int, args: Settings, max_rows: int = 14) -> None:
    """One row per step: k draft cells (accepted / rejected / never judged) and the target's own token."""
    from matplotlib.patches import Patch, Rectangle

    plt = plot.pyplot()
    tok, rows = Tokenizer(), steps[:max_rows]

    def show(t: int) -> str:  # a visible space, escapes for <eos> and the like
        return repr(tok.decode([t], skip_special=False))[1:-1].replace(" ", "\u2423")

    colours = {"accepted": "#7fc97f", "rejected": "#f0027f", "never judged": "#dddddd", "correction": "#386cb0",
               "bonus": "#9467bd"}  # the same colours as rollback.png
    fig, ax = plt.subplots(figsize=(1.2 + 0.55 * (k + 2), 0.42 * len(rows) + 1.2))
    for r, st in enumerate(rows):
        j = st["accepted"]
        for i, d in enumerate(st["drafts"]):
            kind = "accepted" if i < j else "rejected" if i == j else "never judged"
            ax.add_patch(Rectangle((i, r), 0.95, 0.9, color=colours[kind]))
            ax.text(i + 0.47, r + 0.45, show(d), ha="center",
                    va="center", fontsize=8, family="monospace")
        kind = "bonus" if j == k else "correction"
        ax.add_patch(Rectangle((k + 0.6, r), 0.95, 0.9, color=colours[kind]))
        ax.text(k + 1.07, r + 0.45, show(st["new"][-1]), ha="center",
                va="center", fontsize=8, family="monospace", color="white")
    ax.set_xlim(-0.2, k + 1.8)
    ax.set_ylim(len(rows), -0.2)
    ax.set_xticks([i + 0.47 for i in range(k)] + [k + 1.07], [f"d{i + 1}" for i in range(k)] + ["target"])
    ax.set_yticks([r + 0.45 for r in range(len(rows))], [f"step {r}" for r in range(len(rows))])
    ax.grid(False)
    ax.legend(handles=[Patch(color=c, label=n) for n, c in colours.items()], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(f"greedy speculative decoding, k = {k}: one row per target forward", fontsize=10)
    print(f"figure: {plot.save(fig, args, 'steps')}")


class LoggedCache(CachedModel):
    """A CachedModel that records its cache length after every feed and rollback (for the rollback figure)."""

    def __init__(self, model, max_len: int):
        super().__init__(model, max_len)
        self.log: list[tuple[str, int]] = []

    def feed(self, ids: list[int]) -> torch.Tensor:
        out = super().feed(ids)
        self.log.append(("feed", self.cache_len))
        return out

    def rollback(self, length: int) -> None:
        super().rollback(length)
        self.log.append(("rollback", self.cache_len))


def rollback_step(target, draft, prompt: list[int], k: int, max_new: int) -> dict:
    """Greedy steps from the prompt until one rejects a draft; that step's cache lengths, read off both caches'
    logs: before the step, after drafting, after the target's verification, after the rollback."""
    cap = len(prompt) + max_new + k + 1
    tgt, drf = LoggedCache(target, cap), LoggedCache(draft, cap)
    tgt.feed(prompt[:-1])
    drf.feed(prompt[:-1])
    seq = list(prompt)
    while True:
        before = (tgt.cache_len, drf.cache_len)
        tgt.log.clear()
        drf.log.clear()
        new, j, drafts = spec_step(tgt, drf, seq, k, temperature=0.0)
        if j < k or len(seq) - len(prompt) >= max_new:
            break
        seq += new
    drafted = [n for op, n in drf.log if op == "feed"][-1]
    verified = [n for op, n in tgt.log if op == "feed"][-1]
    return {"seq": seq, "n": len(seq), "drafts": drafts, "accepted": j, "new": new, "k": k, "phases": [
        {"phase": "before the step", "target": before[0], "draft": before[1]},
        {"phase": f"draft fed pending + first {k - 1} guesses", "target": before[0], "draft": drafted},
        {"phase": "target verified k + 1", "target": verified, "draft": drafted},
        {"phase": "both rolled back", "target": tgt.cache_len, "draft": drf.cache_len}]}


def draw_rollback(step: dict, args: Settings, context: int = 6) -> dict:
    """Both caches at the four moments of one step with a rejection: one cell per cache position, its token.
    Returns what it drew: per phase and cache, the (position, token, status) of every drawn cell."""
    from matplotlib.patches import Patch, Rectangle

    plt = plot.pyplot()
    tok, seq, drafts, j = Tokenizer(), step["seq"], step["drafts"], step["accepted"]
    n = len(seq)
    tokens = seq + drafts  # position p holds tokens[p]: the prompt/committed part, then d1..dk at n..n+k-1
    first = max(0, n - 1 - context)
    # the same colours as steps.png; a cell past the cache's length after the rollback is hatched: stale
    colours = {"committed": "#9ecae1", "pending (not cached yet)": "#ffffff", "draft, not judged yet": "#dddddd",
               "accepted draft": "#7fc97f", "rejected draft": "#f0027f", "never judged": "#dddddd"}
    written = {name: step["phases"][2][name] for name in ("target", "draft")}  # the furthest each cache wrote

    def judged(pos: int) -> str:
        return "accepted draft" if pos - n < j else "rejected draft" if pos - n == j else "never judged"

    def status(pos: int, length: int, ph: int, name: str) -> str:
        if pos < n:
            return "committed" if pos < length else "pending (not cached yet)" if ph < 2 else ""
        if pos < length:
            return "draft, not judged yet" if ph < 2 else judged(pos)
        return judged(pos) + " (stale)" if ph == 3 and pos < written[name] else ""

    drawn, rows = [], []
    for ph, p in enumerate(step["phases"]):
        for name in ("target", "draft"):
            rows.append((f"{p['phase']}: {name}", p[name], ph, name))
    fig, ax = plt.subplots(figsize=(0.5 * (n + len(drafts) - first) + 3.2, 0.38 * len(rows) + 1.4))
    for r, (label, length, ph, name) in enumerate(rows):
        cells = []
        for pos in range(first, n + len(drafts)):
            st = status(pos, length, ph, name)
            if not st:
                continue
            cells.append((pos, tokens[pos], st))
            y = r + ph * 0.5  # a gap between phases
            ax.add_patch(Rectangle((pos, y), 0.92, 0.85, facecolor=colours[st.removesuffix(" (stale)")],
                                   edgecolor="#555555",
                                   linestyle="--" if st.startswith("pending") else "-", linewidth=0.8,
                                   hatch="//" if "stale" in st else None))
            ax.text(pos + 0.46, y + 0.43, repr(tok.decode([tokens[pos]], skip_special=False))[1:-1]
                    .replace(" ", "\u2423"), ha="center", va="center", fontsize=8, family="monospace")
        ax.text(n + len(drafts) + 0.3, r + ph * 0.5 + 0.43, f"len {length}", va="center", fontsize=8)
        drawn.append({"row": label, "cache_len": length, "cells": cells})
    ax.set_xlim(first - 0.3, n + len(drafts) + 2.2)
    ax.set_ylim(len(rows) + 1.6, -0.3)
    ax.set_yticks([r + ph * 0.5 + 0.43 for r, (_, _, ph, _) in enumerate(rows)], [lab for lab, *_ in rows],
                  fontsize=8)
    ax.set_xticks([p + 0.46 for p in range(first, n + len(drafts))], [str(p) for p in range(first, n + len(drafts))],
                  fontsize=7)
    ax.set_xlabel("cache position (earlier positions committed, not drawn)", fontsize=9)
    ax.grid(False)
    labels = {"draft, not judged yet": "draft, not judged (yet, or never)"}  # one grey entry for both greys
    ax.legend(handles=[Patch(facecolor=c, edgecolor="#555555", label=labels.get(s, s))
                       for s, c in colours.items() if s != "never judged"]
              + [Patch(facecolor="#ffffff", edgecolor="#555555", hatch="//",
                       label="stale (past len): overwritten\nby the next forward")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(f"one step, k = {step['k']}: {j} of {len(drafts)} drafts accepted\nthe target's own token "
                 f"{tok.decode([step['new'][-1]], skip_special=False)!r} becomes the new pending token "
                 "(in neither cache yet, so not drawn)", fontsize=9)
    fig.tight_layout()
    path = plot.save(fig, args, "rollback")
    print(f"figure: {path}")
    return {"first_position": first, "rows": drawn}


# --8<-- [start:greedy_check]
def greedy_vs_target(target, draft, prompts, ks, max_new: int) -> list[dict]:
    """For each k: speculative greedy == target greedy on every prompt, plus the step statistics."""
    eos = Tokenizer().eos_id
    refs = [generate(target, torch.tensor([p]), max_new, eos_id=eos)[0, len(p):].tolist() for p in prompts]
    refs = [r[: r.index(eos) + 1] if eos in r else r for r in refs]  # generate pads a finished row with eos
    rows = []
    for k in ks:
        outs = [speculative_generate(target, draft, p, max_new, k=k, eos_id=eos) for p in prompts]
        for p, out, ref in zip(prompts, outs, refs):
            report.expect_equal(f"k={k} prompt {Tokenizer().decode(p)!r}", out.token_ids, ref)
        steps = sum(o.stats.steps for o in outs)
        alpha = sum(o.stats.accepted for o in outs) / sum(o.stats.checked for o in outs)
        emitted = sum(o.stats.emitted for o in outs)
        rows.append({"k": k, "tokens": emitted, "target forwards": steps, "alpha": alpha,
                     "tokens/step": emitted / steps, "formula": expected_tokens_per_step(alpha, k),
                     "draft forwards": sum(o.stats.draft_forwards for o in outs), "identical": True})
    return rows
# --8<-- [end:greedy_check]


def alpha_per_position(target, draft, prompts, k: int, max_new: int, temperature: float,
                       seed: int) -> tuple[list[float], float]:
    """Pooled over prompts: accepted_at[i] / reached[i] for draft position i, and over all positions."""
    g = torch.Generator().manual_seed(seed)
    acc, reach = [0] * k, [0] * k
    for p in prompts:
        s = speculative_generate(target, draft, p, max_new, k=k, temperature=temperature, generator=g).stats
        acc = [a + b for a, b in zip(acc, s.accepted_at)]
        reach = [a + b for a, b in zip(reach, s.reached)]
    return [a / r if r else float("nan") for a, r in zip(acc, reach)], sum(acc) / max(sum(reach), 1)


# --8<-- [start:rule_check]
def rule_distribution(p: torch.Tensor, q: torch.Tensor, num_samples: int, seed: int) -> torch.Tensor:
    """Empirical distribution of the first emitted token when k=1 drafts come from q and the target has p.

    p (2, V): the target's distribution at the drafted position and at the bonus position; q (1, V)."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q[0], num_samples, replacement=True, generator=g)  # (N,) d ~ q
    counts = torch.zeros(p.size(1))
    for d in drafts:
        j, nxt = verify_sampled(p, q, d.view(1), g)
        counts[int(d) if j == 1 else nxt] += 1  # accepted: the draft is the first token; else the redraw
    return counts / num_samples
# --8<-- [end:rule_check]


def hf_assisted(target, draft, prompts, k: int, max_new: int) -> list[list[int]]:
    """transformers' assisted generation, greedy, k assistant tokens per step, never cut short by confidence."""
    import transformers
    from transformers import GenerationConfig

    transformers.logging.set_verbosity_error()  # assisted generation warns about its own internal call
    hf_t, hf_d = to_hf_model(target), to_hf_model(draft)
    tok = Tokenizer()
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new, num_assistant_tokens=k,
                           num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0,
                           eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = hf_t.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=hf_d, generation_config=cfg)
        outs.append(out[0, len(p):].tolist())
    return outs


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"num_prompts": 2, "max_new_tokens": 24, "ks": [1, 4],
                                                "num_samples": 2000})
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # tiny models: one thread avoids two threads fighting over small matmuls
    target, draft, tok = load_pretrained("small"), load_pretrained("draft"), Tokenizer()
    prompts = make_prompts(args.num_prompts, args.seed)
    print(f"target 'small' {num_params(target):,} params ({target.config.n_layer} layers, n_embd "
          f"{target.config.n_embd}); draft 'draft' {num_params(draft):,} params ({draft.config.n_layer} layers, "
          f"n_embd {draft.config.n_embd}); {len(prompts)} prompts\n")

    # 1. one step
    step = trace_one_step(target, draft, prompts[0], args.k)
    print(f"1. one step, k={args.k}, after {step['context']!r}:")
    print(f"   draft proposes {step['drafts']!r}; the target agrees with the first {step['accepted']}; "
          f"the step emits {step['new']!r}")
    print(f"   target cache length {step['target_cache']} (rollback), draft cache {step['draft_cache']}\n")

    steps = record_steps(target, draft, prompts[0], args.k, args.max_new_tokens)
    ref = generate(target, torch.tensor([prompts[0]]), args.max_new_tokens)[0, len(prompts[0]):].tolist()
    report.expect_equal("recorded steps vs target greedy", [t for st in steps for t in st["new"]][: len(ref)], ref)
    draw_steps(steps, args.k, args)
    roll = rollback_step(target, draft, prompts[0], args.k, args.max_new_tokens)
    roll["drawn"] = draw_rollback(roll, args)
    print("   a step with a rejection, cache lengths (target, draft): "
          + "; ".join(f"{p['phase']} ({p['target']}, {p['draft']})" for p in roll["phases"]) + "\n")

    # 2. greedy == target greedy, for every k
    rows = greedy_vs_target(target, draft, prompts, args.ks, args.max_new_tokens)
    print("2. greedy speculative decoding vs the target's greedy decoding (same tokens: checked)")
    print("   " + report.table(rows, floatfmt=".3g").replace("\n", "\n   "))
    print("   plain decoding needs one target forward per token; 'formula' is (1 - a^(k+1)) / (1 - a) at the "
          "measured a\n")

    # 3. per-position acceptance
    alphas, alpha_greedy = alpha_per_position(target, draft, prompts, args.k, args.max_new_tokens, 0.0, args.seed)
    print(f"3. greedy acceptance by draft position (k={args.k}): "
          + ", ".join(f"{i + 1}: {a:.3f}" for i, a in enumerate(alphas)))
    print("   the formula assumes one alpha for every position; these are conditional on the earlier ones\n")

    # 4. sampling mode: the rule on explicit distributions, then on the models
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])  # target: drafted position, bonus
    q = torch.tensor([[0.1, 0.6, 0.1, 0.2]])  # draft: proposes token 1 too often, token 0 too rarely
    emp = rule_distribution(p, q, args.num_samples, args.seed)
    tv = 0.5 * float((emp - p[0]).abs().sum())
    print(f"4. acceptance rule on p={[round(x, 2) for x in p[0].tolist()]}, q={[round(x, 2) for x in q[0].tolist()]}: "
          f"{args.num_samples} draws give "
          f"{[round(x, 3) for x in emp.tolist()]} (TV distance to p {tv:.4f}; to q "
          f"{0.5 * float((q[0] - p[0]).abs().sum()):.2f})")
    report.expect_close("empirical distribution of the rule", emp, p[0], atol=5 / args.num_samples ** 0.5)
    sampled, alpha_sampled = alpha_per_position(target, draft, prompts, args.k, args.max_new_tokens, 1.0, args.seed)
    more = "more" if alpha_sampled > alpha_greedy else "fewer"
    print(f"   real models, temperature 1, k={args.k}: acceptance by position "
          + ", ".join(f"{a:.3f}" for a in sampled)
          + f"; all positions {alpha_sampled:.3f} vs {alpha_greedy:.3f} greedy: sampling accepts {more} drafts\n")

    # 5. transformers assisted generation
    hf = hf_assisted(target, draft, prompts, args.k, args.max_new_tokens)
    ours = [speculative_generate(target, draft, p, args.max_new_tokens, k=args.k, eos_id=tok.eos_id).token_ids
            for p in prompts]
    for prompt, a, b in zip(prompts, ours, hf):
        report.expect_equal(f"HF assisted generation, prompt {tok.decode(prompt)!r}", a, b)
    print(f"5. transformers assisted generation (assistant_model=draft, {args.k} tokens, greedy): same tokens on "
          f"all {len(prompts)} prompts, e.g. {tok.decode(prompts[-1])!r} -> {tok.decode(hf[-1])!r}")

    if args.json:
        report.write_json(args.json, {"trace": step, "greedy": rows, "alpha_per_position_greedy": alphas,
                                      "alpha_per_position_sampled": sampled, "rule_empirical": emp.tolist(),
                                      "alpha_greedy": alpha_greedy, "alpha_sampled": alpha_sampled,
                                      "sampling_accepts": more, "alpha_greedy_min": min(alphas),
                                      "alpha_greedy_max": max(alphas), "figure_steps": min(len(steps), 14),
                                      "figure_all_accepted": sum(st["accepted"] == args.k for st in steps[:14]),
                                      "rule_p": p[0].tolist(), "rule_tv": tv, "hf_identical": True, "rollback": roll,
                                      "formula_k16": expected_tokens_per_step(rows[-1]["alpha"], 16),
                                      "largest_k": rows[-1]["k"], "tokens_per_step_largest_k": rows[-1]["tokens/step"]},
                          args)
    return 0


if __name__ == "__main__":
    cli.run(main)
