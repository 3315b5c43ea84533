"""Weight sync: broadcast a freshly updated policy from the trainer rank to the rollout ranks, per tensor and bucketed.

What it shows
    Rank 0 is the trainer, ranks 1.. are rollout workers holding stale copies of the same architecture. For each
    model size (the book's GPT presets plus two wider synthetic configs), the trainer takes one real AdamW step, then
    1. sends the new weights with one dist.broadcast per tensor, and again packed into buckets of --bucket-mb MiB
       (mlsys/weight_sync.py); after each, every receiving rank checks torch.equal on every tensor against a
       reference that travelled by a different road (pickled with broadcast_object_list);
    2. times both ways, the two taking turns (slowest rank, best of --iters after a warm-up,
       mlsys.bench.time_collective), and reports ms per MiB and the ratio of the two times;
    3. sweeps the bucket size on the largest model;
    4. on the last rollout rank, loads the received weights into the inference engine (Engine.load_weights) and
       checks that its greedy completions equal the trainer's own generate().
    Figures: how plan_buckets packs the 'draft' GPT's tensors into buckets of --figure-bucket-kb KiB
    (weight_sync/buckets.png); sync time against model size, per tensor vs bucketed (weight_sync/sync_time.png).

How to run
    python tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/weight_sync.py            # 1 trainer + 1 rollout
    python tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/weight_sync.py -w 3       # 2 rollout ranks
    torchrun --nproc-per-node 2 tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/weight_sync.py
    ... --backend nccl      # on a machine with one GPU per rank: the same code over NCCL, tensors on cuda

Prints a table (model, MiB, tensors, buckets, ms per tensor-wise sync, ms bucketed, ms/MiB of each), the checks, the
rows that the bytes-only-grow rule flags as disturbed, the formula's estimate per model against the measured time
(section 1), the sweep rows where fewer calls took longer, and what the smallest buckets saved against the
per-tensor sync (the sweep's `alone` column: tensors larger than a bucket).
Runtime on 2 cores: about 10-27 s, 10 s idle (the CI book build) and 20-27 s at a load average of 5 (gloo over
loopback; other jobs on the cores multiply it: about 75 s at 10); --smoke about 11 s at load 5.

Try next
    python tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/weight_sync.py -w 3 --bucket-mb 1
        -> two rollout ranks and 1 MiB buckets: every receiver checks bit for bit; the table's buckets column
           rises for the models larger than 1 MiB (the sweep does not depend on the flag); the sweep's 1 MiB row
           now repeats the table's bucketed sync of the largest model in the same run: compare the two times,
           separate timings that can agree or differ;
           three processes on 2 cores: about 35-45 s at a load average of 5-8, and roughly load average / cores
           times longer under more load (both on the first line)
    python tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/weight_sync.py --bucket-mb 64
        -> fewer, larger buckets: fewer calls, and a bigger temporary buffer on every rank; on the bigger models
           the extra packing copy can make bucketing slower than per-tensor sends
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mlsys import bench, cli, plot, report
from mlsys.launch import RankContext, launch
from mlsys.model import GPT, GPTConfig, generate
from mlsys.weight_sync import (
    broadcast_bucketed,
    broadcast_per_tensor,
    named_meta,
    plan_buckets,
    tensors_equal,
    unique_parameters,
)

MB = 1 << 20  # the --bucket-mb flags and every "MiB" printed: 2**20 bytes
# The book's presets plus two wider ones, so the sizes span ~0.1 MiB to ~60 MiB of fp32 weights.
SIZES: dict[str, dict] = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=32, block_size=64),
    "draft": dict(n_layer=2, n_head=2, n_embd=64, block_size=256),
    "small": dict(n_layer=4, n_head=4, n_embd=128, block_size=256),
    "medium": dict(n_layer=6, n_head=8, n_embd=256, block_size=256),
    "large": dict(n_layer=8, n_head=8, n_embd=384, block_size=256),
}


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    models: list[str] = field(default_factory=lambda: list(SIZES))
    """Model sizes to sync, from: tiny draft small medium large."""
    bucket_mb: float = 4.0
    """Bucket size in MiB (2**20 bytes) for the bucketed sync."""
    sweep_mb: list[float] = field(default_factory=lambda: [0.0625, 0.25, 1.0, 4.0, 16.0])
    """Bucket sizes (MiB) tried on the largest model; `--sweep-mb 0` skips the sweep."""
    figure_bucket_kb: float = 96.0
    """Bucket size (KiB) of the packing figure buckets.png, drawn for the 'draft' model."""
    iters: int = 7
    """Timed syncs per measurement, after one warm-up; the fastest is reported (the least disturbed by other work
    on a shared machine). The methods compared (per tensor and bucketed; the sweep's bucket sizes) take turns."""

    def validate(self) -> None:
        bad = [m for m in self.models if m not in SIZES]
        if bad or not self.models:
            raise cli.UsageError(f"--models must name sizes from {list(SIZES)}, got {self.models}")
        if self.sweep_mb == [0]:
            self.sweep_mb = []  # the one way to ask for no sweep: the flag takes at least one value
        if not self.bucket_mb > 0 or any(not b > 0 for b in self.sweep_mb):
            raise cli.UsageError("--bucket-mb and --sweep-mb must be > 0 (or --sweep-mb 0 alone, no sweep)")
        if not self.figure_bucket_kb > 0:
            raise cli.UsageError("--figure-bucket-kb must be > 0")
        if self.iters < 1:
            raise cli.UsageError(f"--iters must be >= 1, got {self.iters}")


def trained_policy(size: str, seed: int, device: torch.device) -> GPT:
    """The trainer's policy after one real AdamW step on a seeded batch (so it differs from any stale copy)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**SIZES[size])).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(model.config.vocab_size, (4, 33), device=device)  # (B, T+1) token ids
    _, loss = model(idx[:, :-1], targets=idx[:, 1:])
    loss.backward()
    opt.step()
    return model


def stale_policy(size: str, seed: int, device: torch.device) -> GPT:
    """A rollout worker's copy: same architecture, other (older) weights."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(**SIZES[size])).to(device)


# --8<-- [start:check]
def check_sync(ctx: RankContext, params: dict[str, torch.Tensor], how: str) -> None:
    """Every receiving rank compares every tensor bitwise with the trainer's, sent a second way (pickled)."""
    ref = [{n: t.detach().cpu() for n, t in params.items()} if ctx.rank == 0 else None]
    dist.broadcast_object_list(ref, src=0)  # pickled, on the same group: independent of pack/unpack, not of gloo
    bad = tensors_equal(params, ref[0])
    flags = [None] * ctx.world_size
    dist.all_gather_object(flags, bad)
    if ctx.rank == 0:
        for r, names in enumerate(flags):
            if names:
                raise cli.SelfCheckFailed(f"{how} sync: rank {r} differs from the trainer in {names[:3]}")
# --8<-- [end:check]


def fastest(calls: list, repeats: int, device: torch.device) -> list[float]:
    """Seconds of one call of each of `calls` (the slowest rank's), the best of `repeats` after a warm-up, with the
    garbage collector out of the way. The calls take turns, round by round, so a burst of other work on a shared
    machine slows all of them alike rather than the one that happened to be timed then. Every rank runs the same
    sequence of collectives, so they stay in step."""
    with bench.steady_timing():
        for call in calls:  # warm-up
            bench.time_collective(call, 0, 1, device)
        best = [float("inf")] * len(calls)
        for _ in range(repeats):
            for i, call in enumerate(calls):
                best[i] = min(best[i], bench.time_collective(call, 0, 1, device))
    return best


def sync_one_size(ctx: RankContext, args: Settings, size: str) -> dict:
    model = trained_policy(size, args.seed, ctx.device) if ctx.rank == 0 else \
        stale_policy(size, args.seed + 1000 + ctx.rank, ctx.device)
    params = unique_parameters(model)  # the tied lm_head is wte: sent once
    stale = {n: t.detach().clone() for n, t in params.items()}
    plan = plan_buckets(named_meta(params), int(args.bucket_mb * MB))
    nbytes = sum(t.numel() * t.element_size() for t in params.values())

    broadcast_per_tensor(params, src=0)
    check_sync(ctx, params, "per-tensor")
    if ctx.rank != 0:  # back to the stale weights, so the bucketed path has real work to prove
        with torch.no_grad():
            for n, t in params.items():
                t.copy_(stale[n])
    broadcast_bucketed(params, plan, src=0)
    check_sync(ctx, params, "bucketed")

    t_tensor, t_bucket = fastest([lambda: broadcast_per_tensor(params, 0),
                                  lambda: broadcast_bucketed(params, plan, 0)], args.iters, ctx.device)
    return {"model": size, "params": sum(t.numel() for t in params.values()), "MiB": nbytes / MB,
            "tensors": len(params), "buckets": len(plan), "per-tensor ms": t_tensor * 1e3,
            "bucketed ms": t_bucket * 1e3, "per-tensor ms/MiB": t_tensor * 1e3 / (nbytes / MB),
            "bucketed ms/MiB": t_bucket * 1e3 / (nbytes / MB), "_model": model}


def bucket_sweep(ctx: RankContext, args: Settings, model: GPT) -> list[dict]:
    params = unique_parameters(model)
    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    plans = [plan_buckets(named_meta(params), int(mb * MB)) for mb in args.sweep_mb]
    times = fastest([lambda p=p: broadcast_bucketed(params, p, 0) for p in plans], args.iters, ctx.device)
    # alone: buckets that hold one tensor larger than the capacity (sent with the same bytes as per tensor, plus the
    # copies in and out of the bucket's buffer); MiB alone: their bytes
    rows = [{"bucket MiB": mb, "buckets": len(p), "alone": sum(b.nbytes > mb * MB for b in p),
             "MiB alone": sum(b.nbytes for b in p if b.nbytes > mb * MB) / MB, "ms": t * 1e3,
             "ms/MiB": t * 1e3 / (nbytes / MB)}
            for mb, p, t in zip(args.sweep_mb, plans, times)]
    return rows


def disturbed_rows(rows: list[dict], key: str) -> list[str]:
    """Models whose `key` time is above the next row's: the bytes only grow down the table, so such a row was
    disturbed (too slow), the rule of the sync_time figure's caption."""
    return [a["model"] for a, b in zip(rows, rows[1:]) if a[key] > b[key]]


def disturbed_text(rows: list[dict]) -> str:
    """The rows the bytes-only-grow rule flags, per method, or 'none'."""
    nxt = {a["model"]: b["model"] for a, b in zip(rows, rows[1:])}
    parts = [f"{m} {how} (slower than {nxt[m]})" for how, key in (("per-tensor", "per-tensor ms"),
                                                                  ("bucketed", "bucketed ms"))
             for m in disturbed_rows(rows, key)]
    return ", ".join(parts) or "none"


def flagged_rows(rows: list[dict]) -> set[str]:
    """Models the Disturbed line flags, for either method; never the last row (no larger model below it)."""
    return {m for key in ("per-tensor ms", "bucketed ms") for m in disturbed_rows(rows, key)}


def verdict(ratio: float) -> str:
    """A per-tensor / bucketed time ratio in words: above 1 bucketing was faster, below 1 slower."""
    return f"{ratio:.2f}, bucketing " + ("faster" if ratio > 1 else "slower" if ratio < 1 else "no faster")


def ratio_evidence(rows: list[dict]) -> dict:
    """The per-tensor / bucketed ratio worth quoting: the largest among the rows the Disturbed line does not flag (a
    flagged time pushes its row's ratio up or down)."""
    flagged = flagged_rows(rows)
    ratio = {r["model"]: r["per-tensor ms"] / r["bucketed ms"] for r in rows}
    kept = [r for r in rows if r["model"] not in flagged]  # never empty: no row below the last can flag it
    best = max(kept, key=lambda r: ratio[r["model"]])
    text = f"{best['model']} ({best['MiB']:.2f} MiB) {verdict(ratio[best['model']])}"
    return {"model": best["model"], "MiB": best["MiB"], "speedup": ratio[best["model"]], "text": text}


def compare_text(terms: list[dict]) -> str:
    """Which rows' measured per-tensor time came out above the formula's estimate and which below, from the values."""
    side = {k: ", ".join(t["model"] for t in terms if t["side"] == k) for k in ("above", "below", "equal to")}
    return "; ".join(f"{k} for {v}" for k, v in side.items() if v)


def formula_estimate(rows: list[dict]) -> dict:
    """Section 1's formula with constants read off the table: alpha, the per-tensor time over its calls of the
    smallest model the Disturbed line does not flag (its bytes taken as free); 1/bw, the largest model's bucketed
    ms/MiB (the row with the fewest calls per byte). Per model: the calls term N*alpha, the bytes term S/bw, their
    sum (the per-tensor estimate), the measured per-tensor time, and measured / estimate."""
    src = next(r for r in rows if r["model"] not in flagged_rows(rows))  # the last row is never flagged
    alpha, per_mib = src["per-tensor ms"] / src["tensors"], rows[-1]["bucketed ms/MiB"]
    terms = []
    for r in rows:
        calls, nbytes = r["tensors"] * alpha, r["MiB"] * per_mib
        est, got = calls + nbytes, r["per-tensor ms"]
        terms.append({"model": r["model"], "N*alpha ms": calls, "S/bw ms": nbytes, "estimate ms": est,
                      "measured ms": got, "measured / estimate": got / est,
                      "larger": "calls" if calls > nbytes else "bytes",
                      "side": "above" if got > est else "below" if got < est else "equal to"})
    named = {k: ", ".join(t["model"] for t in terms if t["larger"] == k) or "no model" for k in ("calls", "bytes")}
    text = (f"alpha ~ {alpha:.3f} ms per call ({src['model']}, the smallest unflagged model), "
            f"1/bw ~ {per_mib:.3f} ms/MiB ({rows[-1]['model']}, bucketed)")
    return {"alpha_ms": alpha, "alpha_model": src["model"], "ms_per_mib": per_mib, "terms": terms,
            "calls_larger": named["calls"], "bytes_larger": named["bytes"], "text": text,
            "compare_text": compare_text(terms)}


def sweep_order_breaks(sweep: list[dict]) -> list[tuple[dict, dict]]:
    """(more calls, fewer calls) pairs of neighbouring sweep rows where the one with fewer calls took longer."""
    return [(a, b) for a, b in zip(sweep, sweep[1:]) if b["buckets"] < a["buckets"] and b["ms"] > a["ms"]]


def sweep_order_text(sweep: list[dict]) -> str:
    """Which neighbouring sweep rows broke the 'fewer calls, less time' order, if any."""
    breaks = sweep_order_breaks(sweep)
    if not breaks:
        return "fewer calls always took less time"
    return "fewer calls took longer at " + "; ".join(
        f"{b['bucket MiB']:g} MiB ({b['buckets']} calls, {b['ms']:.1f} ms) against {a['bucket MiB']:g} MiB "
        f"({a['buckets']} calls, {a['ms']:.1f} ms)" for a, b in breaks)


def sweep_vs_per_tensor_text(first: dict, big: dict) -> str:
    """The sweep's smallest buckets against the per-tensor sync of the same model: the direction first, from the two
    times; then the reason, from the plan (tensors larger than a bucket travel alone, one call each, and still pass
    through the bucket's buffer on every rank)."""
    saved = big["tensors"] - first["buckets"]
    how = "slower" if first["ms"] > big["per-tensor ms"] else "faster" if first["ms"] < big["per-tensor ms"] else \
        "as fast"
    text = f"{how} ({first['ms']:.1f} ms against {big['per-tensor ms']:.1f} ms); at {first['bucket MiB']:g} MiB "
    if first["alone"]:
        text += (f"{first['alone']} of the {big['tensors']} tensors ({first['MiB alone']:.1f} of {big['MiB']:.1f} "
                 f"MiB) travel alone, so bucketing saves just {saved} calls")
    else:
        text += f"every tensor fits in a bucket, and bucketing saves {saved} calls"
    return text + ", and still copies every byte in and out"


def check_engine_serves_new_weights(ctx: RankContext, model: GPT) -> dict:
    """The last rollout rank loads the synced weights into the inference engine; its greedy tokens must equal the
    trainer's generate() with the trainer's own weights. Returns both, for the caller and the JSON."""
    from mlsys.engine import Engine, EngineConfig, SamplingParams

    prompts = [[1, 5, 9, 13], [1, 7, 7, 2, 30]]
    n = 12
    tokens = None
    if ctx.rank == 0:
        tokens = [generate(model.eval(), torch.tensor([p], device=ctx.device), n)[0, len(p):].tolist()
                  for p in prompts]
    elif ctx.rank == ctx.world_size - 1:
        engine = Engine(model.cpu(), config=EngineConfig(block_size=8, max_num_seqs=4))
        engine.load_weights(model.state_dict())
        outs = engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        tokens = [o.token_ids for o in outs]
    got = [None] * ctx.world_size
    dist.all_gather_object(got, tokens)
    return {"prompts": prompts, "trainer_tokens": got[0], "engine_tokens": got[-1]}


def worker(ctx: RankContext, args: Settings) -> dict:
    rows = []
    for size in args.models:
        rows.append(sync_one_size(ctx, args, size))
        ctx.print(f"  {size}: {rows[-1]['MiB']:.2f} MiB, bitwise equal on every rank after both syncs")
    largest = rows[-1]["_model"]
    sweep = bucket_sweep(ctx, args, largest) if args.sweep_mb else []
    served = check_engine_serves_new_weights(ctx, rows[0]["_model"])
    for r in rows:
        del r["_model"]
    return {"rows": rows, "sweep": sweep, "served": served}


def draw_buckets(args: Settings, size: str = "draft") -> dict:
    """The real plan_buckets plan of one model at --figure-bucket-kb: one row per bucket, one box per tensor at
    its byte offset, the capacity as a dashed line. Returns what it drew (bytes, per bucket and per tensor)."""
    from matplotlib.patches import Patch, Rectangle

    plt = plot.pyplot()
    capacity = int(args.figure_bucket_kb * 1024)
    params = unique_parameters(GPT(GPTConfig(**SIZES[size])))  # names, shapes, dtypes: what every rank plans from
    plan = plan_buckets(named_meta(params), capacity)
    colours = {"embedding": "#9ecae1", "attention": "#fdae6b", "mlp": "#a1d99b", "norm or bias": "#bcbddc"}

    def kind(name: str) -> str:
        if name.endswith("bias") or ".ln" in name or name.startswith("ln"):
            return "norm or bias"
        return "embedding" if name.startswith("w") else "attention" if ".attn." in name else "mlp"

    drawn = []
    fig, ax = plt.subplots(figsize=(9, 0.34 * len(plan) + 1.4), layout="constrained")
    for b, bucket in enumerate(plan):
        item = torch.empty((), dtype=bucket.dtype).element_size()
        slots = [(s.name, s.offset * item, s.numel * item) for s in bucket.slots]
        for name, start, nbytes in slots:
            ax.add_patch(Rectangle((start / 1024, b), nbytes / 1024, 0.8, facecolor=colours[kind(name)],
                                   edgecolor="white", linewidth=0.8))
            if nbytes >= 8 * 1024:  # label the big tensors only; the small ones are slivers
                ax.text((start + nbytes / 2) / 1024, b + 0.4, name.replace(".weight", ""), ha="center",
                        va="center", fontsize=6.5)
        total = bucket.nbytes
        ax.text(max(total, capacity) / 1024 + 1, b + 0.4, f"{total / 1024:.1f} KiB, {len(slots)} tensor(s)"
                + ("  (alone: larger than a bucket)" if total > capacity else ""), va="center", fontsize=7)
        drawn.append({"bucket": b, "nbytes": total, "slots": slots})
    ax.axvline(capacity / 1024, color="black", ls="--", lw=1)
    ax.set_xlim(0, max(capacity, *(b.nbytes for b in plan)) / 1024 * 1.45)
    ax.set_ylim(len(plan), -0.2)
    ax.set_yticks([b + 0.4 for b in range(len(plan))], [f"bucket {b}" for b in range(len(plan))], fontsize=7)
    ax.set_xlabel(f"bytes into the flat buffer (KiB); dashed: the capacity, {args.figure_bucket_kb:g} KiB")
    ax.set_title(f"plan_buckets for the '{size}' GPT ({len(params)} tensors in parameter order, fp32): "
                 f"{len(plan)} buckets, one broadcast each", fontsize=9)
    ax.grid(False)
    fig.legend(handles=[Patch(color=c, label=k) for k, c in colours.items()], loc="outside lower center", ncol=4,
               fontsize=7)  # below the plot, where it cannot hide a bucket's label
    print(f"figure: {plot.save(fig, args, 'buckets')}")
    return {"model": size, "capacity": capacity, "tensors": len(params), "num_buckets": len(drawn), "buckets": drawn,
            "order": list(params)}


def draw(rows: list[dict], args: Settings, receivers: int) -> None:
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    mbs = [r["MiB"] for r in rows]
    ax.loglog(mbs, [r["per-tensor ms"] for r in rows], "o-", label="one broadcast per tensor")
    ax.loglog(mbs, [r["bucketed ms"] for r in rows], "s-", label=f"bucketed ({args.bucket_mb:g} MiB buckets)")
    for r in rows:
        ax.annotate(r["model"], (r["MiB"], r["bucketed ms"]), textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xlabel("fp32 weights sent (MiB)")
    ax.set_ylabel("sync time (ms, slowest rank)")
    ax.set_title(f"Trainer -> {receivers} rollout rank(s), {args.backend}")
    ax.legend()
    print(f"figure: {plot.save(fig, args, 'sync_time')}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"models": ["tiny", "draft", "small"], "sweep_mb": [0.25, 4.0],
                                                  "iters": 2},
                     world_sizes=lambda w: w >= 2, world_sizes_text="of 2 or more (rank 0 trains, the rest roll out)")
    print(f"Weight sync: rank 0 (trainer) -> ranks 1..{args.world_size - 1} (rollout), backend {args.backend}, "
          f"{bench.load_average()} before the run")
    packing = draw_buckets(args)
    print(f"buckets.png: the '{packing['model']}' GPT's {packing['tensors']} tensors packed into "
          f"{len(packing['buckets'])} buckets of at most {args.figure_bucket_kb:g} KiB")
    out = launch(worker, args)
    rows, sweep = out["rows"], out["sweep"]
    print("\n" + report.table(rows, floatfmt=".3g"))
    if sweep:
        print(f"\nBucket size sweep on {rows[-1]['model']} ({rows[-1]['MiB']:.1f} MiB):")
        print(report.table(sweep, floatfmt=".3g"))
    if out["served"]["engine_tokens"] != out["served"]["trainer_tokens"]:
        raise cli.SelfCheckFailed("the engine on the rollout rank generated other tokens than the trainer's model")
    print(f"\nEngine.load_weights on rank {args.world_size - 1}: greedy completions equal the trainer's  OK")
    big = rows[-1]
    speedup = {r["model"]: r["per-tensor ms"] / r["bucketed ms"] for r in rows}  # > 1: bucketing was faster
    reading = {"disturbed": {key: disturbed_rows(rows, key) for key in ("per-tensor ms", "bucketed ms")},
               "disturbed_text": disturbed_text(rows)}
    print(f"Disturbed rows (left out of the largest ratio and of alpha below): {reading['disturbed_text']}")
    print(f"Per-tensor / bucketed time: {big['model']} {verdict(speedup[big['model']])}; largest: "
          f"{ratio_evidence(rows)['text']}")
    estimate = formula_estimate(rows)
    print(f"\nFormula estimate of the per-tensor sync, N*alpha + S/bw: {estimate['text']}")
    print(report.table([{k: v for k, v in t.items() if k not in ("larger", "side")} for t in estimate["terms"]],
                       floatfmt=".3g"))
    print(f"Measured against the estimate: {estimate['compare_text']}")
    if sweep:
        reading["sweep_breaks"] = [[a["bucket MiB"], b["bucket MiB"]] for a, b in sweep_order_breaks(sweep)]
        reading["sweep_text"] = sweep_order_text(sweep)
        reading["sweep_vs_per_tensor_text"] = sweep_vs_per_tensor_text(sweep[0], big)
        print(f"Bucket sweep, calls against time: {reading['sweep_text']}")
        print(f"Smallest buckets against per tensor: {reading['sweep_vs_per_tensor_text']}")
    draw(rows, args, args.world_size - 1)
    if args.json:
        summary = {"largest": {"model": big["model"], "MiB": big["MiB"], "speedup": speedup[big["model"]]},
                   "unflagged": ratio_evidence(rows)}
        report.write_json(args.json, {"summary": summary, "rows": rows, "sweep": sweep, "served": out["served"],
                                      "packing": packing, "reading": reading, "estimate": estimate},
                          args)
    return 0


if __name__ == "__main__":
    cli.run(main)
