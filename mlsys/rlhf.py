"""The RLHF computation flow on the tiny GPT: four models, a readable preference rule, rollouts, KL, PPO.

Chapter 13 teaches these pieces one at a time; chapter 14 places the same pieces on different processes
(co-located vs disaggregated), so everything a placement needs lives here:

    cfg = PPOConfig()                                                  # beta, KL target, lr, clip, ...
    models, opts, kl_ctl, engine = setup_rlhf(cfg, max_num_seqs=32)     # actor, critic, reward model, reference
    stats, batch = rlhf_iteration(engine, models, opts, kl_ctl, cfg, num_rollouts=32, max_tokens=72, seed=0)

or phase by phase, as a placement that splits them needs:

    batch = generate_rollouts(engine, grouped_prompts(32, cfg.group_size, seed=0), max_tokens=72)  # generate
    score_rollouts(models, batch)                                # actor, reference, critic, reward model forwards
    compute_advantages(batch, kl_ctl.beta, cfg)                  # KL-shaped rewards, GAE over tokens
    ppo_update(models, opts, batch, cfg, kl_ctl.beta)            # PPO epochs on actor and critic
    engine.load_weights(models.actor.state_dict())               # the new policy serves the next rollouts

The task and the reward model (the preference rule, the pairs it labels, the Bradley-Terry training) live in
mlsys/reward_model.py; this module takes the trained reward model as one of its four models.

Tensor layout. A rollout batch keeps whole sequences `ids` (B, T) = <bos> prompt response [<eos>], right-padded.
Everything per action (log-probabilities, values, KL, rewards, advantages) lives on a response-aligned grid
(B, L): column j is response token j of that row, whatever the row's prompt length, and `mask` (B, L) marks the
real tokens. `response_positions` maps the grid back into the sequence.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from mlsys.data import MAX_LANGS
from mlsys.model import GPT
from mlsys.reward_model import TOKENIZER, ScalarHeadModel, load_reward_model, make_prompts, rule_score

# ---------------------------------------------------------------- the models


@dataclass
class Models:
    """The four models of PPO-based RLHF. Only actor and critic are trained; the other two are frozen."""

    actor: GPT  # the policy pi_theta, initialised from the SFT model
    critic: ScalarHeadModel | None  # V(s_t) per token, trunk from the SFT model, head from zero; None for GRPO
    reward_model: ScalarHeadModel  # r(prompt, response), trained once on preference pairs, then frozen
    reference: GPT  # pi_ref: a frozen copy of the SFT model, the anchor of the KL penalty

    def table(self) -> list[dict]:
        rows = []
        for name, m in (("actor", self.actor), ("critic", self.critic), ("reward model", self.reward_model),
                        ("reference", self.reference)):
            if m is None:
                continue
            trainable = any(p.requires_grad for p in m.parameters())
            rows.append({"model": name, "params": sum(p.numel() for p in m.parameters()),
                         "output": "logits (B,T,C)" if isinstance(m, GPT) else "scalar (B,T)",
                         "trained in RLHF": "yes" if trainable else "frozen"})
        return rows


def build_models(sft: GPT, reward_model: ScalarHeadModel, with_critic: bool = True) -> Models:
    """Actor and reference are copies of the SFT model; the critic gets its trunk and a fresh head."""
    reference = copy.deepcopy(sft).eval().requires_grad_(False)
    reward_model = reward_model.eval().requires_grad_(False)
    actor = copy.deepcopy(sft).train().requires_grad_(True)
    critic = ScalarHeadModel(copy.deepcopy(sft)).train().requires_grad_(True) if with_critic else None
    return Models(actor, critic, reward_model, reference)


# ---------------------------------------------------------------- log-probs


def token_logprobs(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """log pi(ids[:, t+1] | ids[:, :t+1]) for every t: (B, T) -> (B, T-1). One plain forward."""
    logits, _ = model(ids)  # (B, T, C), C the vocabulary size
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V): position t predicts token t+1
    return logp.gather(2, ids[:, 1:, None]).squeeze(2)  # (B, T-1)


def response_positions(prompt_lens: torch.Tensor, L: int) -> torch.Tensor:
    """(B,) prompt lengths -> (B, L) index into the (B, T-1) next-token grid: response token j of row b is
    ids[b, prompt_len + j], predicted at position prompt_len + j - 1."""
    return prompt_lens[:, None] - 1 + torch.arange(L)[None, :]


def gather_response(grid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B, T-1) per-position values -> (B, L) per-response-token values (positions clamped; mask the pad)."""
    return grid.gather(1, positions.clamp(max=grid.size(1) - 1))


