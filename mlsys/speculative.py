"""Speculative decoding: a small draft model guesses k tokens, the target checks them in one forward pass.

    from mlsys.speculative import speculative_generate
    out = speculative_generate(target, draft, prompt_ids, max_new_tokens=64, k=4)   # greedy
    out.token_ids, out.stats.acceptance_rate, out.stats.tokens_per_step

One step, with the sequence x of length n and both KV caches holding positions 0..n-2 (the last token is
"pending": written into the cache by the next forward that reads it):

    draft   x[n-1] -> d1 -> d2 -> ... -> dk          k small forwards, one token each (autoregressive)
    target  [x[n-1], d1, ..., dk]  ->  logits (k+1, V)  ONE forward; row i predicts the token after d1..di
    verify  accept d1..dj (the longest run the target agrees with), then append one target token:
            the correction at the first disagreement, or the "bonus" token from row k when all k pass
    rollback  both caches keep positions 0..n+j-1; the entries of rejected drafts are simply left behind:
            the contiguous cache is truncated by moving its length back (`cache_len`), and the next forward
            overwrites them (attention only reads positions < its own end, see `mlsys.model.KVCache.update`)

So every step emits between 1 and k+1 tokens for one target forward. In greedy mode "agree" means the draft's
token is the target's argmax, and the output is token for token the target's own greedy decoding. In sampling
mode the acceptance rule keeps the target's distribution exactly (`verify_sampled`):

    accept d_i with probability min(1, p_i(d_i) / q_i(d_i));  at the first rejection draw from
    normalize(max(0, p_i - q_i)); when all k pass, draw the bonus token from p_k.

"Fast Inference from Transformers via Speculative Decoding" (Leviathan, Kalman, Matias 2022),
https://arxiv.org/abs/2211.17192, and "Accelerating Large Language Model Decoding with Speculative Sampling"
(Chen et al. 2023), https://arxiv.org/abs/2302.01318. If each draft is accepted with probability alpha
independently, one step emits (1 - alpha^(k+1)) / (1 - alpha) tokens on average (Leviathan et al., eq. 1):
`expected_tokens_per_step`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mlsys.model import GPT


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """E[tokens per step] = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha); k+1 when alpha = 1."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def chi_square(counts, probs, significance: float = 1e-3) -> tuple[float, float]:
    """Pearson's statistic of observed counts against probabilities, and its critical value at `significance`.

    Cells expected to hold fewer than 5 are pooled (into one cell, or into the last if still under 5). A count in a
    cell of probability 0 cannot happen under `probs`: the statistic is then infinite (pooling would hide it). The
    quantile of chi2(df) uses the Wilson-Hilferty approximation df * (1 - 2/(9 df) + z sqrt(2/(9 df)))^3
    (accurate to about 1% for df >= 3), so no scipy is needed."""
    counts, probs = [float(c) for c in counts], [float(p) for p in probs]
    n = sum(counts)
    cells, rest_o, rest_e = [], 0.0, 0.0
    for o, p in zip(counts, probs):
        if n * p >= 5:
            cells.append((o, n * p))
        else:
            rest_o, rest_e = rest_o + o, rest_e + n * p
    if rest_e >= 5 or (rest_e > 0 and not cells):
        cells.append((rest_o, rest_e))
    elif rest_e > 0:  # still too thin: fold it into the last cell
        cells[-1] = (cells[-1][0] + rest_o, cells[-1][1] + rest_e)
    impossible = any(o > 0 and p == 0 for o, p in zip(counts, probs))
    stat = math.inf if impossible else sum((o - e) ** 2 / e for o, e in cells)
    df = max(len(cells) - 1, 1)
    z = statistics.NormalDist().inv_cdf(1 - significance)
    return stat, df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


# --8<-- [start:verify]
def verify_greedy(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int]:
    """target_logits (k+1, V), drafts (k,) -> (j accepted drafts, the target's token after them).

    Row i of target_logits is the target's prediction after drafts[:i]; accept while argmax == draft."""
    choice = target_logits.argmax(dim=-1)  # (k+1,)
    agree = (choice[:-1] == drafts).long()  # (k,)
    j = int(agree.cumprod(0).sum())  # length of the agreeing prefix
    return j, int(choice[j])  # the correction at the first disagreement, or the bonus token (j == k)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) over the last dim: where a rejected token is redrawn from."""
    r = (p - q).clamp_min(0.0)
    total = r.sum(dim=-1, keepdim=True)
    # p == q makes r all zero; that case is never reached (acceptance is certain), but keep it finite
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


def verify_sampled(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                   generator: torch.Generator | None = None) -> tuple[int, int]:
    """p (k+1, V) target probabilities, q (k, V) draft probabilities, drafts (k,) drawn from q.

    Returns (j accepted drafts, the next token): drafts[i] is accepted with probability
    min(1, p_i(d)/q_i(d)); at the first rejection the next token comes from residual(p_i, q_i), and when all
    k are accepted it is the bonus token, drawn from p_k. (Leviathan et al. 2022, Algorithm 1.)"""
    k = drafts.numel()
    idx = torch.arange(k)
    ratio = p[idx, drafts] / q[idx, drafts]  # (k,); q(d) > 0 because d was drawn from q
    u = torch.rand(k, generator=generator)  # (k,) one uniform per draft
    accepted = (u < ratio).long()  # u < min(1, ratio): min is implied since u < 1
    j = int(accepted.cumprod(0).sum())
    dist = p[k] if j == k else residual(p[j], q[j])  # (V,)
    return j, int(torch.multinomial(dist, 1, generator=generator))
# --8<-- [end:verify]


