"""Next tokens from the step's logits, each request with its own settings.

Greedy requests (temperature 0) share one batched argmax. A sampling request
draws from its own `torch.Generator` when it has a seed, so its tokens depend
only on its seed and its own logits: not on which other requests share the
batch, nor on the order they sit in. That costs one small loop over the
sampling rows (a generator cannot be shared across rows without coupling
them); each row runs exactly `mlsys.model.sample_next`, the function
`mlsys.model.generate` uses, which makes generate the test's oracle.

A request with `SamplingParams(logprobs=True)` also gets the log-probability
of each token it sampled, under the distribution it was drawn from
(`sampled_logprobs`): after temperature and top-k/top-p, what vLLM returns in
its `logprobs_mode="processed_logprobs"` (its default, "raw_logprobs", is the
log-softmax of the logits before any of them). RLHF needs log pi_old(token) of
every rollout token, and computing it here, from the very logits the token was
drawn from, costs one log_softmax per row instead of another forward pass.
"""

from __future__ import annotations

import torch

from mlsys.engine.request import Sequence
from mlsys.model import filter_logits, sample_next


# --8<-- [start:sample]
def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits (R, V), one row per sequence in `seqs` -> one token id per sequence."""
    next_ids = logits.argmax(dim=-1)  # (R,) greedy for everyone first: one batched op
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.temperature > 0:  # this row samples from its own generator
            row = logits[i : i + 1].float()
            gen = seq.generator
            if gen is not None and gen.device != row.device:
                row = row.cpu()  # per-request generators live on the CPU
            next_ids[i] = sample_next(row, p.temperature, p.top_k, gen, p.top_p)[0]
    return next_ids.tolist()
# --8<-- [end:sample]


# --8<-- [start:logprobs]
def sampled_logprobs(logits: torch.Tensor, seqs: list[Sequence], token_ids: list[int],
                     ) -> tuple[list[float | None], list[dict[int, float] | None]]:
    """log p(token) of each row's sampled token, for the rows whose request asked (SamplingParams.logprobs),
    and the SamplingParams.top_logprobs most likely tokens with theirs; None for the others. The distribution is
    the one `sample` drew from: the raw softmax for a greedy row, softmax(logits / temperature) with everything
    outside the top k and the top-p nucleus masked to -inf for a sampling row (`filter_logits`, as
    `sample_next`: a kept token's log-prob is renormalised over the kept tokens). Tokens a filter or a
    structured-output mask removed (log-prob -inf) are never listed as alternatives."""
    out: list[float | None] = [None] * len(seqs)
    top: list[dict[int, float] | None] = [None] * len(seqs)
    for i, seq in enumerate(seqs):
        p = seq.params
        if not p.logprobs:
            continue
        row = logits[i : i + 1].float()
        if p.temperature > 0:  # each sampling row has its own temperature, top_k and top_p
            row = filter_logits(row, p.temperature, p.top_k, p.top_p)  # as sample_next
        logp = torch.log_softmax(row, dim=-1)[0]  # (V,)
        out[i] = logp[token_ids[i]].item()
        if p.top_logprobs:
            values, ids = torch.topk(logp, min(p.top_logprobs, logp.numel()))
            top[i] = {t: v for t, v in zip(ids.tolist(), values.tolist()) if v != float("-inf")}
    return out, top
# --8<-- [end:logprobs]


# --8<-- [start:mask]
def apply_structured_masks(logits: torch.Tensor, seqs: list[Sequence], remaining: list[int]) -> torch.Tensor:
    """Rows of requests with a JSON schema keep only the tokens their automaton allows in its current state with
    `remaining` tokens of budget left (chapter 11's token tables); the other rows are untouched. One gather per
    schema in the batch, not one per request. Returns the logits to sample from (a copy only when some row is
    masked)."""
    by_fsm: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        if s.fsm is not None:
            by_fsm.setdefault(id(s.fsm), []).append(i)
    if not by_fsm:
        return logits
    keep = torch.ones(logits.shape, dtype=torch.bool)  # (R, V): every token of a free row
    for rows in by_fsm.values():
        fsm = seqs[rows[0]].fsm
        states = torch.tensor([seqs[i].fsm_state for i in rows])
        budget = torch.tensor([remaining[i] for i in rows])
        allowed = fsm.cost[states] <= budget[:, None]  # (M, V_tok): legal AND can still close in time
        allowed[:, fsm.tok.eos_id] = fsm.accepts[states]  # <eos> only where the document is complete
        keep[rows, : allowed.shape[1]] = allowed
        keep[rows, allowed.shape[1] :] = False  # a checkpoint's padded embedding rows: never allowed
    return logits.masked_fill(~keep.to(logits.device), float("-inf"))
# --8<-- [end:mask]
