"""RLHF with PPO on the tiny GPT: one iteration taken apart, then the loop, with reward, KL and length per iteration.

What it shows
    1. One iteration, phase by phase, on --num-rollouts responses: --num-rollouts / --group-size prompts
       '{"name": "<name>", ', each sampled --group-size times (GRPO's groups; PPO gets the same batches):
       generate (mlsys.engine, temperature 1, paged KV cache, continuous batching) -> score (four forward passes,
       one per model: actor and reference log-probs, critic values, the reward model's score at the last token)
       -> per-token KL penalty and shaped rewards -> GAE over the response tokens -> PPO epochs on actor and
       critic -> the new actor weights pushed into the engine (Engine.load_weights). Self-checks: the engine's
       log-probs of the tokens it sampled equal the trainer's recomputation, and sum_t r_t = score - beta * sum_t
       k1_t per row.
       One response is printed token by token with every quantity the update uses, and a "so:" line reading
       what its last and largest TD errors do to the update.
    2. The loop for --iterations, with an adaptive KL coefficient (Ziegler et al. 2019) keeping the KL per
       response near --kl-target (--kl-target 0: a fixed beta). A table every few iterations, and a figure of
       reward, KL, response length and the share of well-formed records per iteration.
    3. What the "human" says: the SFT model (before training) and the trained policy answer the same
       --eval-prompts fresh prompts with the same sampling seeds; per policy, the rule score, the share of
       well-formed records and the reward-model score, and for the trained policy how it breaks the schema and
       what the reward model pays for each kind; a verdict line says whether this run shows reward hacking by
       the rule's count (more malformed records after training than before). Responses side by side.
    4. The tensors of the last iteration, drawn as heatmaps in the order the phases make them, with their shapes.
    --json keeps the printed text too, part by part under "printed" (models, phases, loop, hacking up to the
    verdict, examples, and for PPO response and tensors), so that the lesson can show each part beside the text
    that reads it.
    FIGURES (into --plot-dir): loop.png (the six phases, labelled from iteration 1), training.png (per iteration),
    response.png (one response of the last iteration token by token: shaped rewards, values, GAE advantages),
    iteration.png (every tensor of the last iteration: ids, log-probs, values, scores, k1, rewards, advantages).
    The reward model is mlsys.reward_model.load_reward_model() (trained by reward_model.py; trained here if missing).

How to run
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/rlhf_loop.py
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/rlhf_loop.py --kl-target 0 --beta 0.02   # fixed beta
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/rlhf_loop.py --algo grpo

Self-check: --iterations 10 or more must raise the mean reward-model score by 0.3 (a run that does not learn
exits 1). The rule score over the SFT model is measured and printed, not checked here: tests/test_ch13_rlhf.py
asserts its gain over three seeds.

Runtime on 2 cores: 25-45 s for 24 iterations and the two evaluations on a busy machine (a tqdm bar on a
terminal), 10 s with --smoke.

Try next
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/rlhf_loop.py --kl-target 0 --beta 0
        -> no KL penalty (the lesson shows its section 3): compare the kl column with the 1-nat target of the
           default run, and section 3's verdict line, which says whether the rule counts more malformed records
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/rlhf_loop.py --algo grpo
        -> no critic, group baseline, KL in the loss; no token table and no section 4 or iteration.png (no
           per-token values); with the penalty on, section 3's verdict line can still show reward hacking
    python tutorial/part4-rlhf/chapter13-rlhf-flow/scripts/rlhf_loop.py --k-beta 2
        -> a controller four times as quick (beta moves up to 40% per iteration): compare the KL column and beta
           with the default run's, and section 3's rule score and well-formed share: a KL nearer its target need
           not mean less hacking (the penalty limits how far the policy moves, not where); section 3 measures the
           policy after its last update, so its well-formed share need not match the last batches' valid column
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
import typing
from dataclasses import dataclass

import torch

from mlsys import cli, plot, report, rlhf
from mlsys.reward_model import TOKENIZER, rule_score
from mlsys.rlhf import PPOConfig, RolloutBatch, evaluate_policy, rlhf_iteration, setup_rlhf


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    iterations: int = 24
    """RLHF iterations (each: generate, score, update, push weights)."""
    num_rollouts: int = 32
    """Responses generated per iteration (groups of --group-size share a prompt)."""
    max_tokens: int = 72
    """Longest response; a well-formed record needs about 45-65 tokens."""
    algo: typing.Literal["ppo", "grpo"] = "ppo"
    """ppo: critic + GAE + KL in the reward. grpo: group baseline, no critic, KL in the loss."""
    actor_lr: float = 3e-4
    """Adam learning rate of the actor (the critic's is 1e-3)."""
    beta: float = 0.1
    """Initial KL coefficient."""
    kl_target: float = 1.0
    """Target KL per response in nats for the adaptive controller; 0 keeps beta fixed."""
    k_beta: float = 0.5
    """Controller gain: beta changes by at most k_beta x 20 percent per iteration."""
    group_size: int = 4
    """Responses per prompt (GRPO's group; PPO gets the same prompts)."""
    eval_prompts: int = 256
    """Fresh prompts on which the SFT model and the trained policy are compared (rule and reward model)."""

    def validate(self) -> None:
        if self.iterations < 1 or self.max_tokens < 8 or self.max_tokens > 200 or self.eval_prompts < 1:
            raise cli.UsageError("--iterations and --eval-prompts must be >= 1 and --max-tokens in 8..200")
        if self.group_size < 2 or self.num_rollouts < self.group_size or self.num_rollouts % self.group_size:
            raise cli.UsageError(f"--num-rollouts must be a multiple of --group-size >= 2, got "
                                 f"{self.num_rollouts} and {self.group_size}")
        for name in ("actor_lr", "beta", "kl_target", "k_beta"):
            value = getattr(self, name)
            if not 0 <= value < math.inf or (name == "actor_lr" and value == 0):
                raise cli.UsageError(f"--{name.replace('_', '-')} must be a finite number >= 0 (lr > 0), got {value}")


class Printed(io.StringIO):
    """Passes what is printed on to the terminal and keeps it, part by part: cut() files what was printed since
    the last cut under a name, less the `figure:` lines (their paths are this machine's)."""

    def __init__(self, out: typing.TextIO) -> None:
        super().__init__()
        self.out, self.parts = out, {}

    def write(self, text: str) -> int:
        self.out.write(text)
        return super().write(text)

    def cut(self, name: str) -> None:
        lines = [line for line in self.getvalue().split("\n") if not line.startswith("figure: ")]
        self.parts[name] = "\n".join(lines).strip("\n")
        self.seek(0)
        self.truncate()


def ppo_config(args: Settings) -> PPOConfig:
    return PPOConfig(beta=args.beta, kl_target=args.kl_target or None, k_beta=args.k_beta, actor_lr=args.actor_lr,
                     group_size=args.group_size)


# --8<-- [start:anatomy]
def anatomy(batch: RolloutBatch, stats: dict, beta: float, row: int = 0) -> dict:
    """Print one response token by token with what the update used; check engine vs trainer log-probs
    and the reward-shaping sum. Returns the checked numbers."""
    x, mask = batch.extra, batch.mask
    gap = ((batch.engine_logprobs - x["logprobs"]).abs() * mask).max().item()
    report.expect_close("engine log-probs vs the trainer's recomputation", gap, 0.0, atol=1e-4)
    shaped = x["rewards"].sum(1)  # (B,)
    report.expect_close("sum_t r_t vs score - beta * sum_t k1_t", shaped,
                        x["scores"] - beta * x["kl"]["k1"].sum(1), rtol=1e-5, atol=1e-5)
    n = int(mask[row].sum())
    tokens = batch.ids[row, batch.prompt_lens[row] :][:n].tolist()
    start = max(0, max((t for t, tok in enumerate(tokens) if TOKENIZER.itos[tok] == "["), default=0) - 1)
    cols = {"log pi (engine)": batch.engine_logprobs, "log pi (actor)": x["logprobs"],
            "log pi_ref": x["ref_logprobs"], "k1": x["kl"]["k1"], "k3": x["kl"]["k3"], "value V": x["values"],
            "reward r_t": x["rewards"], "advantage (whitened)": x["advantages"], "return": x["returns"]}
    rows = [{"t": t, "token": repr(TOKENIZER.decode([tok], skip_special=False)),
             **{k: v[row, t].item() for k, v in cols.items()}} for t, tok in enumerate(tokens)]
    print(f"   response {row}: {batch.texts[row]!r}; its tokens from the language list on:")
    print("   " + report.table(rows[start:], floatfmt=".3f").replace("\n", "\n   "))
    print(f"   its score {x['scores'][row].item():+.3f} lands on the last token; sum_t r_t = "
          f"{shaped[row].item():+.3f} = score - beta {beta:.3f} x sum_t k1 {x['kl']['k1'][row].sum().item():.3f}")
    print(f"   max |engine log-prob - trainer log-prob| over all {int(mask.sum())} sampled tokens: {gap:.1e}")
    return {"logprob_gap": gap, "row": rows}
# --8<-- [end:anatomy]


def print_phases(batch: RolloutBatch, stats: dict, args: Settings) -> None:
    B, T = batch.ids.shape
    L = batch.mask.size(1)
    print(f"1. One iteration, phase by phase ({args.algo}, {B} rollouts):")
    print(f"   generate  engine, temperature 1: ids {tuple(batch.ids.shape)}, responses (B, L) = ({B}, {L}), "
          f"mean length {stats['response_len']:.1f} tokens, {stats['generate_s']:.2f} s")
    critic = "critic values (B, L), " if args.algo == "ppo" else ""  # GRPO has no critic
    print(f"   score     actor + reference log-probs (B, L), {critic}reward model (B,): "
          f"mean score {stats['reward']:+.3f}, {stats['score_s']:.2f} s")
    loss = "" if args.algo == "ppo" else "; the loss adds beta x mean k3"  # GRPO: k3 in the loss, k1 drives beta
    print(f"   KL        per token k1 = log pi - log pi_ref; mean sum of k1 per response {stats['kl']:.3f} (drives "
          f"beta; sum of k3: {stats['kl_k3']:.3f}); beta {stats['beta']:.3f}{loss}")
    value = f"value loss {stats['value_loss']:.4f}, " if "value_loss" in stats else ""  # none without a critic
    print(f"   update    {PPOConfig.ppo_epochs} epochs x {PPOConfig.num_minibatches} minibatches: policy loss "
          f"{stats['policy_loss']:+.4f}, {value}clip fraction {stats['clip_frac']:.3f}, {stats['train_s']:.2f} s")
    print(f"   sync      Engine.load_weights(actor.state_dict()): {1e3 * stats['sync_s']:.1f} ms\n")


def plot_loop(batch: RolloutBatch, stats: dict, args: Settings) -> None:
    """The RLHF loop as a diagram, each box labelled with what iteration 1 of this run actually did."""
    plt = plot.pyplot()
    B, T = batch.ids.shape
    L = batch.mask.size(1)
    critic = "critic values V (B, L)\n" if args.algo == "ppo" else ""
    top, bottom, cols = 2.6, 0.6, (1.2, 5.0, 8.8)  # box centres: top row left to right, bottom right to left
    boxes = [
        (cols[0], top, f"1. generate\nmlsys.engine, temperature 1\nids (B, T) = ({B}, {T})\n"
                       f"mean {stats['response_len']:.1f} response tokens"),
        (cols[1], top, f"2. score: forward passes\nactor, reference: log pi (B, L)\n"
                       f"(B, L) = ({B}, {L})\n{critic}reward model R (B,): mean {stats['reward']:+.3f}"),
        (cols[2], top, "3. KL penalty\nk1_t = log pi - log pi_ref\n" + (
                       f"r_t = -beta k1_t, plus R at the end\nbeta = {stats['beta']:.3f}" if args.algo == "ppo"
                       else f"sum of k1 moves beta;\nbeta x mean k3 goes into the loss\nbeta = {stats['beta']:.3f}")),
        (cols[2], bottom, "4. advantages\n" + ("GAE over response tokens\n(gamma 1, lambda 0.95), whitened"
                                               if args.algo == "ppo" else "R minus its group's mean,\n"
                                               f"over its std (groups of {args.group_size})")),
        (cols[1], bottom, f"5. update\n{PPOConfig.ppo_epochs} epochs x {PPOConfig.num_minibatches} minibatches\n"
                          "clipped loss on the actor" + ("\nvalue loss on the critic" if args.algo == "ppo" else "")
                          + f"\nclip fraction {stats['clip_frac']:.3f}"),  # as section 1 prints them
        (cols[0], bottom, "6. sync\nEngine.load_weights(actor)\nthe next batch samples\nfrom the new policy"),
    ]
    fig, ax = plt.subplots(figsize=(12, 4.6))
    for x, y, text in boxes:
        ax.text(x, y, text, ha="center", va="center", fontsize=8.5,
                bbox={"boxstyle": "round,pad=0.5", "fc": "#eef3fb", "ec": "#4a72b0"})
    arrow = {"arrowstyle": "-|>", "color": "#4a72b0", "lw": 1.5}
    half = 1.5  # about half a box's width, in data units
    for a, b in zip(cols, cols[1:]):
        ax.annotate("", (b - half, top), (a + half, top), arrowprops=arrow)
        ax.annotate("", (a + half, bottom), (b - half, bottom), arrowprops=arrow)
    ax.annotate("", (cols[2], bottom + 0.75), (cols[2], top - 0.75), arrowprops=arrow)
    ax.annotate("", (cols[0], top - 0.75), (cols[0], bottom + 0.75), arrowprops=arrow)
    ax.annotate(f"{B // args.group_size} prompts\nx {args.group_size} responses\n'{{\"name\": ...'",
                (cols[0] - half, top), (-1.4, top), ha="center",
                va="center", fontsize=8.5, arrowprops=arrow)
    ax.text(cols[1], (top + bottom) / 2, f"one {args.algo.upper()} iteration of this run (iteration 1)",
            ha="center", va="center", fontsize=10, style="italic")
    ax.set(xlim=(-2.1, 10.7), ylim=(-0.3, 3.5))
    ax.axis("off")
    print(f"figure: {plot.save(fig, args, 'loop')}")


# --8<-- [start:iteration_picture]
def draw_iteration(batch: RolloutBatch, stats: dict, iteration: int, args: Settings, row: int = 0) -> dict:
    """The tensors of one PPO iteration as heatmaps, in the order they were made: generate -> score -> KL and
    shaped rewards -> GAE -> the update. Every panel is the real tensor of `batch`, padding left blank, titled with
    its real shape; `row` (the response of the token table and response.png) is outlined. Returns what it drew."""
    import numpy as np

    plt = plot.pyplot()
    x, mask = batch.extra, batch.mask.bool()
    grid = {"1. generate: engine log-prob (checked vs actor)": batch.engine_logprobs,
            "2. score: actor log pi (= log pi_old)": x["logprobs"],
            "2. score: reference log pi_ref": x["ref_logprobs"], "2. score: critic V": x["values"],
            "3. KL: k1 = log pi - log pi_ref": x["kl"]["k1"], "3. shaped reward r_t": x["rewards"],
            "4. GAE: advantage, whitened": x["advantages"], "4. GAE: return G_t": x["returns"]}  # (B, L) each
    drawn = {k: torch.where(mask, v, torch.nan).tolist() for k, v in grid.items()}  # nan = padding
    ids = torch.where(batch.ids == TOKENIZER.pad_id, torch.nan, batch.ids.float())
    panels = [("1. generate: ids <bos> prompt response", ids), *list(grid.items())[:4],
              ("2. score: reward model R", x["scores"]), *list(grid.items())[4:]]
    fig, axes = plt.subplots(4, 3, figsize=(14, 14))  # three panels a row: each wide enough to read a cell
    for ax, (title, t) in zip(axes.flat, panels):
        signed = "k1" in title or "log" not in title and t is not ids
        cmap = "RdBu_r" if signed else "viridis"  # red/blue: signed quantities, centred on 0
        a = (t.float().masked_fill(~mask, torch.nan) if t.shape == mask.shape else t.reshape(len(t), -1)).numpy()
        # a few outliers saturate; the shaped rewards saturate at half their largest value, so the score on the
        # last token of every row is strongly coloured against the small per-token KL penalties
        shaped = title.startswith("3. shaped reward")
        lim = ((np.nanmax(np.abs(a)) / 2 if shaped else np.nanpercentile(np.abs(a), 98)) or 1.0
               if cmap == "RdBu_r" else None)
        im = ax.imshow(a, aspect="auto", interpolation="nearest", cmap=cmap,
                       **({"vmin": -lim, "vmax": lim} if lim else {}))
        ax.add_patch(plt.Rectangle((-0.5, row - 0.5), a.shape[1], 1, fill=False, ec="black", lw=1.2))
        ax.set_title(f"{title}\n{tuple(t.shape)}", fontsize=9)
        ax.grid(False)
        ax.set(xlabel="sequence position" if t is ids else "response token" if a.shape[1] > 1 else "",
               ylabel="row (response)", **({} if a.shape[1] > 1 else {"xticks": []}))
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02, extend="both" if lim else "neither")
    axes.flat[-2].axis("off")
    axes.flat[-1].axis("off")
    axes.flat[-2].text(0, 0.5, f"5. update: {PPOConfig.ppo_epochs} epochs x {PPOConfig.num_minibatches} minibatches "
                       f"of rows\n   clipped policy loss on the actor (ratio vs log pi_old),\n   value loss on the "
                       f"critic (vs the return G_t)\n   clip fraction {stats['clip_frac']:.3f}\n\n6. sync: "
                       f"Engine.load_weights(actor)", fontsize=9, va="center", family="monospace")
    fig.suptitle(f"The tensors of iteration {iteration}, {tuple(batch.ids.shape)[0]} responses (outlined: row {row}, "
                 f"the response of the token table); blank: padding;\nred/blue scales saturate at the 98th "
                 f"percentile (shaped reward: at half its largest |value|)", fontsize=11)
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'iteration')}")
    return {"iteration": iteration, "row": row, "beta": stats["beta"], "ids": batch.ids.tolist(),
            "shapes": {title: list(t.shape) for title, t in panels}, "scores": x["scores"].tolist(), **drawn}
