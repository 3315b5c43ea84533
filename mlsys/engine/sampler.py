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
(`sampled_logprobs`), as vLLM returns them: RLHF needs log pi_old(token) of
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
def sampled_logprobs(logits: torch.Tensor, seqs: list[Sequence], token_ids: list[int]) -> list[float | None]:
    """log p(token) of each row's sampled token, for the rows whose request asked (SamplingParams.logprobs);
    None for the others. The distribution is the one `sample` drew from: the raw softmax for a greedy row,
    softmax(logits / temperature) with everything outside the top k and the top-p nucleus masked to -inf for
    a sampling row (`filter_logits`, as `sample_next`: a kept token's log-prob is renormalised over the kept
    tokens)."""
    out: list[float | None] = [None] * len(seqs)
    greedy = [i for i, s in enumerate(seqs) if s.params.logprobs and s.params.temperature == 0]
    if greedy:  # one batched log_softmax over all greedy rows: (G, V) -> (G,)
        rows, ids = torch.tensor(greedy, device=logits.device), torch.tensor(token_ids, device=logits.device)
        logp = torch.log_softmax(logits[rows].float(), dim=-1).gather(1, ids[rows][:, None]).squeeze(1)
        for i, lp in zip(greedy, logp.tolist()):
            out[i] = lp
    for i, seq in enumerate(seqs):  # sampling rows: each has its own temperature, top_k and top_p
        p = seq.params
        if p.logprobs and p.temperature > 0:
            row = filter_logits(logits[i : i + 1].float(), p.temperature, p.top_k, p.top_p)  # as sample_next
            out[i] = torch.log_softmax(row, dim=-1)[0, token_ids[i]].item()
    return out
# --8<-- [end:logprobs]
