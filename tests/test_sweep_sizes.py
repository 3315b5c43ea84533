"""Part II self-checks hold at random combinations of their size flags, not only at the default sizes.

tests/test_sweep.py runs every distributed script at world sizes 1..8 with its --smoke sizes. Here each Part II
script with a self-check (chapters 5-7; the timing benchmarks bench_ddp.py and bubble.py are left out) is run at N
combinations drawn at random from the size flags it accepts: world size 1..8 times micro-batches, layers, lengths,
batch sizes, bucket sizes, tensor-parallel sizes and the rest, small values so each run takes seconds, on top of
--smoke, and with a random --seed. The property: every run exits 0, or refuses its combination with the contract's
usage error (exit 2, one line). Any other exit fails the case and prints, per failing run, the command that
reproduces it and what it wrote to stderr.

SPACES declares, per script, the flags drawn and their ranges, read from the script's Settings.validate(). Each
draw leans towards the ends of the ranges (1, the largest value, world sizes that do not divide the heads), where
assumptions break. The draw is seeded: the test id carries the seed (`zero.py-seed0`), and

    MLSYS_SWEEP_SEED=7 MLSYS_SWEEP_N=40 python -m pytest tests/test_sweep_sizes.py -m sweep -k zero.py

draws other or more combinations of one script (MLSYS_SWEEP_REPORT=FILE appends every run's command, exit
code and stderr to FILE). All of a case's runs share one parent process
(tests/fixtures/sweep.py --plan), so torch is imported once per case. Marked `sweep`: `make sweep` runs them.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT, chapter_dir, run

SWEEP = ROOT / "tests" / "fixtures" / "sweep.py"
SEED = int(os.environ.get("MLSYS_SWEEP_SEED", "0"))
N_OVERRIDE = int(os.environ.get("MLSYS_SWEEP_N", "0"))

Draw = Callable[[random.Random], tuple[int, dict]]


@dataclass
class Space:
    chapter: int
    script: str
    n: int  # combinations per case, chosen so the whole file stays near 8 minutes on 2 idle cores
    draw: Draw  # rng -> (world size, {flag: value})

    @property
    def path(self) -> Path:
        return chapter_dir(self.chapter) / "scripts" / self.script


def edge(rng: random.Random, lo: int, hi: int, p: float = 0.3) -> int:
    """An integer in lo..hi, one of the two ends with probability p."""
    return rng.choice((lo, hi)) if rng.random() < p else rng.randint(lo, hi)


def world(rng: random.Random, lo: int = 1, hi: int = 8) -> int:
    return edge(rng, lo, hi, 0.25)


def divisor_of(rng: random.Random, n: int, p_other: float = 0.15, hi: int = 8) -> int:
    """Mostly a divisor of n in 1..hi; sometimes any value in 1..hi, which the script should refuse or handle."""
    if rng.random() < p_other:
        return rng.randint(1, hi)
    return rng.choice([d for d in range(1, hi + 1) if n % d == 0])


def subset(rng: random.Random, items: list) -> list:
    """A non-empty subset of items, in their order."""
    chosen = [x for x in items if rng.random() < 0.5]
    return chosen or [rng.choice(items)]


# --- chapter 5 -------------------------------------------------------------------------------------------------

def ddp_from_scratch(rng):
    return world(rng), {"steps": edge(rng, 1, 4), "batch_size": edge(rng, 1, 4), "accum": edge(rng, 1, 3),
                        "bucket_mb": rng.choice([0.001, 0.01, 0.03, 0.2, 4.0]),
                        "num_records": rng.choice([1, 20, 100, 300])}


def ddp_recipe(rng):
    epochs = edge(rng, 1, 2)  # --no-set-epoch fails the order check on purpose (exit 1) from two epochs on
    return world(rng), {"epochs": epochs, "batch_size": edge(rng, 1, 8), "num_records": rng.choice([1, 10, 60, 200]),
                        "set_epoch": epochs > 1 or rng.random() < 0.8}


def dp_training(rng):
    steps = rng.choice([1, 5, 20, 40])
    return world(rng), {"ddp": rng.choice(["torch", "naive", "bucketed", "overlapped"]), "steps": steps,
                        "eval_every": edge(rng, 1, steps + 5), "batch_size": edge(rng, 1, 8),
                        "bucket_mb": rng.choice([0.001, 0.05, 4.0]), "num_records": rng.choice([1, 50, 500]),
                        # below 20 steps the learning check is refused unless it only asks the loss not to rise
                        "max_final_ratio": 1.0 if steps < 20 and rng.random() < 0.5 else None}


def grad_sync(rng):
    param = rng.choice(["h.0.attn.c_proj.weight", "wte.weight", "ln_f.bias", "h.1.mlp.c_fc.bias"])
    return world(rng), {"batch_size": edge(rng, 1, 4), "param": param, "entries": edge(rng, 1, 40),
                        "num_records": rng.choice([10, 30, 200])}


def local_sgd(rng):
    sync_every = edge(rng, 1, 4)
    return world(rng), {"sync_every": sync_every, "steps": sync_every * edge(rng, 1, 3),
                        "batch_size": edge(rng, 1, 8), "seq_len": edge(rng, 1, 64)}


def mixed_precision(rng):
    return world(rng), {"steps": edge(rng, 1, 5), "layers": edge(rng, 1, 4), "batch_size": edge(rng, 1, 4),
                        "seq_len": edge(rng, 1, 64)}


def zero(rng):
    return world(rng), {"stages": subset(rng, [0, 1, 2, 3]), "precisions": subset(rng, ["fp32", "mixed"]),
                        "steps": edge(rng, 1, 4), "layers": edge(rng, 1, 4), "batch_size": edge(rng, 1, 4),
                        "seq_len": edge(rng, 1, 64)}


def zero_torch(rng):
    return world(rng), {"steps": edge(rng, 1, 3), "layers": edge(rng, 1, 4), "batch_size": edge(rng, 1, 4),
                        "seq_len": edge(rng, 1, 64)}


# --- chapter 6 -------------------------------------------------------------------------------------------------

def context_parallel(rng):
    w = world(rng)
    heads = rng.choice([1, 2, 3, 4, 6, 8])
    lengths = sorted({rng.choice([2 * w, 64, 100, 256]) for _ in range(rng.randint(1, 2))})
    return w, {"seq": edge(rng, 1, 130), "heads": heads, "head_dim": rng.choice([1, 4, 8]),
               "lengths": lengths, "q_tile": edge(rng, 1, 64)}


def fsdp_tp(rng):
    return world(rng), {"tp": rng.choice([0, 1, 2, 4]), "steps": edge(rng, 1, 2), "batch_size": edge(rng, 1, 3),
                        "seq_len": edge(rng, 1, 64)}


def tp_flags(rng, w: int, sizes: list[int], sequence_parallel: bool = False) -> dict:
    """n_head, n_embd, batch, seq for a tensor-parallel GPT split over each of `sizes`; usually valid."""
    lcm = 1
    for t in sizes:
        lcm = lcm * t // __import__("math").gcd(lcm, t)
    n_head = lcm * rng.choice([1, 2]) if rng.random() < 0.85 else rng.randint(1, 8)
    n_embd = n_head * rng.choice([1, 2, 4, 8]) if rng.random() < 0.9 else rng.randint(1, 64)
    seq = (lcm if sequence_parallel else 1) * edge(rng, 1, 16)
    return {"n_layer": edge(rng, 1, 2), "n_head": n_head, "n_embd": n_embd, "batch": edge(rng, 1, 3),
            "seq": min(seq, 256)}


def sequence_parallel(rng):
    w = world(rng)
    sizes = subset(rng, [t for t in range(1, w + 1) if w % t == 0]) if rng.random() < 0.9 else [rng.randint(1, 8)]
    return w, {"tp_sizes": sizes, **tp_flags(rng, w, sizes, sequence_parallel=True)}


def tp_transformer(rng):
    w = world(rng)
    sizes = subset(rng, [t for t in range(1, w + 1) if w % t == 0]) if rng.random() < 0.9 else [rng.randint(1, 8)]
    return w, {"tp_sizes": sizes, **tp_flags(rng, w, sizes)}


def tp_shards(rng):
    w = world(rng)
    return w, tp_flags(rng, w, [w])


def tp_dtensor(rng):
    w = world(rng)
    return w, {"batch": edge(rng, 1, 3), "seq": w * edge(rng, 1, 4), "hidden": w * edge(rng, 1, 6),
               "vocab": w * edge(rng, 1, 6) if rng.random() < 0.9 else rng.randint(1, 20)}


def tp_layers(rng):
    w = world(rng)
    return w, {"batch": edge(rng, 1, 3), "seq": edge(rng, 1, 8),
               "hidden": w * edge(rng, 1, 6) if rng.random() < 0.9 else rng.randint(1, 20)}


# --- chapter 7 -------------------------------------------------------------------------------------------------

def interleaved_zero_bubble(rng):
    p = world(rng, 2, 8)
    rounds = edge(rng, 1, 3)
    m = p * rounds if rng.random() < 0.85 else rng.randint(p, 3 * p)
    return p, {"micro_batches": m, "virtual_stages": edge(rng, 1, 4), "rows": edge(rng, 1, 8),
               "width": edge(rng, 1, 32), "lr": rng.choice([0.01, 0.5, 2.0])}


def mesh_3d(rng):
    dp, tp, pp = rng.randint(1, 4), rng.choice([1, 2]), rng.choice([1, 2])
    while dp * tp * pp > 8:
        dp -= 1
    w = dp * tp * pp if rng.random() < 0.9 else world(rng)
    return w, {"dp": dp, "tp": tp, "pp": pp, "micro_batches": edge(rng, 1, 4),
               "micro_batch_size": edge(rng, 1, 2), "seq_len": edge(rng, 1, 16), "steps": edge(rng, 1, 2)}


def moe_expert_parallel(rng):
    w = world(rng)
    experts = w * edge(rng, 1, 2) if rng.random() < 0.9 else rng.randint(1, 8)
    tokens = edge(rng, 1, 64)
    return w, {"num_experts": experts, "top_k": edge(rng, 1, max(1, experts)), "tokens": tokens,
               "hidden": edge(rng, 1, 16), "capacity_factor": rng.choice([0.1, 0.5, 1.25, 3.0]),
               "factors": subset(rng, [0.25, 1.0, 2.0]), "skew": rng.choice([0.0, 1.0, 4.0]),
               "train_steps": edge(rng, 0, 5), "aux_weight": rng.choice([0.0, 0.05, 1.0]),
               "example_tokens": edge(rng, 1, min(tokens, 16)), "renormalize": rng.random() < 0.7}


def pipeline_schedules(rng):
    w = world(rng)
    return w, {"layers": edge(rng, w, 8), "micro_batches": edge(rng, 1, 8), "micro_batch_size": edge(rng, 1, 2),
               "seq_len": edge(rng, 1, 32), "double": True if rng.random() < 0.3 else None}


def pipeline_trace(rng):
    return world(rng, 2, 4), {"micro_batches": edge(rng, 1, 4), "micro_batch_size": edge(rng, 1, 2),
                              "seq_len": edge(rng, 1, 32), "layers_per_stage": edge(rng, 1, 2),
                              "width": 4 * edge(rng, 1, 8)}


def pipelining_torch(rng):
    w = world(rng, 2, 8)
    return w, {"layers": edge(rng, w, 8), "micro_batches": edge(rng, 1, 8), "micro_batch_size": edge(rng, 1, 2),
               "seq_len": edge(rng, 1, 32)}


SPACES = [
    Space(5, "ddp_from_scratch.py", 6, ddp_from_scratch),
    Space(5, "ddp_recipe.py", 6, ddp_recipe),
    Space(5, "dp_training.py", 5, dp_training),
    Space(5, "grad_sync.py", 8, grad_sync),
    Space(5, "local_sgd.py", 4, local_sgd),
    Space(5, "mixed_precision.py", 4, mixed_precision),
    Space(5, "zero.py", 6, zero),
    Space(5, "zero_torch.py", 4, zero_torch),
    Space(6, "context_parallel.py", 3, context_parallel),
    Space(6, "fsdp_tp.py", 3, fsdp_tp),
    Space(6, "sequence_parallel.py", 8, sequence_parallel),
    Space(6, "tp_dtensor.py", 4, tp_dtensor),
    Space(6, "tp_layers.py", 8, tp_layers),
    Space(6, "tp_shards.py", 8, tp_shards),
    Space(6, "tp_trace.py", 4, tp_shards),
    Space(6, "tp_transformer.py", 8, tp_transformer),
    Space(7, "interleaved_zero_bubble.py", 3, interleaved_zero_bubble),
    Space(7, "mesh_3d.py", 6, mesh_3d),
    Space(7, "moe_expert_parallel.py", 6, moe_expert_parallel),
    Space(7, "pipeline_schedules.py", 5, pipeline_schedules),
    Space(7, "pipeline_trace.py", 6, pipeline_trace),
    Space(7, "pipelining_torch.py", 4, pipelining_torch),
]


def as_flags(values: dict) -> list[str]:
    """{flag: value} -> the command line: lists as several values, booleans as --flag / --no-flag, None left off."""
    out: list[str] = []
    for name, value in values.items():
        if value is None:  # a store_true flag left off
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def combinations(space: Space, seed: int, n: int) -> list[tuple[int, list[str]]]:
    rng = random.Random(f"{space.script}-{seed}")
    runs = []
    for _ in range(n):
        w, values = space.draw(rng)
        runs.append((w, ["--smoke", "--seed", str(rng.randrange(1000)), *as_flags(values)]))
    return runs


def command(space: Space, w: int, flags: list[str]) -> str:
    return shlex.join(["python", str(space.path.relative_to(ROOT)), "-w", str(w), *flags])


def test_spaces_cover_part2() -> None:
    """Every Part II distributed script of chapters 5-7 is swept here, apart from the two timing benchmarks."""
    found = {p.name for n in (5, 6, 7) for p in (chapter_dir(n) / "scripts").glob("*.py")
             if not p.name.startswith("_") and "DistArgs" in p.read_text()}
    assert {s.script for s in SPACES} == found - {"bench_ddp.py", "bubble.py"}
    for space in SPACES:  # the drawn flags are flags the script has
        text = space.path.read_text()
        for _w, flags in combinations(space, SEED, 20):
            for flag in flags:
                if flag.startswith("--") and flag not in ("--smoke", "--seed"):
                    name = flag[2:].removeprefix("no-").replace("-", "_")
                    assert f"    {name}: " in text, f"{space.script} has no --{name}"


def only_line(stderr: str) -> bool:
    return len([line for line in stderr.splitlines() if line.strip()]) == 1


@pytest.mark.sweep
@pytest.mark.timeout(900)  # as test_sweep.py: a loaded machine can make a case several times slower
@pytest.mark.parametrize("space", SPACES, ids=lambda s: f"{s.script}-seed{SEED}")
def test_self_checks_hold_at_random_sizes(space: Space, tmp_path) -> None:
    runs = combinations(space, SEED, N_OVERRIDE or space.n)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([{"script": str(space.path), "world_size": w, "flags": f} for w, f in runs]))
    try:
        proc = run([SWEEP, "--plan", plan], timeout=880)
        stdout, stderr = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as err:
        stdout = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        stderr = err.stderr.decode() if isinstance(err.stderr, bytes) else (err.stderr or "")
    results = [json.loads(line[6:]) for line in stdout.splitlines() if line.startswith("SWEEP ")]
    if len(results) < len(runs):
        w, flags = runs[len(results)]
        pytest.fail(f"the sweep stopped (crash or timeout) at run {len(results)}:\n  {command(space, w, flags)}\n"
                    f"{stdout[-2000:]}\n{stderr[-3000:]}")
    failures = []
    for r, (w, flags) in zip(results, runs):
        refused_cleanly = r["exit_code"] == 2 and only_line(r["stderr"])
        if r["exit_code"] != 0 and not refused_cleanly:
            failures.append(f"exit {r['exit_code']} after {r['seconds']} s:\n  {command(space, w, flags)}\n"
                            + "\n".join("    " + line for line in r["stderr"].strip().splitlines()[-12:]))
    if os.environ.get("MLSYS_SWEEP_REPORT"):  # as in test_sweep.py: every run's exit code, appended to a file
        with open(os.environ["MLSYS_SWEEP_REPORT"], "a", encoding="utf-8") as out:
            for r, (w, flags) in zip(results, runs):
                out.write(json.dumps({"command": command(space, w, flags), "exit_code": r["exit_code"],
                                      "seconds": r["seconds"], "stderr": r["stderr"][-2000:]}) + "\n")
    accepted = sum(r["exit_code"] == 0 for r in results)
    print(f"{space.script}: {accepted} of {len(results)} combinations ran, the rest were refused; "
          f"{sum(r['seconds'] for r in results):.0f} s")
    assert not failures, f"{len(failures)} of {len(runs)} combinations failed:\n\n" + "\n\n".join(failures)
    assert accepted, f"{space.script} refused every combination drawn; the draw misses what it accepts"