# --8<-- [end:iteration_picture]


def plot_history(history: list[dict], args: Settings) -> None:
    plt = plot.pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    it = range(1, len(history) + 1)
    col = {k: [h[k] for h in history] for k in history[0]}
    axes[0, 0].plot(it, col["reward"], label="reward model score")
    axes[0, 0].plot(it, col["rule_score"], label="rule score (the 'human')")
    axes[0, 0].set(ylabel="mean per response", title="reward")
    axes[0, 0].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.04), ncol=2)  # below: no curve hidden
    axes[0, 1].plot(it, col["kl"], label="KL (sum of k1)")
    axes[0, 1].plot(it, col["kl_k3"], label="KL (sum of k3)", alpha=0.6)
    if args.kl_target:
        axes[0, 1].axhline(args.kl_target, color="gray", ls="--", label="target")
    axes[0, 1].set(ylabel="nats per response", title="KL(pi || pi_ref)")
    beta_ax = axes[0, 1].twinx()
    beta_ax.plot(it, col["beta"], color="black", lw=1, label="beta")
    beta_ax.set_ylabel("beta")
    beta_ax.grid(False)
    handles = axes[0, 1].get_legend_handles_labels()[0] + beta_ax.get_legend_handles_labels()[0]
    axes[0, 1].legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.04), ncol=4)
    axes[1, 0].plot(it, col["response_len"])
    axes[1, 0].set(xlabel="iteration", ylabel="tokens", title="mean response length")
    axes[1, 1].plot(it, [100 * v for v in col["valid"]])
    axes[1, 1].set(xlabel="iteration", ylabel="%", title="well-formed records", ylim=(0, 102))
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'training')}")


