"""Checker for ch06.3 — your vocab-parallel loss on 1 to 3 real ranks, uneven vocabulary slices, against
torch.nn.functional.cross_entropy of the full logits in one process."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlsys.exercises import run_ranks, source_of, task


@task("vocab_parallel_cross_entropy on 1-3 ranks, uneven slices, logits near 0 and near 1000, equals "
      "F.cross_entropy of the full logits; no all_gather")
def check_loss(ex) -> None:
    source = source_of(ex.vocab_parallel_cross_entropy)
    if "NotImplementedError" in source:
        raise NotImplementedError("TODO: write vocab_parallel_cross_entropy first")
    assert "all_gather" not in source, "the point is to never gather the (N, V) logits: use three all_reduces"
    for world_size, vocab, offset in [(1, 5, 0.0), (2, 11, 0.0), (3, 11, 1000.0), (3, 7, 0.0)]:
        gen = torch.Generator().manual_seed(world_size * 100 + vocab)
        n = 6
        logits = torch.randn(n, vocab, generator=gen) * 3 + offset
        targets = torch.randint(0, vocab, (n,), generator=gen)
        targets[0], targets[-1] = 0, vocab - 1  # the first and the last id of the vocabulary, always
        want = F.cross_entropy(logits.double(), targets).item()
        slices = torch.tensor_split(logits, world_size, dim=1)
        starts = [sum(s.shape[1] for s in slices[:r]) for r in range(world_size)]
        got = run_ranks(ex, "vocab_parallel_cross_entropy",
                        [(slices[r].contiguous(), targets, starts[r]) for r in range(world_size)], timeout=20)
        for rank, loss in enumerate(got):
            loss = float(loss)
            assert loss == loss and abs(loss) != float("inf"), \
                f"W={world_size}, logits near {offset:g}: rank {rank} got {loss} (overflow?)"
            assert abs(loss - want) < 1e-4 * max(1.0, abs(want)), \
                f"W={world_size}, V={vocab}, logits near {offset:g}: rank {rank} got {loss:.6f}, want {want:.6f}"
