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

The task. A prompt is the start of a record, '{"name": "ada", '; the policy writes the rest. The "human"
preference is a rule anyone can read (`rule_score`): a malformed record loses to any well-formed one, and among
well-formed records, the one listing more languages wins. The reward model never sees the rule, only pairs
labelled by it, and learns a scalar score with the Bradley-Terry loss.

Tensor layout. A rollout batch keeps whole sequences `ids` (B, T) = <bos> prompt response [<eos>], right-padded.
Everything per action (log-probabilities, values, KL, rewards, advantages) lives on a response-aligned grid
(B, L): column j is response token j of that row, whatever the row's prompt length, and `mask` (B, L) marks the
real tokens. `response_positions` maps the grid back into the sequence.
"""

from __future__ import annotations

import copy
import json
import random
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from mlsys.data import MAX_LANGS, PEOPLE, Tokenizer, format_record, parse_record, sample_record
from mlsys.model import GPT, GPTConfig

TOKENIZER = Tokenizer()


# ------------------------------------------------------------------ the task


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """n prompts '{"name": "<name>", ' with names drawn uniformly (seeded)."""
    rng = random.Random(seed)
    names = sorted(PEOPLE)
    return ['{"name": "' + rng.choice(names) + '", ' for _ in range(n)]


# --8<-- [start:rule]
def rule_score(text: str) -> int:
    """The preference rule the reward model learns: 0 for a malformed record, else its number of languages.

    Any well-formed record beats any malformed one; between two well-formed records, more languages win.
    """
    record = parse_record(text)
    return 0 if record is None else len(record["langs"])
# --8<-- [end:rule]


def _truncate(text: str, rng: random.Random) -> str:
    """A malformed record: cut short somewhere after the name, as a response that ran out of tokens is."""
    prompt_end = text.index(", ") + 2  # '{"name": "ada", ' is the prompt: cut after it
    return text[: rng.randrange(prompt_end + 1, len(text) - 1)]


def sample_candidate(name: str, rng: random.Random) -> str:
    """One record for `name`: well formed with 1-3 languages (3/4 of the time) or malformed."""
    record = sample_record(rng)
    record["name"], record["city"] = name, PEOPLE[name].city
    record["age"] = PEOPLE[name].decade + rng.randint(0, 9)
    text = format_record(record)
    return text if rng.random() < 0.75 else _truncate(text, rng)


def make_preference_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """n (chosen, rejected) pairs of records for the same name, labelled by `rule_score` (ties dropped)."""
    rng, names, pairs = random.Random(seed), sorted(PEOPLE), []
    while len(pairs) < n:
        name = rng.choice(names)
        a, b = sample_candidate(name, rng), sample_candidate(name, rng)
        if rule_score(a) != rule_score(b):
            pairs.append((a, b) if rule_score(a) > rule_score(b) else (b, a))
    return pairs


# ---------------------------------------------------------------- the models


def hidden_states(gpt: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The trunk of the GPT: idx (B, T) -> final hidden states (B, T, C), before the LM head."""
    pos = torch.arange(idx.size(1), device=idx.device)  # (T,)
    x = gpt.drop(gpt.embed(idx, pos)[0])  # (B, T, C)
    for block in gpt.h:
        x = block(x)
    return gpt.ln_f(x)  # (B, T, C)


# --8<-- [start:scalar_head]
class ScalarHeadModel(nn.Module):
    """A GPT trunk with a scalar head: the reward model (read at the last token) and the critic (every token)."""

    def __init__(self, trunk: GPT):
        super().__init__()
        self.trunk = trunk
        self.config = trunk.config
        self.head = nn.Linear(trunk.config.n_embd, 1)
        nn.init.zeros_(self.head.weight)  # start at 0 everywhere: no made-up preferences or values
        nn.init.zeros_(self.head.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) -> one scalar per position (B, T)."""
        return self.head(hidden_states(self.trunk, idx)).squeeze(-1)

    def score(self, idx: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The reward model's use: the scalar at each row's last real token, idx[b, lengths[b] - 1] -> (B,)."""
        out = self(idx)  # (B, T)
        return out.gather(1, (lengths - 1)[:, None]).squeeze(1)
# --8<-- [end:scalar_head]


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
                         "output": "logits (B,T,V)" if isinstance(m, GPT) else "scalar (B,T)",
                         "trained in RLHF": "yes" if trainable else "frozen"})
        return rows


def build_models(sft: GPT, reward_model: ScalarHeadModel, with_critic: bool = True) -> Models:
    """Actor and reference are copies of the SFT model; the critic gets its trunk and a fresh head."""
    reference = copy.deepcopy(sft).eval().requires_grad_(False)
    reward_model = reward_model.eval().requires_grad_(False)
    actor = copy.deepcopy(sft).train().requires_grad_(True)
    critic = ScalarHeadModel(copy.deepcopy(sft)).train().requires_grad_(True) if with_critic else None
    return Models(actor, critic, reward_model, reference)


# ------------------------------------------------------------ reward model


