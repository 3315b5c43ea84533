"""Context parallelism: ring attention and Ulysses split one long sequence over W ranks, measured.

What it shows
    0. The online-softmax merge on one query and two K/V blocks of three keys, through the ring kernel's own
       block_attention and merge: each block's partial output and log-sum-exp, their merge, and one softmax over
       all six scores, equal.
    1. Causal attention over a sequence sharded on W ranks, three ways: ring attention with the zigzag split,
       ring attention with a contiguous split, and Ulysses (all-to-all from tokens to heads and back). Each one's
       output and the gradients of q, k and v, gathered from the shards, equal scaled_dot_product_attention on the
       whole sequence in one process (float64). A length that does not split evenly is padded at the end.
    2. The bytes each rank sent, counted on the wire, against mlsys.context_parallel.comm_bytes.
    3. The causal work each rank did (query-key pairs scored, counted by the kernel) for both splits: contiguous
       leaves the last rank about 2W-1 times the first rank's work, zigzag gives every rank the same.
    4. Peak memory of one attention layer's forward + backward (float32) on each rank against one process doing
       the whole sequence, for growing lengths: the resident-memory high-water mark (Linux VmHWM, reset before
       each measurement) minus the memory in use just before.
    5. torch's own context_parallel (torch.distributed.tensor.experimental) as a second oracle, where it runs:
       on CPU it raises for its missing CPU attention kernel, and the script says so.
    Pictures drawn from the real runs: ring.gif (+ ring_strip.png), the K/V chunk each rank's ring kernel was
    handed at each step of the zigzag run of 1., and the (query chunk, key chunk) pairs it scored, recorded as the
    kernel was called; ulysses.png, which (head, token) cells each rank holds before and after Ulysses' first
    all-to-all, read back from a tensor whose entries are their own (head, token) numbers.

How to run
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/context_parallel.py -w 4
    torchrun --nproc-per-node 4 tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/context_parallel.py

Prints each part as soon as it is done: the merge example, the equality and bytes table, the work per rank and
the memory-vs-length table; draws .cache/figures/context_parallel/memory.png, balance.png, ring.gif,
ring_strip.png and ulysses.png.
Runtime on 2 cores: about 23 s on 2 idle cores, several times longer under load (most of it the memory
measurement); --smoke about 3 s.

Try next
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/context_parallel.py -w 2
        (about as long as the default run) -> at W = 2 ring attention's forward sends exactly what Ulysses' does
           (two shards per rank), its backward three times as much
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/context_parallel.py -w 3
        (about as long as the default run, most of it the memory measurement) -> 3 does not divide 8 heads:
           ring attention runs, Ulysses is skipped and the script says why
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/context_parallel.py --lengths 8192 16384
        (much longer than the default run, most of it the 16k measurement; on a loaded machine add --timeout 600,
        as the other ranks wait for rank 0's one-process pass) -> the one-process peak doubles from 8k to 16k
           tokens, and the largest rank's stays about the same fraction of it
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mlsys import cli, plot, report
from mlsys import context_parallel as cp
from mlsys.launch import RankContext, launch
from mlsys.tp_formulas import layer_comm_volume


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 4
    """Number of ranks the sequence is split over. Under torchrun it is taken from WORLD_SIZE."""
    seq: int = 1003
    """Tokens in the equality check (float64); padded at the end when it does not split evenly."""
    heads: int = 8
    """Attention heads H; Ulysses needs W to divide it."""
    head_dim: int = 32
    """Width of one head D."""
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    """Sequence lengths for the memory measurement (float32, batch 1)."""
    q_tile: int = 128
    """Query rows the ring kernel scores at a time: the scores held at once are q_tile x (K/V chunk length)."""

    def validate(self) -> None:
        for name in ("seq", "heads", "head_dim", "q_tile"):
            if getattr(self, name) < 1:
                raise cli.UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.lengths or min(self.lengths) < 2 * self.world_size:
            raise cli.UsageError(f"--lengths must be given and each at least 2W = {2 * self.world_size}")
        if max(self.lengths) > 65536 or self.seq > 65536:
            raise cli.UsageError("--lengths and --seq must be at most 65536 tokens on this machine")


def methods(args: Settings, world: int) -> list[tuple[str, str]]:
    """(method, layout) pairs this world size can run: Ulysses only where W divides the heads."""
    return [("ring", "zigzag"), ("ring", "contiguous")] + (
        [("ulysses", "contiguous")] if args.heads % world == 0 else [])


def attend(method: str, layout: str, q, k, v, group, q_tile: int) -> torch.Tensor:
    if method == "ring":
        return cp.ring_attention(q, k, v, group=group, layout=layout, q_tile=q_tile)
    return cp.ulysses_attention(q, k, v, group=group)


def gather(t: torch.Tensor, world: int, layout: str) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return cp.unshard(parts, layout)


@contextlib.contextmanager
def trace_ring_steps():
    """Record every K/V block the ring kernel is handed on this rank, in the order it is called: the query chunks
    it holds, the K/V chunks it was given, and the (query chunk, key chunk, masked) pairs it scores (the others lie
    wholly above the causal diagonal and are skipped)."""
    calls, real = [], cp.block_attention

    def traced(q, k, v, q_chunks, k_chunks, *rest, **kw):
        calls.append({"q": [list(c) for c in q_chunks], "kv": [list(c) for c in k_chunks],
                      "pairs": [[list(qc), list(kc), masked] for _, qc, _, kc, masked in cp._chunk_pairs(q_chunks,
                                                                                                         k_chunks)]})
        return real(q, k, v, q_chunks, k_chunks, *rest, **kw)

    cp.block_attention = traced  # RingAttention.forward looks block_attention up in its module at each call
    try:
        yield calls
    finally:
        cp.block_attention = real


def equality(ctx: RankContext, args: Settings, method: str, layout: str) -> dict:
    """One method on this rank's shard, gathered and compared with SDPA on the whole sequence (float64)."""
    world, group, s = ctx.world_size, dist.group.WORLD, args.seq
    gen = torch.Generator().manual_seed(args.seed)
    q, k, v, dout = (torch.randn(1, args.heads, s, args.head_dim, generator=gen, dtype=torch.float64)
                     for _ in range(4))
    padded = cp.padded_length(s, world, layout)
    pad = (0, 0, 0, padded - s)  # zeros at the end of the sequence dim: causal masking hides them
    local = [cp.shard(F.pad(t, pad), world, ctx.rank, layout).to(ctx.device).requires_grad_(True) for t in (q, k, v)]
    with cp.comm_log() as log, trace_ring_steps() as steps:
        out = attend(method, layout, *local, group, args.q_tile)
        steps = list(steps)  # the forward's blocks only
        out.backward(cp.shard(F.pad(dout, pad), world, ctx.rank, layout).to(ctx.device))
    got = [gather(t.detach(), world, layout)[..., :s, :].cpu() for t in (out, *(x.grad for x in local))]
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True)
    ref.backward(dout)
    errs = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref.detach(), *(t.grad for t in full)), strict=True):
        report.expect_close(f"{method} ({layout}) {name} vs one process", a, b, rtol=1e-9, atol=1e-9)
        errs[name] = float((a - b).abs().max())
    sent = {phase: sum(e.nbytes for e in log if e.phase == phase) for phase in ("forward", "backward")}
    formula = cp.comm_bytes(method, padded, world, args.heads, args.head_dim, dtype_bytes=8)
    report.expect_equal(f"{method} ({layout}) bytes sent vs formula", sent, formula)
    every = [None] * world
    dist.all_gather_object(every, steps)  # every rank's blocks, step by step
    return {"ring_steps": every, "method": method, "layout": layout,
            "padded_to": padded, **{f"err_{k}": v for k, v in errs.items()},
            "sent_fwd_B": sent["forward"], "sent_bwd_B": sent["backward"], "formula_fwd_B": formula["forward"],
            "formula_bwd_B": formula["backward"]}