def sign_stretches(values: list[float], limit: int = 4) -> str:
    """'positive on t 0-43, negative on t 44-60': the stretches of tokens whose values keep one sign (>= 0 counts
    as positive, as the bars' colours do), the first `limit` of them."""
    runs: list[list] = []
    for t, v in enumerate(values):
        sign = "positive" if v >= 0 else "negative"
        if runs and runs[-1][0] == sign:
            runs[-1][2] = t
        else:
            runs.append([sign, t, t])
    text = ", ".join(f"{s} on t {a}" + (f"-{b}" if b > a else "") for s, a, b in runs[:limit])
    return text + (f", ... ({len(runs)} stretches)" if len(runs) > limit else "")


def advantage_signs(data: dict, cfg: PPOConfig) -> dict:
    """Why one response's raw advantages have the signs they have. Unrolled, GAE is A_t = sum_k (gamma lambda)^k
    delta_{t+k} with delta_t = r_t + gamma V_{t+1} - V_t (V after the last token: 0), checked here against the
    advantages the update used; returns the largest delta, the last one and the sign stretches."""
    r, v, n = data["rewards"], data["values"], data["num_tokens"]
    delta = [r[t] + cfg.gamma * (v[t + 1] if t + 1 < n else 0.0) - v[t] for t in range(n)]
    unrolled = [sum((cfg.gamma * cfg.lam) ** k * delta[t + k] for k in range(n - t)) for t in range(n)]
    report.expect_close("A_t = sum_k (gamma lambda)^k delta_(t+k)", torch.tensor(unrolled),
                        torch.tensor(data["advantages_raw"]), rtol=1e-4, atol=1e-4)
    top = max(range(n), key=lambda t: delta[t])
    return {"delta_max": delta[top], "delta_max_t": top, "delta_max_token": repr(data["tokens"][top]),
            "delta_max_reward": r[top], "delta_last": delta[-1], "raw_positive": n - data["raw_negative"],
            "sign_stretches": sign_stretches(data["advantages_raw"]),
            "signs_text": signs_text(delta[-1], delta[top], r[top], top == n - 1)}


