"""Next tokens from the step's logits, each request with its own settings.

Greedy requests (temperature 0) share one batched argmax. A sampling request
draws from its own `torch.Generator` when it has a seed, so its tokens depend
only on its seed and its own logits: not on which other requests share the
batch, nor on the order they sit in. That costs one small loop over the
sampling rows (a generator cannot be shared across rows without coupling
them); each row runs exactly `mlsys.model.sample_next`, the function
`mlsys.model.generate` uses, which makes generate the test's oracle.
"""

from __future__ import annotations

import torch

from mlsys.engine.request import Sequence
from mlsys.model import sample_next


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
            next_ids[i] = sample_next(row, p.temperature, p.top_k, gen)[0]
    return next_ids.tolist()
# --8<-- [end:sample]