# One query's scores against two K/V blocks of three keys, picked by hand (the logits of the cross-entropy example
# earlier in the chapter), and one value per key (D = 1): the key's position, so the output is an average position.
MERGE_SCORES = ((1.0, 3.0, 0.0), (2.0, 0.0, 1.0))
MERGE_VALUES = ((0.0, 1.0, 2.0), (3.0, 4.0, 5.0))


def merge_example() -> dict:
    """The online-softmax merge on numbers small enough to read, through the ring kernel's own block_attention and
    merge: each block's partial output o and log-sum-exp lse alone, then block 2 merged into block 1 as a ring
    step does, against one softmax over all six scores (float64). With q = 1, D = 1 and scale 1, each key's score
    is its k."""
    q = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    q_chunks = [(5, 6)]  # the query sits at position 5: causally it sees all six keys
    blocks = []
    for i, (scores, values) in enumerate(zip(MERGE_SCORES, MERGE_VALUES, strict=True)):
        k, v = (torch.tensor(x, dtype=torch.float64).view(1, 1, 3, 1) for x in (scores, values))
        out, lse = torch.zeros_like(q), torch.full((1, 1, 1), float("-inf"), dtype=torch.float64)
        cp.block_attention(q, k, v, q_chunks, [(3 * i, 3 * i + 3)], out, lse, 1.0)  # from empty: o and lse alone
        blocks.append({"k": k, "v": v, "o": out, "lse": lse})
    out, lse = blocks[0]["o"].clone(), blocks[0]["lse"].clone()
    cp.block_attention(q, blocks[1]["k"], blocks[1]["v"], q_chunks, [(3, 6)], out, lse, 1.0)  # a ring step's merge
    scores, values = (torch.tensor(sum(x, ()), dtype=torch.float64) for x in (MERGE_SCORES, MERGE_VALUES))
    one_o, one_lse = float(torch.softmax(scores, 0) @ values), float(torch.logsumexp(scores, 0))
    report.expect_close("merged two blocks vs one softmax", torch.tensor([float(out), float(lse)], dtype=torch.float64),
                        torch.tensor([one_o, one_lse], dtype=torch.float64), rtol=1e-12, atol=1e-12)
    ls = [float(b["lse"]) for b in blocks]
    return {"blocks": [{"scores": list(sc), "values": list(va), "o": float(b["o"]), "lse": float(b["lse"])}
                       for sc, va, b in zip(MERGE_SCORES, MERGE_VALUES, blocks, strict=True)],
            "merged": {"o": float(out), "lse": float(lse), "w1": math.exp(ls[0] - float(lse)),
                       "w2": math.exp(ls[1] - float(lse))},
            "one_softmax": {"o": one_o, "lse": one_lse}}


