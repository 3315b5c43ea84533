"""Tensor-parallel serving on this machine: how much of a decode step is communication, at TP = 1, 2 and 4.

What it shows
    The engine with EngineConfig(tensor_parallel_size=N) (mlsys/engine/tp.py): this process is rank 0 and N-1
    worker processes hold the rest of the shards; each rank holds 1/N of every layer's heads and MLP, and of the
    KV cache. Each decode step then costs two all-reduces per layer, of the step's (tokens, hidden) activations.
    1. Self-check: the tokens at every N equal the tokens at N = 1.
    2. For each N, over the decode steps of a full batch: the median step time; the time rank 0 spends inside
       all-reduce (waiting for the slowest rank included); the bytes each all-reduce was given per step, against
       the formula 2 * layers * tokens * hidden * 4 bytes (float32); and the share of the step that is
       communication. The KV bytes each rank holds shrink as 1/N.
    On this machine the ranks are processes on 2 CPU cores talking through gloo over loopback TCP: every
    all-reduce is a few system calls and copies, and N ranks share 2 cores. There is nothing to gain here, and
    the table shows what it costs. With GPUs joined by NVLink the same all-reduce of a few hundred KiB takes
    tens of microseconds while each GPU's share of the matmuls shrinks N-fold, which is where tensor-parallel serving
    pays off (and where a model too big for one GPU's memory needs it at all). With GPUs (--device auto or
    cuda), the same table follows on NCCL, rank r on cuda:r, for the sizes this machine has GPUs for; without
    them the script says so and prints the gloo table alone.

How to run
    python tutorial/part3-inference/chapter10-scheduling-cuda-graphs/scripts/tp_serving.py
    python .../tp_serving.py --sizes 1 2 --batch-size 32

Runtime on 2 cores: about 5 s, 6 s with --smoke.

Try next
    python tutorial/part3-inference/chapter10-scheduling-cuda-graphs/scripts/tp_serving.py --batch-size 64
        -> more tokens per all-reduce: the bytes grow with the batch, the number of all-reduces does not
"""

from __future__ import annotations

import statistics
import typing
from dataclasses import dataclass, field

import torch

from mlsys import bench, cli, report
from mlsys.data import Tokenizer, make_corpus
from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.engine import tp as tp_module
from mlsys.weights import load_pretrained


@dataclass
class Settings(cli.Args):
    sizes: list[int] = field(default_factory=lambda: [1, 2, 4])
    """Tensor-parallel sizes to run (each must divide the small model's 4 heads)."""
    batch_size: int = 16
    """Requests decoding together."""
    max_tokens: int = 32
    """Tokens each request generates (all of them: ignore_eos)."""
    device: typing.Literal["auto", "cpu", "cuda"] = "auto"
    """cpu: gloo ranks only; cuda: NCCL ranks only (one GPU per rank); auto: gloo, then NCCL where GPUs exist."""

    def validate(self) -> None:
        if not self.sizes or any(n not in (1, 2, 4) for n in self.sizes):
            raise cli.UsageError("--sizes must be taken from 1, 2 and 4 (they must divide the model's 4 heads)")
        if self.device == "cuda" and torch.cuda.device_count() < max(self.sizes):
            raise cli.UsageError(f"--device cuda needs {max(self.sizes)} GPUs for --sizes {self.sizes}; this "
                                 f"machine has {torch.cuda.device_count()}")
        if not 1 <= self.batch_size <= 64 or not 2 <= self.max_tokens <= 128:
            raise cli.UsageError("--batch-size must lie in 1..64 and --max-tokens in 2..128")


