"""Figures: a headless matplotlib with the book's seaborn style, saved where the script's `--plot-dir` says."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend, with the book's theme applied."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")
    return plt


def figure_dir(args: Any) -> Path:
    """`args.plot_dir`, or `.cache/figures/<script name>` under the repository."""
    chosen = getattr(args, "plot_dir", "")
    path = Path(chosen) if chosen else REPO_ROOT / ".cache" / "figures" / Path(sys.argv[0]).stem
    path.mkdir(parents=True, exist_ok=True)
    return path


def save(fig: Any, args: Any, name: str) -> Path:
    """Save `fig` as `<figure_dir>/<name>.png`, close it, and return the path."""
    path = figure_dir(args) / f"{name}.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    pyplot().close(fig)
    return path