@dataclass
class SpecStats:
    """What one speculative_generate call did."""

    k: int
    steps: int = 0  # target verification forwards (one per step)
    draft_forwards: int = 0  # draft forwards (k per step)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens appended to the output (accepted + one target token per step, minus eos cut)
    accepted_at: list[int] = field(default_factory=list)  # accepted_at[i]: steps whose draft i was accepted
    reached: list[int] = field(default_factory=list)  # reached[i]: steps whose draft i was checked at all

    @property
    def checked(self) -> int:
        """Drafts the target actually judged: a step stops judging at its first rejection."""
        return sum(self.reached)

    @property
    def acceptance_rate(self) -> float:
        """alpha: accepted / checked, the estimate of P(a draft is accepted) under the i.i.d. model of the
        expected-tokens formula (accepted / drafted would count drafts after a rejection as failures)."""
        return self.accepted / max(self.checked, 1)

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / max(self.steps, 1)

    def alpha_per_position(self) -> list[float]:
        """P(draft i accepted | drafts 0..i-1 accepted): the per-position acceptance rate."""
        return [a / r if r else float("nan") for a, r in zip(self.accepted_at, self.reached)]


@dataclass
class SpecOutput:
    token_ids: list[int]  # the generated tokens (prompt excluded)
    stats: SpecStats


class CachedModel:
    """A model and its contiguous KV cache; `cache_len` positions are valid, the rest is scratch."""

    def __init__(self, model: GPT, max_len: int):
        self.model, self.cache, self.cache_len = model, model.new_kv_cache(1, max_len), 0

    def feed(self, ids: list[int]) -> torch.Tensor:
        """Run ids (T tokens) at positions cache_len.. and keep their K, V -> logits (T, V)."""
        x = torch.tensor([ids], dtype=torch.long)  # (1, T)
        logits, _ = self.model(x, kv_cache=self.cache, start_pos=self.cache_len)  # (1, T, V)
        self.cache_len += len(ids)
        return logits[0]

    def rollback(self, length: int) -> None:
        """Forget every position >= length: the next feed overwrites them."""
        self.cache_len = min(self.cache_len, length)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.softmax(logits / temperature, dim=-1)


# --8<-- [start:step]
def _draft(draft: CachedModel, seq: list[int], k: int, temperature: float, generator) -> tuple[list[int], list]:
    """k draft tokens after seq, one small forward each; also their distributions q_i (V,) when sampling."""
    tokens, qs = [], []
    pending = seq[draft.cache_len :]  # 1 token, or 2 after a step where all k drafts were accepted
    for _ in range(k):
        logits = draft.feed(pending)[-1]  # (V,) the draft's prediction for the next position
        if temperature == 0.0:
            tok = int(logits.argmax())
        else:
            qs.append(_probs(logits, temperature))
            tok = int(torch.multinomial(qs[-1], 1, generator=generator))
        tokens.append(tok)
        pending = [tok]
    return tokens, qs


def spec_step(target: CachedModel, draft: CachedModel, seq: list[int], k: int, temperature: float,
              generator=None) -> tuple[list[int], int, list[int]]:
    """One draft-verify-rollback step on seq (both caches hold seq[:-1]) -> (new tokens, j accepted, drafts)."""
    n = len(seq)
    drafts, qs = _draft(draft, seq, k, temperature, generator)
    logits = target.feed([seq[-1], *drafts])  # (k+1, V): ONE target forward over the pending token + k drafts
    if temperature == 0.0:
        j, nxt = verify_greedy(logits, torch.tensor(drafts))
    else:
        j, nxt = verify_sampled(_probs(logits, temperature), torch.stack(qs), torch.tensor(drafts), generator)
    new = drafts[:j] + [nxt]
    # rollback: seq grows to n + j + 1; the caches keep its first n + j positions, the last token stays pending
    target.rollback(n + j)
    draft.rollback(n + j)
    return new, j, drafts
# --8<-- [end:step]


@torch.no_grad()
def speculative_generate(target: GPT, draft: GPT, prompt: list[int], max_new_tokens: int, k: int = 4,
                         temperature: float = 0.0, eos_id: int | None = None,
                         generator: torch.Generator | None = None) -> SpecOutput:
    """Generate up to max_new_tokens after prompt (a list of ids, batch 1), stopping after eos_id.

    Greedy (temperature 0) gives exactly `mlsys.model.generate(target, ...)`'s tokens."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    max_len = len(prompt) + max_new_tokens + k + 1  # drafts may run k past the end before being cut
    if max_len > min(target.config.block_size, draft.config.block_size):
        raise ValueError(f"prompt + max_new_tokens + k + 1 = {max_len} exceeds the models' block_size")
    tgt, drf = CachedModel(target, max_len), CachedModel(draft, max_len)
    stats = SpecStats(k=k, accepted_at=[0] * k, reached=[0] * k)
    # prefill both with all but the last prompt token, which stays pending for the first step
    if len(prompt) > 1:
        tgt.feed(prompt[:-1])
        drf.feed(prompt[:-1])
    seq, out = list(prompt), []
    while len(out) < max_new_tokens:
        new, j, _ = spec_step(tgt, drf, seq, k, temperature, generator)
        stats.steps += 1
        stats.draft_forwards += k
        stats.drafted += k
        stats.accepted += j
        for i in range(min(j + 1, k)):  # drafts 0..j were checked; 0..j-1 accepted
            stats.reached[i] += 1
            stats.accepted_at[i] += i < j
        new = new[: max_new_tokens - len(out)]
        if eos_id is not None and eos_id in new:
            new = new[: new.index(eos_id) + 1]
        seq += new
        out += new
        stats.emitted += len(new)
        if eos_id is not None and out[-1] == eos_id:
            break
    return SpecOutput(out, stats)
