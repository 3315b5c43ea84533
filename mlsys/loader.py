"""Load a chapter file as a module, and call one of its functions on every rank of a real job.

The exercise checker (mlsys/exercises.py) and the attempt's process (mlsys/attempt/child.py) both need these two;
they live here, below both, so that neither imports the other.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_module(path: Path, name: str | None = None) -> ModuleType:
    """Import a file by path (chapter folders are not packages); registered in sys.modules under a unique name."""
    path = path.resolve()
    shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    name = name or "_ex_" + re.sub(r"\W", "_", str(shown).removesuffix(".py"))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def _call_on_rank(ctx: Any, path: str, fn_name: str, per_rank_args: list[tuple]) -> list[Any]:
    """Worker: load the file in this rank, call fn(*args for this rank), gather every rank's result."""
    import torch.distributed as dist

    fn = getattr(load_module(Path(path)), fn_name)
    result = fn(*per_rank_args[ctx.rank])
    results: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(results, result.tolist() if hasattr(result, "tolist") else result)
    return results


def run_ranks_here(module: ModuleType, fn_name: str, per_rank_args: list[tuple], backend: str = "gloo",
                   timeout: float = 60.0) -> list[Any]:
    """Call `module.fn_name(*per_rank_args[r])` on rank r of a job started from this process; every rank's result.

    Raises the failing rank's report (as RuntimeError) if a rank crashes or hangs past `timeout`."""
    from mlsys.launch import JobFailed, launch

    try:
        return launch(_call_on_rank, module.__file__, fn_name, per_rank_args, world_size=len(per_rank_args),
                      backend=backend, timeout=timeout)
    except JobFailed as err:
        last = str(err).strip().splitlines()
        raise RuntimeError(last[-2] if len(last) > 1 else last[0]) from None