def signs_text(delta_last: float, delta_top: float, reward_top: float, top_is_last: bool) -> str:
    """What the two deltas mean for the update, read from their values so that the lesson's sentence is true of
    every run: the last delta's sign says whether the last reward r_T (R and its KL term) beat the critic's last
    value; the largest delta is 'mostly' its reward r_t when |r_t| exceeds the critic's change of value beside it."""
    end = "fell short of" if delta_last < 0 else "reached"
    text = f"r_T {end} the critic's last value, so the last tokens are pushed {'down' if delta_last < 0 else 'up'}"
    if top_is_last:
        return f"{text}; the largest delta is that last one"
    part = ("mostly its reward r_t" if abs(reward_top) > abs(delta_top - reward_top)
            else "mostly the critic's change of value")
    kind = "a KL bonus (r_t > 0)" if reward_top > 0 else "a KL charge (r_t <= 0)"
    return (f"{text}; the largest delta, which pushes the tokens before it {'up' if delta_top > 0 else 'down'}, "
            f"is {part}; its r_t is {kind}")


def draw_response(batch: RolloutBatch, beta: float, cfg: PPOConfig, args: Settings, row: int = 0) -> dict:
    """One response of the batch token by token: its shaped rewards r_t (-beta k1_t on every token, the score R
    added on the last), the critic's values V_t, and the GAE advantages before and after whitening.
    Returns what it drew."""
    plt = plot.pyplot()
    x, mask = batch.extra, batch.mask
    raw, _ = rlhf.token_gae(x["rewards"], x["values"], mask, cfg.gamma, cfg.lam)  # (B, L) before whitening
    n = int(mask[row].sum())
    ids = batch.ids[row, batch.prompt_lens[row] :][:n].tolist()
    tokens = [TOKENIZER.decode([t], skip_special=False) for t in ids]
    data = {"row": row, "tokens": tokens, "beta": beta, "gamma": cfg.gamma, "lam": cfg.lam,
            "score": x["scores"][row].item(), "k1": x["kl"]["k1"][row, :n].tolist(),
            "rewards": x["rewards"][row, :n].tolist(), "values": x["values"][row, :n].tolist(),
            "advantages_raw": raw[row, :n].tolist(), "advantages": x["advantages"][row, :n].tolist()}
    data["mean_value"], data["num_tokens"] = sum(data["values"]) / n, n
    data["raw_negative"] = sum(a < 0 for a in data["advantages_raw"])
    data.update(advantage_signs(data, cfg))
    data["whitened_negative"] = sum(a < 0 for a in data["advantages"])
    t = range(n)
    fig, axes = plt.subplots(3, 1, figsize=(max(8.0, 0.16 * n + 2), 7.2), sharex=True)
    kl_part = [-beta * k for k in data["k1"]]
    returns = [a + v for a, v in zip(data["advantages_raw"], data["values"])]  # G_t = A_t + V_t (lambda-return)
    axes[0].bar(t, kl_part, color="#9e9ac8", label="-beta k1_t: the KL term, on every token\n(a charge, or a bonus)")
    axes[0].axhline(0, color="black", lw=0.6)
    axes[0].bar([n - 1], [data["score"]], bottom=[kl_part[-1]], color="#e6550d",
                label=f"+ score R = {data['score']:+.2f}, on the last token only")
    axes[0].set(ylabel="reward r_t", title=f"one response of the last iteration (row {row}), {n} tokens; "
                f"beta = {beta:.3f}")
    axes[1].plot(t, data["values"], "o-", ms=3, label="critic value V_t (expected)")
    axes[1].plot(t, returns, "-", color="#e6550d",
                 label="lambda-return G_t = A_t + V_t\n(rewards mixed with later V; not their plain sum)")
    axes[1].set(ylabel="value")
    # raw advantages span a few hundredths to tenths: a symlog axis of their own keeps the small ones (and their
    # sign) visible; the whitened ones get a linear axis on the right, both symmetric so that their 0 lines meet
    raw_max = max(abs(a) for a in data["advantages_raw"]) or 1.0
    axes[2].bar(t, data["advantages_raw"], color=["#31a354" if a >= 0 else "#de2d26" for a in data["advantages_raw"]])
    for colour, sign in (("#31a354", ">= 0"), ("#de2d26", "< 0")):   # legend entries for both bar colours
        axes[2].bar([0], [0], width=0, color=colour, label=f"GAE advantage A_t (raw) {sign}, left axis")
    axes[2].set_yscale("symlog", linthresh=0.03 * raw_max)
    axes[2].set_ylim(-1.3 * raw_max, 1.3 * raw_max)
    axes[2].axhline(0, color="black", lw=0.6)
    axes[2].set(ylabel="raw A_t (symlog)", xlabel="response token")
    white_ax = axes[2].twinx()
    white_max = max(abs(a) for a in data["advantages"]) or 1.0
    white_ax.plot(t, data["advantages"], "k.", ms=4, label="after whitening over the batch, right axis")
    white_ax.set(ylim=(-1.3 * white_max, 1.3 * white_max), ylabel="whitened A_t")
    white_ax.grid(False)
    axes[2].set_xticks(list(t), [tok.replace(" ", "\u2423") for tok in tokens], fontsize=7, family="monospace")
    for label in axes[2].get_xticklabels():
        if len(label.get_text()) > 1:  # '<eos>' would run into its neighbour: stand it upright
            label.set_rotation(90)
    for ax in axes[:2]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.12, 1.0))  # lined up with the bottom one
    handles = [h for a in (axes[2], white_ax) for h in a.get_legend_handles_labels()[0]]
    axes[2].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.12, 1.0))  # past the right axis
    for ax in axes:
        ax.grid(axis="x", visible=False)
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'response')}")
    return data


