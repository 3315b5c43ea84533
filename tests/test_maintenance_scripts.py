"""The maintenance tools under scripts/ (the book builder has its own tests in test_book.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT, run


@pytest.mark.long  # 45-75 s on a loaded 2-core machine: make sweep runs it, keeping make test near 10 minutes
@pytest.mark.timeout(180)
def test_train_weights_smoke_writes_a_loadable_checkpoint(tmp_path) -> None:
    proc = run([ROOT / "scripts" / "train_weights.py", "--only", "draft", "--steps", "5", "--num-samples", "4"],
               env={"MLSYS_CACHE": str(tmp_path)}, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoints = list(tmp_path.rglob("draft.pt"))
    assert len(checkpoints) == 1
    saved = torch.load(checkpoints[0], map_location="cpu", weights_only=False)
    assert saved["meta"]["steps"] == 5