# ------------------------------------------------------------ KL estimators


# --8<-- [start:kl]
def kl_estimators(logp: torch.Tensor, ref_logp: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token estimators of KL(pi || pi_ref) from tokens SAMPLED FROM pi, with log r = log pi_ref - log pi.

    k1 = -log r              unbiased, but single samples are often negative
    k2 = (log r)^2 / 2        biased, always >= 0, low variance
    k3 = (r - 1) - log r      unbiased (E_pi[r] = 1) and always >= 0 (e^x >= 1 + x)
    (J. Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html)
    """
    log_r = ref_logp - logp
    return {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": torch.expm1(log_r) - log_r}
# --8<-- [end:kl]


# --8<-- [start:shaping]
def shape_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-token rewards (B, L): -beta * kl_t on every response token, plus the reward model's score (B,)
    on each row's last token. Summed over a row: score - beta * sum_t kl_t (Ziegler et al., arXiv:1909.08593)."""
    rewards = -beta * kl * mask  # (B, L)
    last = mask.long().sum(1) - 1  # (B,) index of the final response token
    return rewards.scatter_add(1, last[:, None], scores[:, None].to(rewards.dtype))
# --8<-- [end:shaping]


# --8<-- [start:kl_controller]
class AdaptiveKLController:
    """beta <- beta * (1 + k_beta * clip(KL / target - 1, -0.2, 0.2)): raise the penalty when the policy drifts
    past the target KL, lower it when it stays closer (Ziegler et al., arXiv:1909.08593, section 2.2)."""

    def __init__(self, beta: float, target: float | None, k_beta: float = 0.1):
        self.beta, self.target, self.k_beta = beta, target, k_beta

    def update(self, kl: float) -> float:
        if self.target is not None:  # target None: a fixed beta
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.beta *= 1.0 + self.k_beta * error
        return self.beta
# --8<-- [end:kl_controller]


# ---------------------------------------------------------------- rollouts


@dataclass
class RolloutBatch:
    """Prompts and sampled responses as one right-padded batch, plus what scoring adds."""

    ids: torch.Tensor  # (B, T) <bos> prompt response, padded with <pad>
    prompt_lens: torch.Tensor  # (B,) tokens before the response (<bos> included)
    mask: torch.Tensor  # (B, L) float, 1 on real response tokens
    texts: list[str]  # prompt + response text (what rule_score reads)
    engine_logprobs: torch.Tensor  # (B, L) log-prob of each sampled token as the engine computed it
    generate_seconds: float = 0.0
    extra: dict = field(default_factory=dict)  # filled by score_rollouts: logprobs, ref_logprobs, values, scores

    @property
    def lengths(self) -> torch.Tensor:  # (B,) tokens per full sequence
        return self.prompt_lens + self.mask.long().sum(1)

    @property
    def positions(self) -> torch.Tensor:  # (B, L) response token j -> column in the (B, T-1) grid
        return response_positions(self.prompt_lens, self.mask.size(1))


# --8<-- [start:generate]
@torch.no_grad()
def generate_rollouts(engine, prompts: list[str], max_tokens: int, temperature: float = 1.0,
                      seed: int = 0) -> RolloutBatch:
    """Sample one response per prompt with the inference engine (continuous batching, paged KV cache),
    recording the log-prob of every sampled token under the distribution the engine sampled from."""
    from mlsys.engine import SamplingParams

    t0 = time.perf_counter()
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed * 1_000_003 + i,
                             logprobs=True) for i in range(len(prompts))]
    outs = engine.generate(prompts, params)  # final outputs in prompt order; out.logprobs aligns with token_ids
    return make_batch([o.prompt_token_ids for o in outs], [o.token_ids for o in outs],
                      [o.logprobs for o in outs], time.perf_counter() - t0)
# --8<-- [end:generate]


