"""Trained checkpoints of the `small` and `draft` presets, built on first use.

    from mlsys.weights import load_pretrained
    model = load_pretrained("small")   # GPT in eval mode

Checkpoints live in `<repo>/.cache/weights/<name>.pt` (git-ignored), or in
`$MLSYS_CACHE/weights/<name>.pt` when that variable is set. Nothing is
downloaded: a missing checkpoint is trained here with the fixed recipe in
`RECIPES` (a one-line notice goes to stderr; about 2 min for `small` on a
2-core CPU) and saved. `make weights` (scripts/train_weights.py) builds them
ahead of time.

A checkpoint is a plain dict, loadable with `torch.load(weights_only=True)`:
{"config": asdict(GPTConfig), "state_dict": ..., "meta": {seed, steps,
final_train_loss, final_val_loss, torch_version, ...}}. It is written to a
temporary file in the same folder and renamed into place, so a reader never
sees half a file and two processes building at once simply race to the same
result.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mlsys.model import GPT, GPTConfig, num_params
from mlsys.train import train

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Recipe:
    """How a pretrained checkpoint is trained (the arguments of `mlsys.train.train`)."""

    steps: int
    batch_size: int
    lr: float
    seed: int = 0


RECIPES: dict[str, Recipe] = {
    "small": Recipe(steps=700, batch_size=8, lr=6e-3),  # ~2 min on 2 cores
    "draft": Recipe(steps=800, batch_size=16, lr=6e-3),  # ~1 min
}


def cache_dir() -> Path:
    """`$MLSYS_CACHE` if set, else `<repo>/.cache`, read on every call (tests repoint it)."""
    return Path(os.environ.get("MLSYS_CACHE") or REPO_ROOT / ".cache")


def checkpoint_path(name: str) -> Path:
    return cache_dir() / "weights" / f"{name}.pt"


def save_checkpoint(path: Path, model: GPT, meta: dict) -> None:
    """Write atomically: a temp file in the same folder, then `os.replace` onto `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"config": asdict(model.config), "state_dict": model.state_dict(), "meta": meta}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a checkpoint is not a secret
        os.replace(tmp, path)  # atomic on POSIX when both sit on one filesystem
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: Path) -> tuple[GPT, dict]:
    """(model in eval mode, meta) from a file written by `save_checkpoint`."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    model = GPT(GPTConfig(**payload["config"]))
    model.load_state_dict(payload["state_dict"])
    return model.eval(), payload["meta"]


def build_weights(name: str, steps: int | None = None, seed: int | None = None, progress: bool | None = None):
    """Train preset `name` with its recipe (steps/seed overridable), save it; returns (path, result)."""
    if name not in RECIPES:
        raise ValueError(f"no recipe for {name!r}; choose from {sorted(RECIPES)}")
    recipe = RECIPES[name]
    steps = recipe.steps if steps is None else steps
    seed = recipe.seed if seed is None else seed
    out = train(GPTConfig.preset(name), steps, recipe.batch_size, recipe.lr, seed, progress=progress)
    meta = {
        "name": name, "seed": seed, "steps": steps, "batch_size": recipe.batch_size, "lr": recipe.lr,
        "final_train_loss": out["final_train_loss"], "final_val_loss": out["final_val_loss"],
        "train_seconds": out["seconds"], "num_params": num_params(out["model"]),
        "torch_version": str(torch.__version__),
    }
    path = checkpoint_path(name)
    save_checkpoint(path, out["model"], meta)
    return path, out


def load_pretrained(name: str) -> GPT:
    """The trained `name` model ("small" or "draft") in eval mode; trains it if missing."""
    if name not in RECIPES:
        raise ValueError(f"no pretrained {name!r}; choose from {sorted(RECIPES)}")
    path = checkpoint_path(name)
    if not path.exists():
        steps = RECIPES[name].steps
        print(f"mlsys: no {path}; training {name!r} for {steps} steps, saving it there", file=sys.stderr)
        build_weights(name)
    model, meta = load_checkpoint(path)
    if (meta["steps"], meta["seed"]) != (RECIPES[name].steps, RECIPES[name].seed):
        print(f"mlsys: {path} was trained with steps={meta['steps']}, seed={meta['seed']}, "
              f"not the recipe's; `make weights` with --force rebuilds it", file=sys.stderr)
    return model
