"""Environment check: is this machine ready for the book? Checks for real, and exits 1 when something needed is broken.

What it checks
    python and torch versions (torch >= 2.13: older gloo builds sum where they should average in
    reduce_scatter_tensor and lack the list form of all_to_all), which torch.distributed backends are compiled in
    (gloo, nccl, mpi), CUDA devices, that the start method the launcher uses (forkserver with torch preloaded, or
    spawn where forkserver is missing) can start a process and get an answer back, and
    finally a real all_reduce over -w ranks (default 2) through the book's launcher (gloo; and nccl too when there
    are 2+ GPUs),
    compared with the value it must produce. Each line says ok, FAIL, or info (present or not, not required).

How to run
    python tutorial/part1-distributed/chapter01-first-program/scripts/env_check.py
    python tutorial/part1-distributed/chapter01-first-program/scripts/env_check.py --require-gpu   # GPU machines
    torchrun --nproc-per-node 2 tutorial/part1-distributed/chapter01-first-program/scripts/env_check.py

Contract flags: --smoke runs the same checks (they are already small); --seed changes nothing, as nothing here is
random; --json PATH writes every check's status.

Runtime on 2 idle cores: about 5 s; two or three times that on a busy machine.

Try next
    python tutorial/part1-distributed/chapter01-first-program/scripts/env_check.py -w 4
        -> rank r contributes r + 1, so the closing all_reduce over 4 ranks must give 1+2+3+4 = 10 on each
    python tutorial/part1-distributed/chapter01-first-program/scripts/env_check.py --require-gpu
        -> on a machine without CUDA: missing CUDA becomes a FAIL line, and the exit code is 1
    torchrun --nproc-per-node 2 tutorial/part1-distributed/chapter01-first-program/scripts/env_check.py
        -> only the all_reduce check, as one table row, run by torchrun's two processes (the version and
           library checks are skipped: the processes already exist)
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlsys import cli, report
from mlsys.launch import RankContext, launch, start_context, threads_per_rank

MIN_TORCH = (2, 13)


@dataclass
class Settings(cli.DistArgs):
    require_gpu: bool = False
    """Fail unless CUDA GPUs and the nccl backend work (use this on a GPU machine)."""


def version_tuple(text: str) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0)."""
    return tuple(int(part) for part in text.split("+")[0].split(".")[:3] if part.isdigit())


def _square(x: int) -> int:
    return x * x


def check_spawn() -> tuple[bool, str]:
    """Start a process the way the launcher starts ranks (its start method) and get a computed answer back."""
    context = start_context()
    with context.Pool(1) as pool:
        answer = pool.apply_async(_square, (7,)).get(timeout=60)
    return answer == 49, f"a process started with '{context.get_start_method()}' returned 7*7 = {answer}"


# --8<-- [start:allreduce]
def allreduce_worker(ctx: RankContext) -> dict:
    # Rank r contributes r + 1, so the sum over W ranks must be W(W+1)/2 on every rank.
    t = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
    dist.all_reduce(t)
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    values: list = [None] * ctx.world_size
    dist.all_gather_object(values, t.item())
    return {"values": values, "expected": expected, "ok": all(v == expected for v in values)}
# --8<-- [end:allreduce]


def run_checks(args: Settings) -> list[dict]:
    rows: list[dict] = []

    def add(name: str, status: str, detail: str) -> None:
        rows.append({"check": name, "status": status, "detail": detail})

    py_ok = sys.version_info >= (3, 10)
    add("python", "ok" if py_ok else "FAIL", f"{platform.python_version()} (need >= 3.10)")
    torch_ok = version_tuple(torch.__version__) >= MIN_TORCH
    add("torch", "ok" if torch_ok else "FAIL", f"{torch.__version__} (need >= {'.'.join(map(str, MIN_TORCH))})")
    have_dist = dist.is_available()
    add("torch.distributed", "ok" if have_dist else "FAIL", "compiled in" if have_dist else "missing")
    add("backend gloo", "ok" if dist.is_gloo_available() else "FAIL", "CPU collectives (the book's default here)")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = dist.is_nccl_available()
    gpu_status = "ok" if gpus else ("FAIL" if args.require_gpu else "info")
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus)) if gpus else "none (CPU build or no GPU)"
    add("cuda devices", gpu_status, f"{gpus}: {names}")
    add("backend nccl", "ok" if nccl else ("FAIL" if args.require_gpu else "info"),
        "available" if nccl else "not in this build (needs CUDA)")
    add("backend mpi", "info", "available" if dist.is_mpi_available() else "not in this build (needs an MPI build)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    add("cpu cores", "info", f"{cores}; each of {args.world_size} ranks would get "
        f"{threads_per_rank(args.world_size)} torch thread(s)")
    try:
        ok, detail = check_spawn()
        add("spawn a process", "ok" if ok else "FAIL", detail)
    except Exception as err:
        add("spawn a process", "FAIL", f"{type(err).__name__}: {err}")
    backends = ["gloo"] + (["nccl"] if nccl and gpus >= 2 else [])
    for backend in backends:
        rows.append(check_allreduce(backend, args.world_size, args.timeout))
    return rows


def check_allreduce(backend: str, world_size: int, timeout: float) -> dict:
    name = f"{world_size}-rank all_reduce ({backend})"
    try:
        out = launch(allreduce_worker, world_size=world_size, backend=backend, timeout=timeout)
    except Exception as err:
        first_line = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        return {"check": name, "status": "FAIL", "detail": first_line}
    detail = f"ranks hold {out['values']}, expected {out['expected']:g}"
    return {"check": name, "status": "ok" if out["ok"] else "FAIL", "detail": detail}


def torchrun_worker(ctx: RankContext, args: Settings) -> dict:
    """Under torchrun the processes already exist: check the all_reduce across them instead of spawning."""
    out = allreduce_worker(ctx)
    status = "ok" if out["ok"] else "FAIL"
    return {"rows": [{"check": f"{ctx.world_size}-rank all_reduce (torchrun, {ctx.backend})", "status": status,
                      "detail": f"ranks hold {out['values']}, expected {out['expected']:g}"}]}


def main() -> int:
    args = cli.parse(Settings, __doc__, world_sizes=lambda w: w >= 1, world_sizes_text=">= 1")
    if cli.under_torchrun():
        result = launch(torchrun_worker, args)
        if result is None:
            return 0
        rows = result["rows"]
    else:
        rows = run_checks(args)
    print(report.table(rows))
    failed = [r["check"] for r in rows if r["status"] == "FAIL"]
    print(f"\n{'NOT READY: ' + ', '.join(failed) + ' failed' if failed else 'READY: everything the book needs works.'}")
    if args.json:
        report.write_json(args.json, {"ready": not failed, "checks": rows}, args)
    return 1 if failed else 0


if __name__ == "__main__":
    cli.run(main)