def change(before: float, after: float, fmt: str = "") -> str:
    """'rose from 9 to 12', 'fell from 94% to 90%' or 'stayed at 94%': the direction read from the two values,
    'stayed' when they print alike in `fmt`, so that the lesson's sentence is true of every run."""
    a, b = format(before, fmt), format(after, fmt)
    return f"stayed at {a}" if a == b else f"{'rose' if after > before else 'fell'} from {a} to {b}"


def hack_verdict(sft_malformed: int, trained_malformed: int) -> str:
    """Reward hacking as the rule counts it: more malformed records after training than before, on the same
    prompts and seeds. Read from the two counts, so that the lesson's sentence is true of every run."""
    more = trained_malformed > sft_malformed
    word = "more" if more else "as many" if trained_malformed == sft_malformed else "fewer"
    return (f"the trained policy wrote {trained_malformed} malformed records against the SFT model's "
            f"{sft_malformed}: {word}, so by the rule's count this run shows "
            f"{'reward hacking' if more else 'no reward hacking'}")


# --8<-- [start:hacking]
def print_hacking(sft: dict, trained: dict, args: Settings) -> dict:
    """The SFT model and the trained policy on the same prompts and seeds: what the rule (the "human") and the
    reward model say, and how the trained policy's malformed records are scored. Returns the numbers."""
    keys = ("rule_score", "valid", "reward", "reward_valid", "reward_malformed")
    print(f"\n3. The SFT model and the trained policy on the same {args.eval_prompts} fresh prompts and sampling "
          f"seeds (reward: the reward model's mean score; then how many records of each kind):")
    print("   " + report.table([{"policy": name, **{k: e[k] for k in keys}, **e["kinds"]}
                                for name, e in (("SFT", sft), ("trained", trained))],
                               floatfmt=".3f").replace("\n", "\n   "))
    words = {"rule_change": change(sft["rule_score"], trained["rule_score"], ".2f"),  # directions read from this run
             "valid_change": change(sft["valid"], trained["valid"], ".0%"),
             "hacks_change": change(sft["hacks"], trained["hacks"]),
             "sft_malformed_paid": "above" if sft["reward_malformed"] > sft["reward_valid"] else "not above",
             "hack_verdict": hack_verdict(sft["malformed"], trained["malformed"])}
    print(f"   rule score {words['rule_change']}; well-formed "
          f"{words['valid_change']}. {trained['malformed_above_valid']} of the trained policy's "
          f"{trained['malformed']} malformed records score above its mean well-formed "
          f"one ({trained['reward_valid']:+.2f}); four or repeated languages ({trained['hacks']} records): "
          f"{trained['reward_hacks']:+.2f} on average")
    print(f"   records with four or repeated languages {words['hacks_change']}; the SFT model's malformed records "
          f"score {words['sft_malformed_paid']} its well-formed ones on average ({sft['reward_malformed']:+.2f} "
          f"against {sft['reward_valid']:+.2f}) before any RL")
    print(f"   verdict: {words['hack_verdict']}")
    return {**words, **{name: {k: v for k, v in e.items() if k not in ("texts", "scores")}
                        for name, e in (("sft", sft), ("trained", trained))}}