def make_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], logprobs: list[list[float]] | None = None,
               seconds: float = 0.0) -> RolloutBatch:
    """Token lists -> a padded RolloutBatch."""
    B, L = len(prompt_ids), max(len(r) for r in response_ids)
    T = max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids))
    ids = torch.full((B, T), TOKENIZER.pad_id, dtype=torch.long)
    mask, lp = torch.zeros(B, L), torch.zeros(B, L)
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        mask[b, : len(r)] = 1.0
        if logprobs is not None:
            lp[b, : len(r)] = torch.tensor(logprobs[b])
    texts = [TOKENIZER.decode(p + r) for p, r in zip(prompt_ids, response_ids)]
    return RolloutBatch(ids, torch.tensor([len(p) for p in prompt_ids]), mask, texts, lp, seconds)


# --8<-- [start:score]
@torch.no_grad()
def score_rollouts(models: Models, batch: RolloutBatch) -> RolloutBatch:
    """The four forward passes after generation, one per model: actor and reference log-probs, critic values, and
    the reward model's score (three for GRPO, which has no critic)."""
    pos = batch.positions  # (B, L)
    batch.extra["logprobs"] = gather_response(token_logprobs(models.actor, batch.ids), pos)  # (B, L) old logp
    batch.extra["ref_logprobs"] = gather_response(token_logprobs(models.reference, batch.ids), pos)  # (B, L)
    if models.critic is not None:  # GRPO has none
        batch.extra["values"] = gather_response(models.critic(batch.ids)[:, :-1], pos) * batch.mask  # (B, L)
    batch.extra["scores"] = models.reward_model.score(batch.ids, batch.lengths)  # (B,) at the last token
    batch.extra["rule_scores"] = torch.tensor([float(rule_score(t)) for t in batch.texts])  # the "human", for plots
    return batch
# --8<-- [end:score]


# ------------------------------------------------------ advantages and PPO


@dataclass
class PPOConfig:
    """The knobs of one RLHF iteration (defaults suit the tiny task; see chapter 13)."""

    beta: float = 0.1  # initial KL coefficient
    kl_target: float | None = 1.0  # nats per response; None = fixed beta
    k_beta: float = 0.5  # adaptive controller gain per iteration
    gamma: float = 1.0  # no discount inside one response
    lam: float = 0.95  # GAE lambda
    clip_eps: float = 0.2  # PPO ratio clip
    vf_clip: float = 0.2  # value clip around the rollout's values
    ppo_epochs: int = 2  # passes over the rollout batch
    num_minibatches: int = 2
    actor_lr: float = 3e-4
    critic_lr: float = 1e-3
    max_grad_norm: float = 1.0
    group_size: int = 4  # GRPO: responses per prompt (PPO uses the same prompts)


# --8<-- [start:gae]
def token_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """GAE over the response tokens of each row: rewards, values, mask (B, L) -> advantages, returns (B, L).

    Each response is one episode; its last token is terminal (the value after it is 0). The rows are handed
    to chapter 12's `compute_gae` time-major, (L, B), with done=1 on each row's final token."""
    from mlsys import rl

    last = mask.long().sum(1) - 1  # (B,)
    dones = torch.zeros_like(mask).scatter(1, last[:, None], 1.0)  # (B, L)
    adv, ret = rl.compute_gae(rewards.T, (values * mask).T, dones.T, torch.zeros(mask.size(0)), gamma, lam)
    return adv.T * mask, ret.T * mask  # back to (B, L); padding zeroed
# --8<-- [end:gae]