def merge_rows(ex: dict) -> list[dict]:
    """The merge example as table rows: the two blocks, the merge (with each side's weight), one softmax."""
    def nums(xs):
        return ", ".join(f"{x:g}" for x in xs)
    rows = [{"": f"block {i + 1} alone", "scores": nums(b["scores"]), "values": nums(b["values"]),
             "o": f"{b['o']:.4f}", "lse": f"{b['lse']:.4f}"} for i, b in enumerate(ex["blocks"])]
    m, one = ex["merged"], ex["one_softmax"]
    rows.append({"": "merge of the two", "scores": f"weights {m['w1']:.4f}, {m['w2']:.4f}", "values": "",
                 "o": f"{m['o']:.4f}", "lse": f"{m['lse']:.4f}"})
    rows.append({"": "one softmax, all 6", "scores": nums(sum((b["scores"] for b in ex["blocks"]), [])),
                 "values": nums(sum((b["values"] for b in ex["blocks"]), [])), "o": f"{one['o']:.4f}",
                 "lse": f"{one['lse']:.4f}"})
    return rows


def work_per_rank(ctx: RankContext, args: Settings, layout: str) -> list[int]:
    """Query-key pairs this rank's kernel scored in the forward pass, every rank's, counted (not computed)."""
    world, s = ctx.world_size, cp.padded_length(args.seq, ctx.world_size, "zigzag")
    q = torch.randn(1, 1, s // world, 4).to(ctx.device)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf")).to(ctx.device)
    mine = cp.shard_chunks(s, world, ctx.rank, layout)
    scored = sum(cp.block_attention(q, q, q, mine, cp.shard_chunks(s, world, src, layout), out, lse, 1.0)
                 for src in range(world))  # the K/V blocks the ring would bring, one from every rank
    counts = [None] * world
    dist.all_gather_object(counts, scored)
    report.expect_equal(f"{layout} work per rank vs causal_work", counts, cp.causal_work(s, world, layout))
    return counts


# --8<-- [start:memory]
LIBC = ctypes.CDLL("libc.so.6") if Path("/proc/self/status").exists() else None
if LIBC is not None:
    LIBC.mallopt(-3, 1 << 17)  # M_MMAP_THRESHOLD fixed at 128 KiB: large tensors are mmapped, freed at once


def _status_kib(field_name: str) -> int:
    return int(re.search(rf"{field_name}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def peak_bytes(fn, device: torch.device) -> int:
    """Memory high-water mark while fn() runs, above what was in use before it: the CUDA allocator's peak on a
    GPU, the process's resident-memory peak (Linux VmHWM) on CPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    LIBC.malloc_trim(0)  # hand freed heap back, so "before" counts only live memory
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) * 1024


def layer_pass(args: Settings, method: str, seq: int, group, device) -> None:
    """Forward + backward of one attention layer on this rank's shard of a float32 sequence of `seq` tokens."""
    world = dist.get_world_size(group)
    q, k, v = (torch.randn(1, args.heads, seq // world, args.head_dim, device=device, requires_grad=True)
               for _ in range(3))
    out = attend(method, "zigzag" if method == "ring" else "contiguous", q, k, v, group, args.q_tile)
    out.backward(torch.ones_like(out))
# --8<-- [end:memory]


def memory_vs_length(ctx: RankContext, args: Settings, alone) -> list[dict]:
    rows, world = [], ctx.world_size
    names = ["ring"] + (["ulysses"] if args.heads % world == 0 else [])
    for seq in sorted(args.lengths):
        seq = cp.padded_length(seq, world)
        row = {"tokens": seq}
        for method in names:
            one = 0
            if ctx.rank == 0:
                one = peak_bytes(lambda: layer_pass(args, method, seq, alone, ctx.device), ctx.device)  # noqa: B023
            dist.barrier()
            mine = peak_bytes(lambda: layer_pass(args, method, seq, dist.group.WORLD, ctx.device),  # noqa: B023
                              ctx.device)
            peaks = [None] * world
            dist.all_gather_object(peaks, mine)
            row.update({f"{method}_one_MB": one / 2**20, f"{method}_rank_max_MB": max(peaks) / 2**20,
                        f"{method}_ratio": max(peaks) / one if one else float("nan")})
        rows.append(row)
    return rows


def torch_oracle(ctx: RankContext, args: Settings) -> dict:
    """torch's context_parallel on the same kind of input; returns whether it ran and how far it is from ours."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    world, s = ctx.world_size, cp.padded_length(64, ctx.world_size)
    gen = torch.Generator().manual_seed(args.seed)
    q, k, v = (torch.randn(1, args.heads, s, args.head_dim, generator=gen).to(ctx.device) for _ in range(3))
    mesh = init_device_mesh(ctx.device.type, (world,))
    bufs = [t.clone() for t in (q, k, v)]
    try:
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2]):
            theirs = F.scaled_dot_product_attention(*bufs, is_causal=True)
        theirs = context_parallel_unshard(mesh, [theirs], [2])[0]
    except (NotImplementedError, RuntimeError) as err:
        reason = f"{type(err).__name__}: {str(err).splitlines()[0]}"
        return {"ran": False, "reason": reason, "status": f"not run on this backend ({reason})"}
    local = [cp.shard(t, world, ctx.rank, "zigzag") for t in (q, k, v)]
    ours = gather(cp.ring_attention(*local, group=dist.group.WORLD), world, "zigzag")
    report.expect_close("ring attention vs torch context_parallel", ours, theirs, rtol=1e-4, atol=1e-5)
    diff = float((ours - theirs).abs().max())
    return {"ran": True, "max_abs_diff": diff, "status": f"ran, max |ours - torch| = {diff:.1e}"}


def ulysses_layout(ctx: RankContext, args: Settings) -> dict:
    """Which (head, token) cells each rank holds before and after Ulysses' tokens -> heads all-to-all, read from
    the real seq_to_heads on a tensor whose entry at (head h, token s) is the number h * S + s."""
    world, s = ctx.world_size, 2 * ctx.world_size  # two tokens per rank: small enough to read every cell
    full = (torch.arange(args.heads)[:, None] * s + torch.arange(s)[None, :]).double().view(1, args.heads, s, 1)
    before = cp.shard(full, world, ctx.rank, "contiguous")  # (1, H, S/W, 1): all heads, this rank's tokens
    after = cp.seq_to_heads(before.to(ctx.device), dist.group.WORLD, "forward").cpu()  # (1, H/W, S, 1)
    cells = {k: [divmod(int(n), s) for n in t.flatten().tolist()] for k, t in (("before", before), ("after", after))}
    every = [None] * world
    dist.all_gather_object(every, cells)
    owner = {k: [[-1] * s for _ in range(args.heads)] for k in ("before", "after")}
    for rank, held in enumerate(every):
        for k, pairs in held.items():
            for h, t in pairs:
                owner[k][h][t] = rank
    return {"heads": args.heads, "tokens": s, **owner}


def draw_ring(args: Settings, steps: list[list[dict]], seq: int) -> list[dict]:
    """One frame per ring step: left, the ranks on a circle with the K/V chunks each holds (and sends on);
    right, the causal grid of (query chunk, key chunk) pairs, those scored at this step in the colour of the rank
    that scored them, earlier steps faded. Returns what it drew: (step, rank, K/V chunks held, pairs scored)."""
    plt = plot.pyplot()
    from matplotlib.patches import Circle, FancyArrowPatch, Polygon, Rectangle

    world, n_steps = len(steps), len(steps[0])
    c = seq // (2 * world)  # one grid cell = one zigzag chunk
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = [{"step": i, "rank": r, "kv": [a // c for a, _ in steps[r][i]["kv"]],
              "pairs": [[qc[0] // c, kc[0] // c, masked] for qc, kc, masked in steps[r][i]["pairs"]]}
             for i in range(n_steps) for r in range(world)]
    # the tight layout engine from the start: plot.animate keeps it, and no frame has to switch engines
    fig, (ax, grid) = plt.subplots(1, 2, figsize=(9, 4.3), gridspec_kw={"width_ratios": [1.1, 1]}, layout="tight")
    at = [(math.sin(2 * math.pi * r / world), math.cos(2 * math.pi * r / world)) for r in range(world)]

    def frame(i: int) -> None:
        ax.clear()
        grid.clear()
        now = [d for d in drawn if d["step"] == i]
        for d in now:
            r = d["rank"]
            x, y = at[r]
            ax.add_patch(Circle((x, y), 0.42, fc=colors[r % len(colors)], alpha=0.35, ec="black"))
            mine = [a // c for a, _ in steps[r][i]["q"]]
            ax.text(x, y, f"rank {r}\nQ chunks {mine}\nholds K/V {d['kv']}", ha="center", va="center", fontsize=9)
            if i < n_steps - 1:  # the block moves on to the next rank while this one is scored
                nx, ny = at[(r + 1) % world]
                ax.add_patch(FancyArrowPatch((x * 0.72 + nx * 0.28, y * 0.72 + ny * 0.28),
                                             (x * 0.28 + nx * 0.72, y * 0.28 + ny * 0.72),
                                             connectionstyle="arc3,rad=-0.25", arrowstyle="-|>",
                                             mutation_scale=14, color="#444444"))
        ax.set(xlim=(-1.55, 1.55), ylim=(-1.55, 1.55), aspect="equal",
               title=f"step {i + 1} of {n_steps}: " + ("score, and pass K/V on" if i < n_steps - 1 else "last block"))
        ax.axis("off")
        for d in drawn:
            if d["step"] > i:
                continue
            for qi, ki, masked in d["pairs"]:
                col, alpha = colors[d["rank"] % len(colors)], (0.9 if d["step"] == i else 0.25)
                cell = (Polygon([(ki, qi), (ki, qi + 1), (ki + 1, qi + 1)], closed=True) if masked
                        else Rectangle((ki, qi), 1, 1))  # diagonal chunks: only keys at or before the query
                cell.set(fc=col, alpha=alpha, ec="black", lw=0.5)
                grid.add_patch(cell)
        n = 2 * world
        grid.set(xlim=(0, n), ylim=(n, 0), aspect="equal", xticks=[k + 0.5 for k in range(n)],
                 yticks=[k + 0.5 for k in range(n)], xticklabels=range(n), yticklabels=range(n),
                 xlabel="key chunk", ylabel="query chunk", title="pairs scored so far (causal)")

    plot.animate(fig, frame, n_steps, args, "ring", fps=0.7, strip_columns=2)
    return drawn


def draw_ulysses(args: Settings, layout: dict) -> str:
    plt = plot.pyplot()
    from matplotlib.colors import ListedColormap

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    world = max(max(row) for row in layout["before"]) + 1
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    cmap = ListedColormap(colors[:world])
    titles = ("before: every head, this rank's tokens", "after all-to-all: this rank's heads, every token")
    for ax, key, title in zip(axes, ("before", "after"), titles):
        ax.imshow(layout[key], cmap=cmap, vmin=-0.5, vmax=world - 0.5, aspect="auto")
        for h, row in enumerate(layout[key]):
            for t, r in enumerate(row):
                ax.text(t, h, f"r{r}", ha="center", va="center", fontsize=9, color="white")
        ax.grid(False)
        ax.set(title=title, xlabel="token", ylabel="head", xticks=range(layout["tokens"]),
               yticks=range(layout["heads"]))
    fig.suptitle(f"Ulysses on {world} ranks: which rank holds each (head, token) of q (k and v move the same way)",
                 fontsize=10)
    fig.tight_layout()
    return str(plot.save(fig, args, "ulysses"))


def draw(args: Settings, rows: list[dict], work: dict, world: int) -> None:
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    tokens = [r["tokens"] for r in rows]
    ax.plot(tokens, [r["ring_one_MB"] for r in rows], "o-", color="C0",
            label="ring's baseline: one process, ring kernel")
    ax.plot(tokens, [r["ring_one_MB"] / world for r in rows], ":", color="C0",
            label=f"ring's baseline / {world}: a perfect split")
    ax.plot(tokens, [r["ring_rank_max_MB"] for r in rows], "s-", color="C1",
            label=f"ring attention, largest of {world} ranks")
    if "ulysses_rank_max_MB" in rows[0]:
        ax.plot(tokens, [r["ulysses_one_MB"] for r in rows], "o--", color="C2",
                label="Ulysses' baseline: one process, SDPA")
        ax.plot(tokens, [r["ulysses_rank_max_MB"] for r in rows], "^-", color="C3",
                label=f"Ulysses, largest of {world} ranks")
    ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)",
           ylabel="peak memory of one attention layer (MB)", title="forward + backward, float32")
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.xaxis.set_minor_locator(plt.NullLocator())  # log axes add minor labels that collide with ours
    ax.legend(fontsize=8)
    print(f"figure: {plot.save(fig, args, 'memory')}")
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    width = 0.4
    for i, layout in enumerate(("contiguous", "zigzag")):
        ax.bar([r + (i - 0.5) * width for r in range(world)], work[layout], width, label=layout)
    ax.set(xlabel="rank", ylabel="query-key pairs scored",
           title=f"causal work per rank, {args.seq} tokens (padded to {-(-args.seq // world) * world} contiguous, "
                 f"{cp.padded_length(args.seq, world)} zigzag)")
    ax.set_xticks(range(world))
    ax.legend()
    print(f"figure: {plot.save(fig, args, 'balance')}")


def worker(ctx: RankContext, args: Settings) -> dict:
    world = ctx.world_size
    alone = dist.new_group([0])  # every rank must take part in creating it; only rank 0 uses it
    # each part is printed as soon as it is done, so a slow machine shows progress (part 4 takes longest)
    ctx.print(f"{world} ranks, H={args.heads} heads of D={args.head_dim}; causal attention over one sequence")
    if args.heads % world:
        ctx.print(f"Ulysses skipped: it gives each rank H/W heads, and W={world} does not divide H={args.heads}")
    merge_ex = merge_example()
    ctx.print("0. the online-softmax merge on one query, two K/V blocks of 3 keys (the ring kernel's block_attention "
              "and merge, float64):")
    ctx.print(report.table(merge_rows(merge_ex)))
    eq = [equality(ctx, args, m, layout) for m, layout in methods(args, world)]
    ring_steps = {e["layout"]: e.pop("ring_steps") for e in eq if e["method"] == "ring"}  # for the picture
    ctx.print(f"1-2. {args.seq} tokens, float64: gathered shards vs one process; bytes this rank sent vs formula")
    ctx.print(report.table(eq, floatfmt=".1e"))
    block = layer_comm_volume(1, cp.padded_length(args.seq, world), args.heads * args.head_dim, world,
                              sequence_parallel=True, dtype_bytes=8)
    tokens = cp.padded_length(args.seq, world)
    ctx.print(f"   (for scale: one TP+SP block of chapter 6 at t={world}, on THIS shape (1 x {tokens} tokens x "
              f"{args.heads * args.head_dim} features, float64), sends {int(block['forward_sent_per_rank']):,} B "
              "forward per rank; sequence_parallel.py's table uses another shape)")
    work = {layout: work_per_rank(ctx, args, layout) for layout in ("contiguous", "zigzag")}
    work_rows = [{"rank": r, "contiguous": work["contiguous"][r], "zigzag": work["zigzag"][r]} for r in range(world)]
    ctx.print("3. causal work per rank (query-key pairs scored, counted in the kernel; equal to cp.causal_work's "
              "count, the sum over the rank's queries at positions i of i + 1):")
    ctx.print(report.table(work_rows))
    share = max(work["contiguous"]) / min(work["contiguous"])
    ctx.print(f"   contiguous: the busiest rank does {share:.2f}x the least busy one's work; zigzag: "
              f"{max(work['zigzag']) / min(work['zigzag']):.2f}x")
    mem = memory_vs_length(ctx, args, alone) if ctx.device.type == "cuda" or cp_memory_available() else []
    if mem:
        ctx.print("4. peak memory of one attention layer, forward + backward, float32 (MB; ratio = largest rank / "
                  "one process running the same method's kernel):")
        ctx.print(report.table(mem, floatfmt=".3g"))
    else:
        ctx.print("4. memory not measured: on CPU it reads /proc/self (Linux only)")
    oracle = torch_oracle(ctx, args)
    ctx.print(f"5. torch context_parallel: {oracle['status']}")
    uly = ulysses_layout(ctx, args) if args.heads % world == 0 else None
    if ctx.rank == 0 and mem:
        draw(args, mem, work, world)
    ring_drawn = None
    if ctx.rank == 0:
        padded = next(e["padded_to"] for e in eq if e["method"] == "ring" and e["layout"] == "zigzag")
        ring_drawn = draw_ring(args, ring_steps["zigzag"], padded)
        ctx.print(f"figure: {plot.figure_dir(args) / 'ring.gif'} (and ring_strip.png)")
        if uly:
            ctx.print(f"figure: {draw_ulysses(args, uly)}")
    return {"ring_drawn": ring_drawn, "ulysses_layout": uly, "merge": merge_ex,
            "equality": eq, "work": work, "work_imbalance_contiguous": share, "memory": mem, "torch_oracle": oracle,
            "sp_block_forward_sent_B": int(block["forward_sent_per_rank"]), "ulysses": args.heads % world == 0}


def cp_memory_available() -> bool:
    return LIBC is not None and Path("/proc/self/clear_refs").exists()


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "seq": 61, "heads": 4, "head_dim": 8,
                                               "lengths": [256, 512], "q_tile": 32},
                     world_sizes=range(1, 9), world_sizes_text="1..8")
    result = launch(worker, args)
    if result is None:
        return 0
    print("OK: ring attention" + (" and Ulysses equal" if result["ulysses"] else " equals")
          + " one-process attention, forward and backward; bytes and work match their formulas")
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