# --8<-- [end:hacking]


def print_examples(sft: dict, trained: dict) -> None:
    """The end of section 3: the trained policy's best-paid malformed records, then both policies side by side."""
    bad = sorted((s, t) for s, t in zip(trained["scores"], trained["texts"]) if rule_score(t) == 0)
    print()  # a part of its own in --json's "printed": a lesson can show section 3 without the examples
    for score, text in bad[::-1][:3]:
        print(f"   malformed, scored {score:+.2f}: {text}")
    print("   the same prompts, SFT then trained:")
    for before, after in list(zip(sft["texts"], trained["texts"]))[:4]:
        print(f"   SFT:     {before}\n   trained: {after}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"iterations": 2, "num_rollouts": 8, "max_tokens": 48, "eval_prompts": 8})
    printed = Printed(sys.stdout)
    with contextlib.redirect_stdout(printed):
        return run_loop(args, printed)


def run_loop(args: Settings, printed: Printed) -> int:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # tiny model: one thread beats two fighting over small matmuls
    cfg = ppo_config(args)
    models, opts, kl_ctl, engine = setup_rlhf(cfg, max_num_seqs=args.num_rollouts, algo=args.algo)
    table = [{**row, "output": "scalar (B,T), read at the last token: (B,)"} if row["model"] == "reward model"
             else row for row in models.table()]  # the reward model's one score per response
    print("   " + report.table(table).replace("\n", "\n   "))
    print(f"   C = {len(TOKENIZER.itos)}: the vocabulary size, one logit per token\n")
    printed.cut("models")
    sft_eval = evaluate_policy(engine, models.reward_model, args.eval_prompts, args.max_tokens)  # before training
    engine.reset_prefix_cache()

    # 1. one iteration, taken apart
    stats, batch = rlhf_iteration(engine, models, opts, kl_ctl, cfg, args.num_rollouts, args.max_tokens,
                                  seed=args.seed * 10_000, algo=args.algo)
    print_phases(batch, stats, args)
    plot_loop(batch, stats, args)
    gap = ((batch.engine_logprobs - batch.extra["logprobs"]).abs() * batch.mask).max().item()
    report.expect_close("engine log-probs vs the trainer's recomputation", gap, 0.0, atol=1e-4)
    print(f"   The engine's log-prob of each token it sampled, recomputed by the trainer with a plain forward: "
          f"max difference {gap:.1e} over {int(batch.mask.sum())} tokens.")
    printed.cut("phases")
    history = [stats]

    # 2. the loop
    from tqdm import tqdm

    control = "fixed beta"
    if args.kl_target:  # the controller's target and gain, so that --k-beta shows in the output
        control = f"adaptive beta, KL target {args.kl_target}, gain K_beta {args.k_beta}"
    print(f"\n2. {args.iterations} iterations of {args.num_rollouts} rollouts ({args.algo}, actor lr {args.actor_lr}, "
          f"{control}):")
    for i in tqdm(range(1, args.iterations), desc=args.algo, unit="it", leave=False, disable=None):  # on a tty
        stats, batch = rlhf_iteration(engine, models, opts, kl_ctl, cfg, args.num_rollouts, args.max_tokens,
                                      seed=args.seed * 10_000 + i, algo=args.algo)
        history.append(stats)
    every = max(1, args.iterations // 6)
    keys = ["reward", "rule_score", "valid", "kl", "kl_k3", "beta", "response_len"]
    rows = [{"iteration": i + 1, **{k: h[k] for k in keys}, "s/iter": h["generate_s"] + h["score_s"] + h["train_s"]}
            for i, h in enumerate(history) if i % every == 0 or i == len(history) - 1]
    print("   " + report.table(rows, floatfmt=".3f").replace("\n", "\n   "))
    plot_history(history, args)
    tail = history[-min(5, len(history)) :]
    final = {k: sum(h[k] for h in tail) / len(tail) for k in keys}
    print(f"   mean over the last {len(tail)} iterations: reward {history[0]['reward']:+.3f} -> "
          f"{final['reward']:+.3f}, "
          f"rule score {history[0]['rule_score']:.2f} -> {final['rule_score']:.2f}, response length "
          f"{history[0]['response_len']:.1f} -> {final['response_len']:.1f} tokens, KL {final['kl']:.2f} nats")
    printed.cut("loop")

    # 3. what the "human" says: the SFT model and the trained policy on the same fresh prompts
    final_eval = evaluate_policy(engine, models.reward_model, args.eval_prompts, args.max_tokens)
    hacking = print_hacking(sft_eval, final_eval, args)
    printed.cut("hacking")
    print_examples(sft_eval, final_eval)
    printed.cut("examples")
    checked, response, tensors = {}, {}, {}
    if args.algo == "ppo":
        print(f"\n   One response of iteration {len(history)}, token by token, with what its update used:")
        checked = anatomy(batch, stats, history[-1]["beta"])
        response = draw_response(batch, history[-1]["beta"], cfg, args)
        print(f"   its raw advantages A_t = sum_k lambda^k delta_(t+k) (checked), delta_t = r_t + V_(t+1) - V_t: "
              f"{response['sign_stretches']}; largest delta {response['delta_max']:+.3f} at t "
              f"{response['delta_max_t']} {response['delta_max_token']} (r_t {response['delta_max_reward']:+.3f}), "
              f"last delta = r_T - V_T {response['delta_last']:+.3f}; {response['whitened_negative']} of "
              f"{response['num_tokens']} negative after whitening\n   so: {response['signs_text']}")
        printed.cut("response")
        lengths = batch.mask.sum(1).long()
        B, L = batch.mask.shape
        print(f"\n4. The tensors of iteration {len(history)} (iteration.png): ids {tuple(batch.ids.shape)} (B, T); "
              f"per response token (B, L) = ({B}, {L}): engine and actor log-probs, reference log-probs, values, k1, "
              f"rewards, advantages, returns; scores ({B},). Responses of {int(lengths.min())} to "
              f"{int(lengths.max())} tokens, {int(lengths.sum())} real of the grid's {B * L} cells (the rest padding).")
        drawn = draw_iteration(batch, history[-1], len(history), args)
        printed.cut("tensors")
        tensors = {"iteration": len(history), "shapes": drawn["shapes"], "response_lengths": lengths.tolist(),
                   "prompt_lengths": batch.prompt_lens.tolist(), "ids": str(tuple(batch.ids.shape)),
                   "grid": str((B, L)), "scores": str(tuple(batch.extra["scores"].shape))}  # as the lesson quotes them
    if not args.smoke and args.iterations >= 10:  # a real run must learn: +0.3 reward-model std units
        report.expect_equal("mean reward rose by >= 0.3", final["reward"] - history[0]["reward"] >= 0.3, True)
    kl_above = sum(h["kl"] > args.kl_target for h in history[1:]) / max(1, len(history) - 1)
    if args.json:
        report.write_json(args.json, {"history": history, "final": final, "kl_above_target": kl_above,
                                      "hacking": hacking, "anatomy": checked,
                                      "response": response, "tensors": tensors, "printed": printed.parts}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
