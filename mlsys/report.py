"""Reporting: aligned tables, self-checks with useful messages, and the `--json` results file."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from mlsys.cli import SelfCheckFailed


def table(rows: list[dict[str, Any]], floatfmt: str = ".4g") -> str:
    """Rows of dicts as a plain-text table: numbers right-aligned, text left (column order: first row's keys)."""
    if not rows:
        return ""
    cols = list(rows[0])

    def fmt(v: Any) -> str:
        return format(v, floatfmt) if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    numeric = [all(isinstance(r.get(c), (int, float)) for r in rows) for c in cols]  # numbers right, text left

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    lines = [line(cols), "  ".join("-" * w for w in widths)] + [line(row) for row in cells]
    return "\n".join(lines)


def expect_equal(name: str, actual: Any, expected: Any) -> None:
    """Raise SelfCheckFailed unless actual == expected (tensors and arrays compared element-wise, exactly)."""
    import numpy as np

    a, e = _as_numpy(actual), _as_numpy(expected)
    if a.shape != e.shape or not np.array_equal(a, e):
        raise SelfCheckFailed(f"{name}: got {a.tolist()}, expected {e.tolist()}")


def expect_close(name: str, actual: Any, expected: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Raise SelfCheckFailed unless |actual - expected| <= atol + rtol * |expected| everywhere."""
    import numpy as np

    a, e = _as_numpy(actual), _as_numpy(expected)
    if a.shape != e.shape:
        raise SelfCheckFailed(f"{name}: shape {a.shape}, expected {e.shape}")
    if not np.allclose(a, e, rtol=rtol, atol=atol):
        worst = float(np.max(np.abs(a.astype(np.float64) - e.astype(np.float64))))
        raise SelfCheckFailed(f"{name}: max abs error {worst:.3g} exceeds atol={atol}, rtol={rtol}")


def _as_numpy(x: Any) -> Any:
    import numpy as np

    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def environment() -> dict[str, Any]:
    """The machine and versions that produced a result, stored next to it."""
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def write_json(path: str | os.PathLike, results: dict[str, Any], args: Any = None) -> Path:
    """Write results plus the script name, its settings and the environment. Returns the path written."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "script": Path(sys.argv[0]).name,
        "settings": dataclasses.asdict(args) if dataclasses.is_dataclass(args) else args,
        "environment": environment(),
        "results": results,
    }
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return out
