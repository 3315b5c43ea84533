"""Preemption when KV blocks run out: the engine keeps serving from a pool too small for its load, and every
request finishes with exactly the tokens it gets from an engine with memory to spare.

What it shows
    1. The same requests (greedy, fixed lengths) served twice by mlsys.engine: with a pool big enough for all of
       them at once, and with a pool of --num-blocks blocks, only a little more than one full-length sequence.
       The small pool preempts by recompute: the newest running sequence loses its blocks, goes back to the
       front of the queue keeping its tokens, and later prefills prompt + generated tokens again. The script
       prints each preemption as it happens (two in one step in the order the scheduler picked them), checks the
       engine's invariants after every step, and compares every request's tokens with the unconstrained run (any
       difference exits 1). preemption.png draws the pool and the scheduler's running and waiting queues before
       and after the first step that preempts.
    2. What a preemption costs, two ways of paying:
       recompute  prefill the n tokens again (2 * params * n FLOPs, one batched pass);
       swap       copy the n tokens' K/V out to host memory and back (2 * n * kv_bytes_per_token over the bus).
       Measured on this machine for the mlsys small model (on CPU "swap" is a memory copy, not PCIe), and
       computed for Llama-3-8B on an H100 from --gpu-tflops, --mfu and --pcie-gbps.

How to run
    python tutorial/part3-inference/chapter09-kv-cache/scripts/preemption.py
    python tutorial/part3-inference/chapter09-kv-cache/scripts/preemption.py --num-blocks 14 --device cuda

Runtime on 2 idle cores: about 2 s, the same with --smoke (start-up dominates both; several times that on
a busy machine).

Try next
    python tutorial/part3-inference/chapter09-kv-cache/scripts/preemption.py --num-blocks 12
        -> the smallest pool accepted, exactly one full-length (96-token) sequence; one block fewer is refused at
           start-up. The six prompts fill it on their own: more steps than with 14 blocks, the same tokens.
           Preemptions need not rise too: only a running sequence can be preempted, and the smaller pool runs
           fewer at a time
    python tutorial/part3-inference/chapter09-kv-cache/scripts/preemption.py --mfu 0.2 --pcie-gbps 25
        -> a slower prefill and a slower bus: the recompute/swap ratio moves, read it in the cost table
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from mlsys import cli, plot, report
from mlsys import kv_memory as kvm
from mlsys.data import Tokenizer, format_record, sample_record
from mlsys.engine import Engine, EngineConfig, ModelRunner, SamplingParams
from mlsys.weights import load_pretrained


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    num_requests: int = 6
    """Requests, all queued at once."""
    max_tokens: int = 60
    """Tokens each request generates (ignore_eos: every request runs to this length)."""
    block_size: int = 8
    """Tokens per KV block."""
    num_blocks: int = 14
    """KV blocks in the small pool (must hold one full-length sequence: ceil(max_model_len / block_size))."""
    max_model_len: int = 96
    """Longest sequence the engine accepts."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu or cuda: where the engine and the cost measurement run."""
    swap_tokens: int = 256
    """Sequence length for the recompute-vs-swap cost comparison."""
    gpu_tflops: float = 989.0
    """Dense bf16 peak of the GPU in the computed comparison (H100 SXM: 989 TFLOPS)."""
    mfu: float = 0.5
    """Fraction of that peak a prefill reaches."""
    pcie_gbps: float = 50.0
    """Host <-> GPU bandwidth per direction in GB/s (PCIe 5.0 x16: 64 GB/s nominal, ~50 achieved)."""

    def validate(self) -> None:
        if self.num_requests < 1 or self.max_tokens < 1 or self.block_size < 1:
            raise cli.UsageError("--num-requests, --max-tokens and --block-size must be >= 1")
        if not 16 <= self.max_model_len <= 256:
            raise cli.UsageError(f"--max-model-len must be in 16..256, got {self.max_model_len}")
        if self.max_tokens + 12 > self.max_model_len:
            raise cli.UsageError(f"--max-tokens {self.max_tokens} + a 12-token prompt exceeds --max-model-len")
        need = -(-self.max_model_len // self.block_size)
        if self.num_blocks < need:
            raise cli.UsageError(f"--num-blocks {self.num_blocks} cannot hold one {self.max_model_len}-token "
                                 f"sequence ({need} blocks of {self.block_size})")
        if self.device not in ("auto", "cpu", "cuda"):
            raise cli.UsageError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise cli.UsageError("--device cuda: no GPU on this machine")
        if not 1 <= self.swap_tokens <= 256:
            raise cli.UsageError(f"--swap-tokens must be in 1..256 (the model's context), got {self.swap_tokens}")
        for name in ("gpu_tflops", "mfu", "pcie_gbps"):
            if not getattr(self, name) > 0:
                raise cli.UsageError(f"--{name.replace('_', '-')} must be > 0")
        if self.mfu > 1:
            raise cli.UsageError(f"--mfu must be <= 1, got {self.mfu}")


def make_prompts(n: int, seed: int) -> list[list[int]]:
    """<bos> + the first 11 characters of a random record, up to a name's first letter: '{"name": "a'."""
    rng, tok = random.Random(seed), Tokenizer()
    return [[tok.bos_id] + tok.encode(format_record(sample_record(rng))[:11]) for _ in range(n)]


# --8<-- [start:serve]
def serve(model, prompts, args: Settings, num_blocks: int | None, device: str, log: bool) -> dict:
    """Run all requests to completion; print preemptions as they happen, in the order the scheduler picked them
    (with the running and waiting counts after that step); invariants after every step. Keeps the pool and the
    queues before and after the first step that preempts (the picture)."""
    cfg = EngineConfig(block_size=args.block_size, num_blocks=num_blocks, max_num_seqs=len(prompts),
                       max_model_len=args.max_model_len, device=device)
    engine = Engine(model, config=cfg)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    seqs = dict(engine.requests)  # request id -> Sequence, to watch their counters
    victims: list[str] = []  # the scheduler's own victims, in the order it picked them
    schedule = engine.scheduler.schedule

    def watched_schedule():  # the engine calls this; it returns the scheduler's output unchanged
        out = schedule()
        victims.extend(seq.request_id for seq in out.preempted)
        return out

    engine.scheduler.schedule = watched_schedule
    final, step, t0, first, order = {}, 0, time.perf_counter(), None, []
    while engine.has_unfinished():
        computed = {i: s.num_computed_tokens for i, s in seqs.items()}
        before = queues(engine)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        step += 1
        engine.check_invariants()
        if first is None and victims:
            first = {"step": step, "before": before, "after": queues(engine)}
        for i in victims:  # in the scheduler's order: newest running sequence first
            order.append([step, i])
            if log:
                st = engine.stats()
                print(f"   step {step:>3}: preempted {i} ({computed[i]} tokens of K/V dropped, "
                      f"{seqs[i].num_tokens} tokens kept); after the step: running {st['num_running']}, "
                      f"waiting {st['num_waiting']}")
        victims.clear()
    stats = engine.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"], stats
    return {"outputs": [final[i].token_ids for i in ids], "reasons": [final[i].finish_reason for i in ids],
            "preemptions_per_request": [final[i].metrics.num_preemptions for i in ids],
            "num_preemptions": stats["num_preemptions"], "steps": stats["num_steps"],
            "prefill_tokens": stats["num_prefill_tokens"], "num_blocks": stats["num_total_blocks"],
            "seconds": time.perf_counter() - t0, "first_preemption": first, "preemption_order": order}
# --8<-- [end:serve]


def queues(engine: Engine) -> dict:
    """The scheduler's real queues (request ids, running oldest first, waiting front first) and each block's owner."""
    sch, owner = engine.scheduler, [None] * engine.block_manager.pool.num_blocks
    for seq in sch.running:
        for b in seq.block_table:
            owner[b] = seq.request_id
    return {"running": [s.request_id for s in sch.running], "waiting": [s.request_id for s in sch.waiting],
            "pool": owner}


def draw_preemption(first: dict, args: Settings) -> dict:
    """The pool (one cell per block, labelled with its owner) and both queues, before and after the step."""
    plt = plot.pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(10, 2.6))
    ids = sorted({r for snap in (first["before"], first["after"]) for r in snap["running"] + snap["waiting"]})
    for ax, when in zip(axes, ("before", "after")):
        snap = first[when]
        for b, r in enumerate(snap["pool"]):
            ax.add_patch(plt.Rectangle((b, 0), 1, 1, ec="0.3", fc=plt.cm.tab10(ids.index(r)) if r else "white",
                                       alpha=0.5 if r else 1))
            ax.text(b + 0.5, 0.5, r.removeprefix("req-") if r else "free", ha="center", va="center", fontsize=8)
        running, waiting = (" ".join(r.removeprefix("req-") for r in snap[q]) or "(empty)"
                            for q in ("running", "waiting"))
        ax.set_title(f"{when} step {first['step']}:  running (oldest first) {running}  |  waiting (front first) "
                     f"{waiting}", fontsize=9, loc="left")
        ax.set(xlim=(0, len(snap["pool"])), ylim=(0, 1))
        ax.axis("off")
    fig.tight_layout()
    print(f"   figure: {plot.save(fig, args, 'preemption')}")
    return first


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --8<-- [start:cost]
def measure_recompute_vs_swap(model, n: int, block_size: int, device: str, repeats: int = 5,
                              keep: bool = False) -> dict:
    """Seconds to re-prefill n tokens vs to copy their K/V blocks to host memory and back (best of `repeats`).
    keep: also return the blocks as the prefill wrote them and as they came back from the swap (for a test)."""
    dev = torch.device(device)
    nb = -(-n // block_size)
    runner = ModelRunner(model, num_blocks=nb, block_size=block_size, device=dev)
    table = list(range(nb))
    tokens = torch.randint(3, model.config.vocab_size, (n,)).tolist()
    batch = runner.prepare([0], [tokens], [table], [True])
    pin = dev.type == "cuda"
    host_k = torch.empty(runner.k_cache[:, table].shape, dtype=runner.k_cache.dtype, pin_memory=pin)
    host_v = torch.empty_like(host_k, pin_memory=pin)
    best_recompute = best_swap = float("inf")
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        runner.execute(batch)  # the whole prefill again: what recompute pays
        _sync(dev)
        t1 = time.perf_counter()
        written = (runner.k_cache[:, table].cpu().clone(), runner.v_cache[:, table].cpu().clone()) if keep else None
        host_k.copy_(runner.k_cache[:, table], non_blocking=pin)  # swap out: every layer's blocks
        host_v.copy_(runner.v_cache[:, table], non_blocking=pin)
        runner.k_cache[:, table] = host_k.to(dev, non_blocking=pin)  # swap back in
        runner.v_cache[:, table] = host_v.to(dev, non_blocking=pin)
        _sync(dev)
        t2 = time.perf_counter()
        best_recompute, best_swap = min(best_recompute, t1 - t0), min(best_swap, t2 - t1)
    out = {"tokens": n, "recompute_s": best_recompute, "swap_s": best_swap,
           "kv_bytes": 2 * host_k.numel() * host_k.element_size()}
    if keep:
        out["blocks_written"] = written
        out["blocks_restored"] = (runner.k_cache[:, table].cpu().clone(), runner.v_cache[:, table].cpu().clone())
    return out


def computed_recompute_vs_swap(shape: kvm.ModelShape, n: int, args: Settings) -> dict:
    """Llama-scale estimate: recompute = 2 * params * n / (peak * mfu); swap = 2 * n * kv_bytes / bandwidth."""
    flops = 2 * shape.num_params * n  # matmul FLOPs of a prefill (attention's n^2 term left out)
    recompute = flops / (args.gpu_tflops * 1e12 * args.mfu)
    kv_bytes = kvm.kv_bytes_per_request(kvm.shape_kv_bytes_per_token(shape, "bf16"), n)
    swap = 2 * kv_bytes / (args.pcie_gbps * 1e9)  # out, then back in
    return {"tokens": n, "recompute_s": recompute, "swap_s": swap, "kv_bytes": kv_bytes}
# --8<-- [end:cost]


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"num_requests": 3, "max_tokens": 30, "max_model_len": 48,
                                                "num_blocks": 8, "swap_tokens": 64})
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a tiny model: one thread is faster than two fighting over small matmuls
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model = load_pretrained("small")
    prompts = make_prompts(args.num_requests, args.seed)
    longest = max(len(p) for p in prompts) + args.max_tokens
    print(f"{len(prompts)} requests of {len(prompts[0])}-token prompts + {args.max_tokens} generated tokens "
          f"(up to {longest} tokens = {-(-longest // args.block_size)} blocks of {args.block_size} each), "
          f"device {device}\n")
    roomy = serve(model, prompts, args, None, device, log=False)
    print(f"1. Pool of {roomy['num_blocks']} blocks (room for all): {roomy['steps']} steps, "
          f"{roomy['num_preemptions']} preemptions.\n   Pool of {args.num_blocks} blocks:")
    tight = serve(model, prompts, args, args.num_blocks, device, log=True)
    report.expect_equal("every request finished by length", tight["reasons"], ["length"] * len(prompts))
    for i, (a, b) in enumerate(zip(tight["outputs"], roomy["outputs"])):
        report.expect_equal(f"request {i}: tokens with preemption vs without", a, b)
    extra = tight["prefill_tokens"] - roomy["prefill_tokens"]
    print(f"   {tight['steps']} steps, {tight['num_preemptions']} preemptions (per request "
          f"{tight['preemptions_per_request']}), {extra} tokens recomputed ({tight['prefill_tokens']} prefilled in "
          f"all, {roomy['prefill_tokens']} in the roomy run); every request's {args.max_tokens} "
          f"tokens equal the roomy run's; invariants held after every step; all {args.num_blocks} blocks free at "
          f"the end.")
    if tight["first_preemption"]:  # none when the pool is big enough
        tight["first_preemption"] = draw_preemption(tight["first_preemption"], args)

    measured = measure_recompute_vs_swap(model, args.swap_tokens, args.block_size, device)
    llama = kvm.MODEL_SHAPES["llama-3-8b"]
    rows = [{"case": f"mlsys-small, measured on {device}", **measured}]
    for n in (args.swap_tokens, 2048, 8192):
        rows.append({"case": "llama-3-8b bf16, computed", **computed_recompute_vs_swap(llama, n, args)})
    for r in rows:
        mib = r.pop("kv_bytes") / kvm.MIB
        r["KV MiB"] = int(mib) if mib.is_integer() else mib  # 1024, not 1.02e+03
        r["recompute / swap"] = r["recompute_s"] / r["swap_s"]
    print("\n2. Paying for a preempted sequence: recompute (prefill again) vs swap (K/V out and back in)"
          + ("  [CPU: 'swap' is a memory copy here, not a PCIe transfer]" if device == "cpu" else ""))
    print(report.table(rows, floatfmt=".3g"))
    print(f"   computed with {args.gpu_tflops:g} TFLOPS x {args.mfu:g} MFU and {args.pcie_gbps:g} GB/s per "
          "direction; the ratio does not depend on n: params * bandwidth / (peak * MFU * kv_bytes_per_token).")
    if args.json:
        for r in (tight, roomy):
            del r["outputs"]
        report.write_json(args.json, {"tight": tight, "roomy": roomy, "recomputed_tokens": extra,
                                      "cost": rows, "device": device}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
