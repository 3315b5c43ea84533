"""The work of chapter 14's RLHF placements, one piece per role, shared by the launcher version
(scripts/placement.py) and the Ray version (scripts/ray_placement.py): whichever process runs a piece, the same
seeded shard gives the same tokens and the same micro-batch the same scores.

    setup(role, seed)                   the models a process holds: 'all', 'trainer' or 'rollout'
    generate_shard(engine, args, it, s) shard s of iteration it's rollouts (its own seed)
    merge(shards)                       the shards, in order, as one batch
    score_micro_batch(models, b, a, m)  the reward, reference and critic forwards on micro-batch m
    train_on(models, ..., batch, extras) advantages and chapter 13's PPO step on the whole batch

`args` is any object with seed, num_rollouts, shards and max_tokens: PlacementSettings below, the flags both
scripts share (each script's Settings extends it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlsys import cli, rlhf
from mlsys.reward_model import load_reward_model

PLACEMENTS = ("colocated", "disaggregated", "async")
COMPUTE = ("generate", "score", "train")  # everything else a rank does is communication or waiting


@dataclass
class PlacementSettings(cli.DistArgs):
    """The flags both placement scripts take: the same task, so the same numbers wherever it runs (each script adds
    cli.PlotArgs for its figures)."""

    placements: list[str] = field(default_factory=lambda: list(PLACEMENTS))
    """Which to run: colocated, disaggregated, async."""
    iterations: int = 6
    """RLHF iterations (generate -> score -> train -> sync) per placement."""
    num_rollouts: int = 16
    """Responses per iteration (a multiple of 4 * --shards: groups of 4 per prompt)."""
    shards: int = 2
    """The batch is generated in this many seeded shards and scored in as many micro-batches, wherever it runs."""
    max_tokens: int = 72
    """Response length limit: chapter 13's, long enough for a whole record (45 to 65 tokens), so rule scores mean
    something; at 32 every response would be cut short and malformed."""
    bucket_mb: float = 1.0
    """Bucket size for the trainer -> rollout weight broadcast."""
    save_weights: str = ""
    """Save each placement's final actor weights as DIR/<placement>.pt (tests compare the two scripts' weights)."""

    def validate(self) -> None:
        if not self.placements or any(p not in PLACEMENTS for p in self.placements):
            raise cli.UsageError(f"--placements must name some of {PLACEMENTS}, got {self.placements}")
        if self.iterations < 2 or self.shards < 1 or self.max_tokens < 1 or not self.bucket_mb > 0:
            raise cli.UsageError("--iterations >= 2, --shards >= 1, --max-tokens >= 1, --bucket-mb > 0 required")
        if self.num_rollouts < 1 or self.num_rollouts % (4 * self.shards):
            raise cli.UsageError(f"--num-rollouts must be a positive multiple of 4 * --shards, got {self.num_rollouts}")


def holdings(**roles) -> dict:
    """What this rank holds: the parameters of each role's model, and all of them together with every distinct
    tensor counted once (a tied embedding once, a model that shares another's tensors not at all)."""
    seen = {}
    for m in roles.values():
        seen.update({p.data_ptr(): p.numel() for p in m.parameters()})
    per_role = {r: sum(p.numel() for p in m.parameters()) for r, m in roles.items()}
    return {"params": sum(seen.values()), "roles": per_role}


def setup(role: str, seed: int):
    """Models for a rank: 'all' (co-located), 'trainer' (four models, no engine) or 'rollout' (an engine only)."""
    from mlsys.engine import Engine, EngineConfig
    from mlsys.weights import load_pretrained

    torch.manual_seed(seed)
    sft = load_pretrained("draft")
    models = opts = kl_ctl = engine = None
    cfg = rlhf.PPOConfig()
    if role in ("all", "trainer"):
        models = rlhf.build_models(sft, load_reward_model("draft"))
        opts = rlhf.make_optimizers(models, cfg)
        kl_ctl = rlhf.AdaptiveKLController(cfg.beta, cfg.kl_target, cfg.k_beta)
    if role in ("all", "rollout"):
        engine = Engine(models.actor if models else sft, config=EngineConfig(max_num_seqs=64))
    return models, opts, kl_ctl, engine, cfg


# --8<-- [start:shards]
def shard_prompts(args, it: int) -> list[list[str]]:
    """Iteration it's prompts, cut into args.shards contiguous shards."""
    prompts = rlhf.grouped_prompts(args.num_rollouts, 4, seed=args.seed * 1000 + it)
    n = len(prompts) // args.shards
    return [prompts[i * n:(i + 1) * n] for i in range(args.shards)]


def generate_shard(engine, args, it: int, s: int) -> rlhf.RolloutBatch:
    """Shard s of iteration it, with a seed of its own: the same tokens on whichever rank generates it."""
    return rlhf.generate_rollouts(engine, shard_prompts(args, it)[s], args.max_tokens, temperature=1.0,
                                  seed=(args.seed * 1000 + it) * 64 + s)


def merge(batches: list[rlhf.RolloutBatch]) -> rlhf.RolloutBatch:
    """Shards -> one right-padded batch (token lists re-packed with rlhf.make_batch)."""
    prompts, responses, logps = [], [], []
    for b in batches:
        for i in range(b.ids.size(0)):
            p, n = int(b.prompt_lens[i]), int(b.mask[i].sum())
            prompts.append(b.ids[i, :p].tolist())
            responses.append(b.ids[i, p:p + n].tolist())
            logps.append(b.engine_logprobs[i, :n].tolist())
    return rlhf.make_batch(prompts, responses, logps, sum(b.generate_seconds for b in batches))


def rows(batch: rlhf.RolloutBatch, idx: list[int]) -> rlhf.RolloutBatch:
    return rlhf.RolloutBatch(batch.ids[idx], batch.prompt_lens[idx], batch.mask[idx],
                             [batch.texts[i] for i in idx], batch.engine_logprobs[idx])


def score_micro_batch(models, batch: rlhf.RolloutBatch, args, m: int) -> dict:
    """The three scoring forwards on micro-batch m (rows m*B/shards ...): the same shapes on every placement."""
    n = batch.ids.size(0) // args.shards
    return rlhf.score_rollouts(models, rows(batch, list(range(m * n, (m + 1) * n)))).extra


def train_on(models, opts, kl_ctl, cfg, batch: rlhf.RolloutBatch, extras: list[dict]) -> dict:
    """Concatenate the micro-batches' scores, then advantages and PPO on the whole batch (chapter 13's code)."""
    batch.extra = {k: torch.cat([e[k] for e in extras]) for k in extras[0]}
    rlhf.compute_advantages(batch, kl_ctl.beta, cfg)
    losses = rlhf.ppo_update(models, opts, batch, cfg, kl_ctl.beta)
    x = batch.extra
    kl = x["kl"]["k1"].sum(1).mean().item()
    gap = ((batch.engine_logprobs - x["logprobs"]) * batch.mask).sum() / batch.mask.sum()  # behaviour vs current
    kl_ctl.update(kl)
    return {"reward": x["scores"].mean().item(), "rule_score": x["rule_scores"].mean().item(), "kl": kl,
            "valid": (x["rule_scores"] > 0).float().mean().item(),  # share of well-formed records
            "off_policy_gap": gap.item(), "clip_frac": losses.get("clip_frac", 0.0)}
# --8<-- [end:shards]