# --8<-- [start:measure]
def measure(model, prompts: list[list[int]], args: Settings, size: int, device: str = "cpu") -> dict:
    """Run the batch at tensor-parallel size `size`; stage timings of the full-batch decode steps, rank 0's
    all-reduce time and bytes during them, and the tokens."""
    engine = Engine(model, Tokenizer(), EngineConfig(tensor_parallel_size=size, max_num_seqs=args.batch_size,
                                                     device=device))
    try:
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
        steps, outs = [], {}
        with bench.steady_timing():
            while engine.has_unfinished():
                before = dict(tp_module.COMM)
                for out in engine.step():
                    if out.finished:
                        outs[out.request_id] = out.token_ids
                t = engine.last_step_timing
                if t["num_seqs"] == args.batch_size and t["num_batched_tokens"] == args.batch_size:  # decode
                    steps.append((t["total"], tp_module.COMM["all_reduce_s"] - before["all_reduce_s"],
                                  tp_module.COMM["all_reduce_bytes"] - before["all_reduce_bytes"],
                                  tp_module.COMM["all_reduce_calls"] - before["all_reduce_calls"]))
        kv = engine.stats()["kv_cache_bytes"]
    finally:
        engine.close()
    c = model.config
    step_s = statistics.median(s[0] for s in steps)
    comm_s = statistics.median(s[1] for s in steps)
    return {"tp": size, "step_ms": 1e3 * step_s, "all_reduce_ms": 1e3 * comm_s, "comm_share": comm_s / step_s,
            "all_reduces_per_step": steps[-1][3], "bytes_per_step": steps[-1][2],
            "formula_bytes_per_step": 2 * c.n_layer * args.batch_size * c.n_embd * 4 if size > 1 else 0,
            "kv_bytes_per_rank": kv, "steps_timed": len(steps),
            "tokens": [outs[k] for k in sorted(outs, key=lambda k: int(k.split("-")[1]))]}
# --8<-- [end:measure]


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"sizes": [1, 2], "batch_size": 4, "max_tokens": 8})
    torch.set_num_threads(1)  # rank 0 shares the 2 cores with its workers
    model, tok = load_pretrained("small"), Tokenizer()
    lines = make_corpus(args.batch_size, seed=args.seed).splitlines()
    prompts = [tok.encode(line[:12], bos=True) for line in lines[: args.batch_size]]
    gpus = torch.cuda.device_count()
    print(f"the small GPT ({model.config.n_layer} layers, hidden {model.config.n_embd}), a batch of "
          f"{args.batch_size} requests decoding ({bench.load_average()})")
    tables = {}
    if args.device in ("auto", "cpu"):
        tables["gloo on CPU ranks"] = [measure(model, prompts, args, n) for n in sorted(set(args.sizes))]
    nccl_sizes = [n for n in sorted(set(args.sizes)) if n <= gpus]
    if args.device in ("auto", "cuda") and nccl_sizes:
        tables[f"NCCL, one GPU per rank ({torch.cuda.get_device_name(0)})"] = [
            measure(model, prompts, args, n, "cuda") for n in nccl_sizes]
    elif args.device == "auto":
        print("no GPU here: no NCCL table (with GPUs, the same run follows on NCCL)")
    for name, rows in tables.items():
        print(f"\n{name}:")
        print(report.table([{k: v for k, v in r.items() if k != "tokens"} for r in rows], floatfmt=".3g"))
        for r in rows:
            report.expect_equal(f"tokens at TP={r['tp']} = TP={rows[0]['tp']} ({name})", r["tokens"],
                                rows[0]["tokens"])
            report.expect_equal(f"all-reduce bytes per step at TP={r['tp']}", r["bytes_per_step"],
                                r["formula_bytes_per_step"])
    runs = next(iter(tables.values()))
    base = runs[0]
    last = runs[-1]
    print(f"\nTP={last['tp']}: {last['step_ms'] / base['step_ms']:.3g}x the step time of TP={base['tp']}, "
          f"{last['comm_share']:.0%} of it inside all-reduce; each rank holds "
          f"{last['kv_bytes_per_rank'] / base['kv_bytes_per_rank']:.3g}x the KV bytes")
    if args.json:
        report.write_json(args.json, {"runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
                                      "slowdown": last["step_ms"] / base["step_ms"],
                                      "kv_ratio": last["kv_bytes_per_rank"] / base["kv_bytes_per_rank"],
                                      "last_tp": last["tp"], "last_comm_share": last["comm_share"],
                                      "tables": {name: [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
                                                 for name, rows in tables.items()}}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
