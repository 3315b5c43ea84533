"""Chapter 13's preference task and its reward model: the rule a human would apply, the pairs it labels, and a
GPT trunk with a scalar head trained on those pairs with the Bradley-Terry loss.

    pairs = make_preference_pairs(2000, seed=0)        # (chosen, rejected) records for the same name
    rm = load_reward_model("draft")                      # trained on first use, cached in .cache/weights/
    rm.score(*encode_records([chosen, rejected]))        # one scalar per record, read at its last token

The task. A prompt is the start of a record, '{"name": "ada", '; the policy writes the rest. The "human"
preference is a rule anyone can read (`rule_score`): a malformed record loses to any well-formed one, and among
well-formed records, the one listing more languages wins. The reward model never sees the rule, only pairs
labelled by it, and learns a scalar score. `ScalarHeadModel` is also the critic's shape (a value per token), which
mlsys/rlhf.py builds from the same class.
"""

from __future__ import annotations

import copy
import random
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from mlsys.data import PEOPLE, Tokenizer, format_record, parse_record, sample_record
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

    Returns (model in eval mode, history: list of {step, loss, batch_accuracy}). Trains on one thread, whoever
    calls it: the thread count changes the order of float sums, so two threads (scripts/train_weights.py on a
    2-core machine) and one (chapter 13's reward_model.py) trained different weights under the same recipe, and
    the RLHF results built on them changed with whichever wrote the checkpoint last."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_reward_model(sft, recipe, progress)
    finally:
        torch.set_num_threads(threads)


def _train_reward_model(sft: GPT, recipe: RewardRecipe, progress: bool):
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