def encode_records(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Records -> ids (B, T) '<bos> text <eos>' right-padded with <pad>, and lengths (B,)."""
    seqs = [TOKENIZER.encode(t, bos=True, eos=True) for t in texts]
    lengths = torch.tensor([len(s) for s in seqs])
    ids = torch.full((len(seqs), int(lengths.max())), TOKENIZER.pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    return ids, lengths


# --8<-- [start:bradley_terry]
def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(r_chosen - r_rejected), averaged: the negative log-likelihood of the human's choice
    under the Bradley-Terry model P(a beats b) = sigmoid(r_a - r_b) (InstructGPT, arXiv:2203.02155, eq. 1)."""
    return -F.logsigmoid(r_chosen - r_rejected).mean()
# --8<-- [end:bradley_terry]


def pair_scores(rm: ScalarHeadModel, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward-model scores of the chosen and the rejected side of each pair, (P,) each (one forward)."""
    ids, lengths = encode_records([c for c, _ in pairs] + [r for _, r in pairs])
    scores = rm.score(ids, lengths)  # (2P,)
    return scores[: len(pairs)], scores[len(pairs) :]


@torch.no_grad()
def pairwise_accuracy(rm: ScalarHeadModel, pairs: list[tuple[str, str]], batch_size: int = 256) -> float:
    """Fraction of pairs where the reward model scores the chosen record higher."""
    wins = 0
    for i in range(0, len(pairs), batch_size):
        chosen, rejected = pair_scores(rm, pairs[i : i + batch_size])
        wins += int((chosen > rejected).sum())
    return wins / len(pairs)


@dataclass(frozen=True)
class RewardRecipe:
    """How the cached reward model is trained (`train_reward_model`'s arguments)."""

    num_pairs: int = 2000
    steps: int = 100
    batch_size: int = 32
    lr: float = 1e-3
    seed: int = 0
    data_version: int = 5  # bump when make_preference_pairs changes: the cached model is then retrained


def train_reward_model(sft: GPT, recipe: RewardRecipe = RewardRecipe(), progress: bool = False):
    """A ScalarHeadModel on a copy of `sft`, trained with the Bradley-Terry loss on rule-labelled pairs.

    Returns (model in eval mode, history: list of {step, loss, batch_accuracy})."""
    torch.manual_seed(recipe.seed)
    rm = ScalarHeadModel(copy.deepcopy(sft)).train().requires_grad_(True)
    pairs = make_preference_pairs(recipe.num_pairs, seed=recipe.seed)
    opt = torch.optim.AdamW(rm.parameters(), lr=recipe.lr, weight_decay=0.0)
    rng, history = random.Random(recipe.seed), []
    steps = range(recipe.steps)
    if progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc="reward model", unit="step", leave=False, disable=None)  # None: on a terminal only
    for step in steps:
        batch = rng.sample(pairs, recipe.batch_size)
        chosen, rejected = pair_scores(rm, batch)  # (P,), (P,)
        loss = bradley_terry_loss(chosen, rejected)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        history.append({"step": step, "loss": loss.item(), "batch_accuracy": (chosen > rejected).float().mean().item()})
    normalize_reward_model(rm.eval(), [t for pair in make_preference_pairs(250, seed=recipe.seed + 1) for t in pair])
    return rm, history


@torch.no_grad()
def normalize_reward_model(rm: ScalarHeadModel, texts: list[str]) -> tuple[float, float]:
    """Rescale the head so that scores on `texts` have mean 0 and std 1: a Bradley-Terry model fixes only
    differences of scores, so the offset and scale are free; fixing them makes the KL coefficient beta mean the
    same thing on every run. Returns the old (mean, std). (Ziegler et al., arXiv:1909.08593, normalise too, but on
    responses the pretrained policy samples for the task's prompts; the book uses held-out rule-labelled records.)"""
    ids, lengths = encode_records(texts)
    scores = rm.score(ids, lengths)  # (N,)
    mean, std = scores.mean().item(), scores.std().item()
    rm.head.weight /= std
    rm.head.bias.sub_(mean).div_(std)
    return mean, std


def reward_model_path(name: str = "draft"):
    from mlsys.weights import cache_dir

    return cache_dir() / "weights" / f"reward-{name}.pt"


def load_reward_model(name: str = "draft", recipe: RewardRecipe = RewardRecipe()) -> ScalarHeadModel:
    """The reward model on the `name` trunk, trained on first use and cached next to the GPT checkpoints."""
    import sys

    from mlsys.weights import load_pretrained, save_checkpoint

    path = reward_model_path(name)
    if path.exists():
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if payload["meta"].get("recipe") == asdict(recipe):
            rm = ScalarHeadModel(GPT(GPTConfig(**payload["config"])))
            rm.load_state_dict(payload["state_dict"])
            return rm.eval().requires_grad_(False)
    print(f"mlsys: no {path} for this recipe; training the reward model ({recipe.steps} steps), saving it there",
          file=sys.stderr)
    rm, history = train_reward_model(load_pretrained(name), recipe, progress=True)
    save_checkpoint(path, rm, {"recipe": asdict(recipe), "final_loss": history[-1]["loss"]})
    return rm.requires_grad_(False)


# ---------------------------------------------------------------- log-probs


def token_logprobs(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """log pi(ids[:, t+1] | ids[:, :t+1]) for every t: (B, T) -> (B, T-1). One plain forward."""
    logits, _ = model(ids)  # (B, T, V)
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
    """The three forward passes after generation: actor and reference log-probs, critic values, RM score."""
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
    """One iteration: generate (engine) -> score (3 forwards) -> advantages -> update -> push weights."""
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