# --8<-- [start:grpo_advantages]
def group_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's baseline: each response's score minus its group's mean, over the group's std (DeepSeekMath,
    arXiv:2402.03300, section 4.1.2). scores (B,) with groups of `group_size` adjacent rows -> (B,)."""
    g = scores.view(-1, group_size)  # (B/G, G): one row per prompt
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + eps)).view(-1)
# --8<-- [end:grpo_advantages]


def compute_advantages(batch: RolloutBatch, beta: float, cfg: PPOConfig, algo: str = "ppo") -> RolloutBatch:
    """PPO: KL-shaped per-token rewards, then GAE with the critic. GRPO: the group-normalised score on every
    token (no critic; the KL goes into the loss instead, see `ppo_update`)."""
    from mlsys import rl

    x, mask = batch.extra, batch.mask
    x["kl"] = {k: v * mask for k, v in kl_estimators(x["logprobs"], x["ref_logprobs"]).items()}  # (B, L) each
    if algo == "grpo":
        x["advantages"] = group_advantages(x["scores"], cfg.group_size)[:, None] * mask  # (B, L)
        return batch
    x["rewards"] = shape_rewards(x["scores"], x["kl"]["k1"], mask, beta)  # (B, L)
    adv, x["returns"] = token_gae(x["rewards"], x["values"], mask, cfg.gamma, cfg.lam)
    x["advantages"] = rl.masked_whiten(adv, mask) * mask
    return batch


# --8<-- [start:ppo_update]
def ppo_update(models: Models, opts: dict, batch: RolloutBatch, cfg: PPOConfig, beta: float,
               algo: str = "ppo", seed: int = 0) -> dict:
    """Some epochs of clipped PPO over minibatches of the rollout batch; returns mean loss statistics."""
    from mlsys import rl

    x, B = batch.extra, batch.ids.size(0)
    stats: dict[str, list[float]] = {"policy_loss": [], "value_loss": [], "clip_frac": []}
    gen = torch.Generator().manual_seed(seed)  # minibatch order
    for _ in range(cfg.ppo_epochs):
        for mb in torch.randperm(B, generator=gen).chunk(cfg.num_minibatches):
            ids, pos, mask = batch.ids[mb], batch.positions[mb], batch.mask[mb]
            ids = ids[:, : int(batch.lengths[mb].max())]  # drop all-padding columns
            logp = gather_response(token_logprobs(models.actor, ids), pos)  # (b, L) with grad
            loss, pstats = rl.ppo_policy_loss(logp, x["logprobs"][mb], x["advantages"][mb], cfg.clip_eps, mask)
            if algo == "grpo":  # GRPO: k3 KL to the reference in the loss, not in the reward
                k3 = kl_estimators(logp, x["ref_logprobs"][mb])["k3"]
                loss = loss + beta * rl.masked_mean(k3, mask)
            _step(opts["actor"], models.actor, loss, cfg.max_grad_norm)
            stats["policy_loss"].append(loss.item())
            stats["clip_frac"].append(pstats["clip_frac"])
            if algo == "ppo":
                values = gather_response(models.critic(ids)[:, :-1], pos)  # (b, L) with grad
                vloss = rl.ppo_value_loss(values, x["values"][mb], x["returns"][mb], cfg.vf_clip, mask)
                _step(opts["critic"], models.critic, vloss, cfg.max_grad_norm)
                stats["value_loss"].append(vloss.item())
    return {k: sum(v) / len(v) for k, v in stats.items() if v}
# --8<-- [end:ppo_update]


def _step(opt: torch.optim.Optimizer, model: nn.Module, loss: torch.Tensor, max_grad_norm: float) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()


def make_optimizers(models: Models, cfg: PPOConfig) -> dict:
    opts = {"actor": torch.optim.Adam(models.actor.parameters(), lr=cfg.actor_lr)}
    if models.critic is not None:
        opts["critic"] = torch.optim.Adam(models.critic.parameters(), lr=cfg.critic_lr)
    return opts


def grouped_prompts(num_rollouts: int, group_size: int, seed: int) -> list[str]:
    """num_rollouts prompts: num_rollouts / group_size distinct ones, each repeated group_size times."""
    return [p for p in make_prompts(num_rollouts // group_size, seed) for _ in range(group_size)]


# --8<-- [start:iteration]
def rlhf_iteration(engine, models: Models, opts: dict, kl_ctl: AdaptiveKLController, cfg: PPOConfig,
                   num_rollouts: int, max_tokens: int, seed: int, algo: str = "ppo") -> tuple[dict, RolloutBatch]:
    """One iteration: generate (engine) -> score (4 forwards; 3 for GRPO) -> advantages -> update -> push weights."""
    t = {"start": time.perf_counter()}
    prompts = grouped_prompts(num_rollouts, cfg.group_size, seed)
    batch = generate_rollouts(engine, prompts, max_tokens, temperature=1.0, seed=seed)
    t["generate"] = time.perf_counter()
    score_rollouts(models, batch)
    compute_advantages(batch, kl_ctl.beta, cfg, algo)
    t["score"] = time.perf_counter()
    losses = ppo_update(models, opts, batch, cfg, kl_ctl.beta, algo, seed)
    t["train"] = time.perf_counter()
    engine.load_weights(models.actor.state_dict())  # the next rollouts come from the new policy
    t["sync"] = time.perf_counter()
    x = batch.extra
    kl_seq = x["kl"]["k1"].sum(1).mean().item()  # KL per response (sum over its tokens), averaged
    stats = {
        "reward": x["scores"].mean().item(), "rule_score": x["rule_scores"].mean().item(),
        "valid": (x["rule_scores"] > 0).float().mean().item(), "kl": kl_seq,
        "kl_k3": x["kl"]["k3"].sum(1).mean().item(), "beta": kl_ctl.beta,
        "response_len": batch.mask.sum(1).mean().item(), **losses,
        **{f"{k}_s": t[k] - t[prev] for prev, k in zip(["start", "generate", "score", "train"],
                                                       ["generate", "score", "train", "sync"])},
    }
    kl_ctl.update(kl_seq)  # the controller reacts to the KL this batch measured
    return stats, batch
# --8<-- [end:iteration]


# ------------------------------------------------------------ evaluation


KINDS = ("well_formed", "four_plus_langs", "repeated_lang", "not_json", "other")


def response_kind(text: str) -> str:
    """Why the rule scores a record as it does: 'well_formed', or the way it is malformed -- 'four_plus_langs',
    'repeated_lang' (both parse as JSON: the hacks the reward model was never shown), 'not_json' (cut short by
    the token limit or broken syntax) or 'other' (JSON that breaks the schema some other way: a misspelt city)."""
    if rule_score(text) > 0:
        return "well_formed"
    try:
        record = json.loads(text)
    except ValueError:
        return "not_json"
    langs = record.get("langs") if isinstance(record, dict) else None
    if isinstance(langs, list) and len(langs) > MAX_LANGS:
        return "four_plus_langs"
    if isinstance(langs, list) and len({str(x) for x in langs}) < len(langs):
        return "repeated_lang"
    return "other"


# --8<-- [start:evaluate]
@torch.no_grad()
def evaluate_policy(engine, reward_model: ScalarHeadModel, num_prompts: int = 128, max_tokens: int = 72,
                    seed: int = 999_999) -> dict:
    """One sampled response (temperature 1) to each of `num_prompts` prompts drawn with their own `seed`, judged
    by the rule (the "human") and by the reward model. The same seed gives the same prompts and sampling seeds,
    so two policies (the SFT model, the trained actor) are compared on identical prompts."""
    batch = generate_rollouts(engine, make_prompts(num_prompts, seed), max_tokens, temperature=1.0, seed=seed)
    rule = torch.tensor([float(rule_score(t)) for t in batch.texts])  # (N,)
    scores = reward_model.score(batch.ids, batch.lengths)  # (N,)
    kinds = [response_kind(t) for t in batch.texts]
    valid = rule > 0
    hacks = torch.tensor([k in ("four_plus_langs", "repeated_lang") for k in kinds])

    def mean(sel: torch.Tensor) -> float:
        return scores[sel].mean().item() if sel.any() else float("nan")

    return {"prompts": num_prompts, "rule_score": rule.mean().item(), "valid": valid.float().mean().item(),
            "reward": scores.mean().item(), "reward_valid": mean(valid), "reward_malformed": mean(~valid),
            "reward_hacks": mean(hacks), "hacks": int(hacks.sum()), "malformed": int((~valid).sum()),
            "malformed_above_valid": int(((scores > mean(valid)) & ~valid).sum()),  # beat the mean valid record
            "kinds": {k: kinds.count(k) for k in KINDS},
            "texts": batch.texts, "scores": scores.tolist()}
# --8<-- [end:evaluate]


def setup_rlhf(cfg: PPOConfig, max_num_seqs: int, name: str = "draft", algo: str = "ppo"):
    """Everything one RLHF run holds: (models, optimizers, KL controller, an Engine serving the actor).
    The SFT model is `load_pretrained(name)`; the reward model `load_reward_model(name)`; GRPO gets no critic."""
    from mlsys.engine import Engine, EngineConfig
    from mlsys.weights import load_pretrained

    models = build_models(load_pretrained(name), load_reward_model(name), with_critic=algo == "ppo")
    engine = Engine(models.actor, config=EngineConfig(max_num_seqs=max_num_seqs))
    return models, make_optimizers(models, cfg), AdaptiveKLController(cfg.beta, cfg.kl_target, cfg.k_beta), engine
