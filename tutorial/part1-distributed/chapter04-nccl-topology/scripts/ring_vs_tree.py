"""Ring vs tree vs recursive halving-doubling all-reduce, by hand, against gloo's own, with an alpha-beta model.

What it shows
    Three all-reduce algorithms written from isend/irecv, each checked equal to dist.all_reduce (float32 tolerance,
    an odd length that no world size divides) before it is timed:
      ring      mlsys.collectives.ring_all_reduce: reduce-scatter + all-gather around a ring, 2(p-1) steps,
                each rank sends 2(p-1)/p * n bytes (bandwidth-optimal, latency grows with p);
      tree      reduce up a binary (heap-order) tree to rank 0, then broadcast down: 2 floor(log2 p) steps, but
                a parent takes the whole n from each of its two children (and sends n to each on the way down),
                so up to 2n per level cross its link (few steps, many bytes);
      halving-doubling  Rabenseifner: reduce-scatter by recursive halving, all-gather by recursive doubling,
                2 log2(p) steps AND 2(p-1)/p * n bytes; power-of-two p only (skipped otherwise, with a message).
    They run side by side with gloo's dist.all_reduce in the same job over a sweep of sizes (busbw per algorithm,
    nccl-tests' factor 2(p-1)/p). Then: the box's ceiling (memcpy bandwidth of a large torch copy, loopback TCP
    bandwidth through a socket), busbw as a fraction of it, an alpha-beta model time = steps*alpha + bytes*beta
    fitted to the ring's and tree's points together by least squares, the model's ring-vs-tree crossover size, the
    sizes at which the ring and the tree were each faster in this run, and a figure of the model against the
    measurements. A second figure (steps.png) draws every message of the tree and of halving-doubling, step by step,
    from the schedules the two all-reduces follow (tree_schedule, halving_doubling_schedule; kept in the JSON as
    "steps").
    On one box, the ring's per-link advantage cannot show: summed over all ranks, the ring and the tree copy the
    same 2(p-1) n bytes, and here every "link" shares the same CPUs and memory. The last line: ring busbw over
    gloo busbw at the largest size.

How to run (any world size >= 2: one rank has nothing to reduce; halving-doubling needs a power of two)
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py -w 8 --max-bytes 2097152
    torchrun --nproc-per-node 4 tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py

Contract flags: --smoke uses 2 ranks and sizes up to 64 KiB; --seed sets the random data of the correctness check.

Runtime on 2 cores: about 15-30 s, depending on the load (4 ranks, 256 B .. 8 MiB); --smoke about 5 s.

Try next
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py -w 2
        -> two ranks: ring and tree take the same two steps, so the model has no crossover
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py -w 8 --max-bytes 2097152
        -> eight ranks on two cores: more steps, more scheduler noise at small sizes
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/ring_vs_tree.py -w 3
        -> halving-doubling is skipped with a message: it needs a power of two
"""

from __future__ import annotations

import math
import socket
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.bench import busbw, load_average, time_collective
from mlsys.collectives import ring_all_reduce
from mlsys.launch import RankContext, launch

ELEMENT_BYTES = 4  # float32


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 4
    """Number of ranks to start. Under torchrun it is taken from WORLD_SIZE."""
    min_bytes: int = 256
    """Smallest message size in bytes."""
    max_bytes: int = 8 * 2**20
    """Largest message size in bytes (always measured, even off the x4 grid)."""
    max_iters: int = 10
    """Timed calls per algorithm at small sizes; large sizes get fewer (at least 2)."""
    rounds: int = 3
    """The algorithms take turns this many times at each size; the median round counts (the CPU is shared)."""
    check_numel: int = 1001
    """Length of the random tensor each algorithm must all-reduce exactly like dist.all_reduce."""

    def validate(self) -> None:
        if self.min_bytes < ELEMENT_BYTES or self.max_bytes < self.min_bytes:
            raise cli.UsageError(f"need {ELEMENT_BYTES} <= --min-bytes <= --max-bytes")
        if self.max_iters < 1 or self.rounds < 1 or self.check_numel < 1:
            raise cli.UsageError("need --max-iters, --rounds and --check-numel >= 1")


def sendrecv(send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int) -> None:
    """Post a send and a receive together and wait for both (either may be absent or empty).

    Plain isend/irecv rather than batch_isend_irecv: with gloo on this CPU the batched call was the slower of the
    two for small messages (it adds bookkeeping around the same two operations)."""
    works = [dist.isend(send, dst)] if send is not None and send.numel() else []
    works += [dist.irecv(recv, src)] if recv is not None and recv.numel() else []
    for work in works:
        work.wait()


# --8<-- [start:tree]
def tree_parent(rank: int) -> int | None:
    """Binary tree in heap order: rank r's parent is (r-1)//2; rank 0 is the root.

                0
              /   \\
             1     2
            / \\   / \\
           3   4 5   6      floor(log2 p) levels below the root: p=4 -> 2, p=5 -> 2, p=8 -> 3
    """
    return None if rank == 0 else (rank - 1) // 2


def tree_children(rank: int, world_size: int) -> list[int]:
    return [c for c in (2 * rank + 1, 2 * rank + 2) if c < world_size]


def tree_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """In-place SUM: every child's partial sum flows up to rank 0, then the total flows back down."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    parent, children = tree_parent(rank), tree_children(rank, world_size)
    incoming = [torch.empty_like(tensor) for _ in children]  # [n] per child
    for work in [dist.irecv(buf, c) for buf, c in zip(incoming, children)]:  # both children at once
        work.wait()
    for buf in incoming:
        tensor.add_(buf)  # now: the sum over my subtree
    if parent is not None:
        dist.send(tensor, parent)
        dist.recv(tensor, parent)  # the root's total, coming back down
    for work in [dist.isend(tensor, c) for c in children]:
        work.wait()
    return tensor
# --8<-- [end:tree]


# --8<-- [start:halving]
def halving_doubling_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Rabenseifner's all-reduce for a power-of-two world size, in place (SUM).

    Reduce-scatter by recursive halving: at distance d = p/2, p/4, .., 1 exchange half of the current range with
    partner rank ^ d; the rank whose bit d is 0 keeps the lower half. After log2(p) steps each rank owns 1/p of the
    vector, fully summed. All-gather by recursive doubling replays the steps backwards, swapping owned ranges.
    Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005),
    https://doi.org/10.1177/1094342005051521
    """
    flat = tensor.view(-1)  # [n]
    plan = halving_doubling_plan(dist.get_rank(), dist.get_world_size(), flat.numel())
    for partner, keep, give in plan:  # reduce-scatter: the range I keep halves each step
        incoming = flat.new_empty(keep[1] - keep[0])
        sendrecv(flat[give[0]:give[1]], partner, incoming, partner)
        flat[keep[0]:keep[1]].add_(incoming)
    for partner, keep, give in reversed(plan):  # all-gather: send what I own, receive what the partner owns
        sendrecv(flat[keep[0]:keep[1]], partner, flat[give[0]:give[1]], partner)
    return tensor


def halving_doubling_plan(rank: int, world_size: int, numel: int) -> list[tuple[int, tuple, tuple]]:
    """Rank `rank`'s reduce-scatter steps: (partner, range kept, range given) at distance p/2, p/4, .., 1."""
    lo, hi, plan = 0, numel, []
    distance = world_size // 2
    while distance >= 1:
        partner, mid = rank ^ distance, lo + (hi - lo) // 2  # both partners hold the same [lo, hi): same mid
        keep, give = ((lo, mid), (mid, hi)) if rank & distance == 0 else ((mid, hi), (lo, mid))
        plan.append((partner, keep, give))
        (lo, hi), distance = keep, distance // 2
    return plan
# --8<-- [end:halving]


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def gloo_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)  # the library's own algorithm (gloo picks it), in place
    return tensor


def algorithms(world_size: int) -> dict:
    algos = {"ring": ring_all_reduce, "tree": tree_all_reduce}
    if is_power_of_two(world_size):
        algos["halving-doubling"] = halving_doubling_all_reduce
    algos["gloo all_reduce"] = gloo_all_reduce
    return algos


# --8<-- [start:schedules]
def tree_schedule(world_size: int, numel: int) -> list[dict]:
    """Every message tree_all_reduce sends, from the same tree_parent/tree_children: a rank sends its subtree's sum
    up once all its children's sums have arrived (a leaf at step 0); the root's total then goes down one level a
    step. One dict per message: step, phase, src, dst, the element range [lo, hi) and what the receiver does."""
    p = world_size

    def up_step(r: int) -> int:  # the step at which r's subtree sum is complete and leaves r
        return 1 + max((up_step(c) for c in tree_children(r, p)), default=-1)

    def depth(r: int) -> int:
        return 0 if r == 0 else 1 + depth(tree_parent(r))

    top = up_step(0)  # the step at which the root holds the total and starts sending it down
    up = [{"step": up_step(r), "phase": "reduce up", "src": r, "dst": tree_parent(r), "lo": 0, "hi": numel,
           "op": "add"} for r in range(1, p)]
    down = [{"step": top + depth(tree_parent(r)), "phase": "broadcast down", "src": tree_parent(r), "dst": r,
             "lo": 0, "hi": numel, "op": "copy"} for r in range(1, p)]
    return sorted(up + down, key=lambda m: (m["step"], m["src"]))


def halving_doubling_schedule(world_size: int, numel: int) -> list[dict]:
    """Every message halving_doubling_all_reduce sends, from the same halving_doubling_plan: step i of the
    reduce-scatter gives the half it does not keep (the receiver adds it); the all-gather replays the plan
    backwards, each rank sending the range it owns (the receiver copies it)."""
    out = []
    for rank in range(world_size):
        plan = halving_doubling_plan(rank, world_size, numel)
        for i, (partner, _, give) in enumerate(plan):
            out.append({"step": i, "phase": "reduce-scatter (halving)", "src": rank, "dst": partner,
                        "lo": give[0], "hi": give[1], "op": "add"})
        for j, (partner, keep, _) in enumerate(reversed(plan)):
            out.append({"step": len(plan) + j, "phase": "all-gather (doubling)", "src": rank, "dst": partner,
                        "lo": keep[0], "hi": keep[1], "op": "copy"})
    return sorted(out, key=lambda m: (m["step"], m["src"]))
# --8<-- [end:schedules]


# --8<-- [start:draw_steps]
def draw_steps(world_size: int, args: Settings) -> dict[str, list[dict]]:
    """One row per algorithm, one panel per step: who sends to whom and how much (as a fraction of the n-element
    buffer), from the schedules above. Returns the schedules it drew."""
    from fractions import Fraction

    from matplotlib.patches import FancyArrowPatch

    p, numel = world_size, 16 * world_size  # a size every step divides evenly, so the labels are exact fractions
    drawn = {"tree": tree_schedule(p, numel)}
    if is_power_of_two(p):
        drawn["halving-doubling"] = halving_doubling_schedule(p, numel)
    tree_pos = {}
    for r in range(p):  # heap layout: depth d on row -d, spread evenly within the row
        d = (r + 1).bit_length() - 1
        tree_pos[r] = ((r + 1 - 2**d + 0.5) / 2**d * (p - 1), -1.2 * d)
    line_pos = {r: (float(r), 0.0) for r in range(p)}
    plt = plot.pyplot()
    cols = max(m["step"] for sched in drawn.values() for m in sched) + 1
    size = 0.55 * p + 0.8  # inches per panel
    fig, axes = plt.subplots(len(drawn), cols, figsize=(size * cols, (size + 0.3) * len(drawn)), squeeze=False)
    for row, (name, sched) in enumerate(drawn.items()):
        pos = tree_pos if name == "tree" else line_pos
        sent = [sum(Fraction(m["hi"] - m["lo"], numel) for m in sched if m["src"] == r) for r in range(p)]
        for step in range(cols):
            ax = axes[row, step]
            ax.set_axis_off()
            ax.set_aspect("equal")
            ys = [y for _, y in pos.values()]
            ax.set_xlim(-0.6, p - 0.4)
            ax.set_ylim(min(ys) - 1.0, max(ys) + 1.0)
            for r, (x, y) in pos.items():
                ax.add_patch(plt.Circle((x, y), 0.25, color="C0", zorder=3))
                ax.text(x, y, str(r), ha="center", va="center", color="white", fontsize=9, zorder=4)
            mine = [m for m in sched if m["step"] == step]
            for m in mine:
                (x1, y1), (x2, y2) = pos[m["src"]], pos[m["dst"]]
                colour = "C3" if m["op"] == "add" else "C2"
                ax.add_patch(FancyArrowPatch((x1, y1), (x2, y2), arrowstyle="-|>", mutation_scale=10, lw=1.3,
                                             color=colour, shrinkA=7, shrinkB=7, connectionstyle="arc3,rad=0.35"))
                frac = Fraction(m["hi"] - m["lo"], numel)
                label = "n" if frac == 1 else f"n/{frac.denominator}" if frac.numerator == 1 else f"{frac}n"
                dx, dy = x2 - x1, y2 - y1
                ax.text((x1 + x2) / 2 + 0.3 * dy, (y1 + y2) / 2 - 0.3 * dx, label, fontsize=7, color=colour,
                        ha="center", va="center")
            ax.set_title(f"{name}, step {step}\n{mine[0]['phase'] if mine else '(done)'}", fontsize=8)
        axes[row, 0].text(0, -0.02, "bytes sent, per rank: " + ", ".join(
            f"{r}: {v}n".replace(": 1n", ": n") for r, v in enumerate(sent)), transform=axes[row, 0].transAxes,
            fontsize=7, ha="left", va="top", clip_on=False)
    fig.suptitle(f"all-reduce on {p} ranks, step by step\nred: the receiver adds it, green: the receiver copies it; "
                 "n = the buffer's size", fontsize=9)
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'steps')}")
    return drawn
# --8<-- [end:draw_steps]


# --8<-- [start:model]
def cost_terms(algorithm: str, world_size: int) -> tuple[float, float]:
    """(latency steps a, bytes factor b) of the model time = a * alpha + b * n * beta for an n-byte all-reduce.

    ring: 2(p-1) steps, 2(p-1)/p * n bytes per rank; halving-doubling: 2 log2(p) steps and the ring's bytes.
    tree (the heap-order tree built above): floor(log2 p) levels, each crossed once up and once down; at a level
    whose parent has k children, k * n bytes go through that parent's link (k messages of n in, or out), so the
    critical path carries 2 * sum over levels of k * n. (Alpha-beta model: Hockney, "The communication challenge
    for MPP", Parallel Computing 1994, https://doi.org/10.1016/0167-8191(94)90032-9.)
    """
    p = world_size
    levels = p.bit_length() - 1  # floor(log2 p): the depth of the deepest rank in heap order
    # the most children any parent at depth d has: 2, except where the last level is cut short
    fan = [max(len(tree_children(r, p)) for r in range(2**d - 1, min(2 ** (d + 1) - 1, p))) for d in range(levels)]
    return {"ring": (2 * (p - 1), 2 * (p - 1) / p), "tree": (2 * levels, 2 * sum(fan)),
            "halving-doubling": (2 * levels, 2 * (p - 1) / p)}[algorithm]


def fit_alpha_beta(steps: np.ndarray, bytes_moved: np.ndarray, time_s: np.ndarray) -> tuple[float, float]:
    """Least squares for (alpha s/step, beta s/byte) in time = steps*alpha + bytes_moved*beta, one row per measured
    point (points of different algorithms can be mixed: each row carries its own steps and bytes). Each row is
    divided by its time, so that 100 us and 100 ms measurements weigh the same (relative error). Both values are
    kept >= 0: when noise drives one negative, the other is refitted alone (a two-variable non-negative fit)."""
    design = np.stack([steps, bytes_moved], axis=1).astype(float) / time_s[:, None]  # [points, 2]
    target = np.ones_like(time_s, dtype=float)
    (alpha, beta), *_ = np.linalg.lstsq(design, target, rcond=None)
    if alpha >= 0 and beta >= 0:
        return float(alpha), float(beta)
    only_alpha = (np.linalg.lstsq(design[:, :1], target, rcond=None)[0][0], 0.0)
    only_beta = (0.0, np.linalg.lstsq(design[:, 1:], target, rcond=None)[0][0])
    residual = lambda ab: float(np.sum((design @ np.array(ab) - target) ** 2))
    alpha, beta = min(only_alpha, only_beta, key=residual)
    return float(alpha), float(beta)


def crossover_bytes(alpha: float, beta: float, world_size: int) -> float | None:
    """Size where the model's ring and tree times are equal (tree faster below it); None if there is none."""
    (a_ring, b_ring), (a_tree, b_tree) = cost_terms("ring", world_size), cost_terms("tree", world_size)
    if a_ring <= a_tree or b_tree <= b_ring or beta <= 0:
        return None  # the ring has no more steps than the tree (p = 2), or the fit found no per-byte cost
    return alpha * (a_ring - a_tree) / (beta * (b_tree - b_ring))
# --8<-- [end:model]


def rank_data(rank: int, numel: int, seed: int) -> torch.Tensor:
    """Rank `rank`'s random input of length `numel`: reproducible anywhere, so a test can sum it with numpy."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed * 7919 + 131 * rank + numel))


def all_reduce_every_way(numels: list[int], seed: int) -> dict[str, list[list[float]]]:
    """On every rank: each algorithm (and dist.all_reduce) applied to fresh copies of this rank's data.
    Plain lists, not tensors, so that the results can travel back through the launcher's pipe."""
    rank = dist.get_rank()
    return {name: [fn(rank_data(rank, n, seed)).tolist() for n in numels]
            for name, fn in algorithms(dist.get_world_size()).items()}


def check_against_gloo(ctx: RankContext, args: Settings) -> dict:
    """Every hand algorithm on random data of an odd length must match dist.all_reduce."""
    results = all_reduce_every_way([args.check_numel], args.seed)
    reference = torch.tensor(results["gloo all_reduce"][0])
    errors = {}
    for name, (values,) in results.items():
        got = torch.tensor(values)
        report.expect_close(f"rank {ctx.rank}: {name} vs dist.all_reduce", got, reference, rtol=1e-5, atol=1e-5)
        errors[name] = float((got - reference).abs().max())
    return errors


def sweep_sizes(args: Settings) -> list[int]:
    out, size = [], args.min_bytes
    while size < args.max_bytes:
        out.append(size)
        size *= 4
    return out + [args.max_bytes]


def worker(ctx: RankContext, args: Settings) -> dict:
    algos = algorithms(ctx.world_size)
    errors = check_against_gloo(ctx, args)
    rows = []
    for size in sweep_sizes(args):
        count = size // ELEMENT_BYTES
        buf = torch.zeros(count)  # zeros: repeated in-place sums stay finite
        iters = max(2, min(args.max_iters, (16 * 2**20) // size))
        rounds = {name: [] for name in algos}
        for _ in range(args.rounds):  # take turns, so a burst of load from elsewhere hits every algorithm
            for name, fn in algos.items():
                rounds[name].append(time_collective(lambda: fn(buf), warmup=1, iters=iters, device=ctx.device))  # noqa: B023
        for name, times in rounds.items():
            seconds = float(np.median(times))
            rows.append({"size (B)": count * ELEMENT_BYTES, "algorithm": name, "time (us)": seconds * 1e6,
                         "busbw (GB/s)": busbw("all_reduce", count * ELEMENT_BYTES, seconds, ctx.world_size)})
    return {"rows": rows, "max_abs_error": errors}


# --8<-- [start:ceiling]
def memcpy_bandwidth(num_bytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a large torch copy (best of a few): the memory system's ceiling for anything on this box."""
    src, dst = torch.ones(num_bytes // 4), torch.empty(num_bytes // 4)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def loopback_tcp_bandwidth(num_bytes: int = 64 * 2**20, repeats: int = 3) -> float:
    """Bytes/s through one TCP connection on 127.0.0.1 (what gloo's pairs use here), best of a few."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    payload, sink = bytearray(num_bytes), bytearray(num_bytes)

    def drain() -> None:
        view, got = memoryview(sink), 0
        while got < num_bytes:
            got += conn.recv_into(view[got:])

    best = math.inf
    try:
        for _ in range(repeats):
            reader = threading.Thread(target=drain)
            start = time.perf_counter()
            reader.start()
            client.sendall(payload)
            reader.join()
            best = min(best, time.perf_counter() - start)
    finally:
        for s in (client, conn, server):
            s.close()
    return num_bytes / best
# --8<-- [end:ceiling]


def summarise(rows: list[dict], world_size: int) -> dict:
    sizes = sorted({r["size (B)"] for r in rows})
    ring = {r["size (B)"]: r for r in rows if r["algorithm"] == "ring"}
    tree = {r["size (B)"]: r for r in rows if r["algorithm"] == "tree"}
    gloo = {r["size (B)"]: r for r in rows if r["algorithm"] == "gloo all_reduce"}
    # one fit over the ring's AND the tree's points: the same alpha and beta must explain both algorithms
    points = [(*cost_terms(name, world_size), s, table[s]["time (us)"] * 1e-6)
              for name, table in (("ring", ring), ("tree", tree)) for s in sizes]
    steps, factor, size, seconds = (np.array(col, dtype=float) for col in zip(*points))
    alpha, beta = fit_alpha_beta(steps, factor * size, seconds)
    measured_cross = next((s for i, s in enumerate(sizes)  # smallest size from which ring stays faster than tree
                           if all(ring[t]["time (us)"] < tree[t]["time (us)"] for t in sizes[i:])), None)
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "predicted_crossover_bytes": crossover_bytes(alpha, beta,
            world_size), "measured_crossover_bytes": measured_cross, "largest_size": sizes[-1],
            "faster_at_largest": "ring" if ring[sizes[-1]]["time (us)"] < tree[sizes[-1]]["time (us)"] else "tree",
            "tree_faster_at_every_size": all(tree[t]["time (us)"] <= ring[t]["time (us)"] for t in sizes),
            "ring_over_gloo_busbw": ring[sizes[-1]]["busbw (GB/s)"] / gloo[sizes[-1]]["busbw (GB/s)"]}


def draw(rows: list[dict], summary: dict, world_size: int, args: Settings) -> None:
    plt = plot.pyplot()
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.2))
    x = np.array(sorted({r["size (B)"] for r in rows}), dtype=float)
    for i, name in enumerate(dict.fromkeys(r["algorithm"] for r in rows)):
        mine = [r for r in rows if r["algorithm"] == name]
        ax_t.loglog(x, [r["time (us)"] for r in mine], "o", color=f"C{i}", label=f"{name} (measured)")
        ax_b.loglog(x, [r["busbw (GB/s)"] for r in mine], "o-", color=f"C{i}", label=name)
        if name in ("ring", "tree"):
            a, b = cost_terms(name, world_size)
            model = 1e6 * (a * summary["alpha_s"] + b * x * summary["beta_s_per_byte"])
            ax_t.loglog(x, model, "--", color=f"C{i}", label=f"{name} (alpha-beta model)")
    if summary["predicted_crossover_bytes"]:
        ax_t.axvline(summary["predicted_crossover_bytes"], color="gray", ls=":", label="predicted crossover")
    ax_t.set(xlabel="message size (bytes)", ylabel="time per all-reduce (us)")
    ax_b.set(xlabel="message size (bytes)", ylabel="busbw (GB/s)")
    ax_t.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)  # below: keeps the points clear
    ax_b.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.suptitle(f"all-reduce algorithms, {world_size} ranks, gloo on CPU (one model fitted to ring and tree)")
    print(f"figure: {plot.save(fig, args, 'ring_vs_tree')}")


def size_text(num_bytes: float) -> str:
    """256 B, 64.0 KiB, 8.0 MiB: the unit that keeps the number readable."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "max_bytes": 64 * 2**10, "max_iters": 3,
                                               "rounds": 1}, world_sizes=lambda w: w >= 2,
                     world_sizes_text=">= 2 (one rank has nothing to reduce)")
    if not is_power_of_two(args.world_size):
        print(f"note: halving-doubling needs a power-of-two world size; skipped for {args.world_size} ranks")
    result = launch(worker, args)
    if result is None:
        return 0
    rows, w = result["rows"], args.world_size
    print("correctness vs dist.all_reduce (max abs error over", args.check_numel, "elements):",
          ", ".join(f"{k} {v:.1e}" for k, v in result["max_abs_error"].items()))
    print(f"median of {args.rounds} round(s) per size, the algorithms taking turns; {load_average()}")
    print(report.table(rows, floatfmt=".3f"))
    summary = summarise(rows, w)
    ceiling = {"memcpy_GBps": memcpy_bandwidth() / 1e9, "loopback_tcp_GBps": loopback_tcp_bandwidth() / 1e9}
    best = max(r["busbw (GB/s)"] for r in rows if r["size (B)"] == summary["largest_size"])
    summary.update(ceiling, best_busbw_GBps=best, fraction_of_tcp=best / ceiling["loopback_tcp_GBps"],
                   fraction_of_memcpy=best / ceiling["memcpy_GBps"])
    cross = summary["predicted_crossover_bytes"]
    print(f"\nalpha-beta fit to the ring and tree points: alpha = {summary['alpha_s'] * 1e6:.1f} us per step, "
          f"beta = {summary['beta_s_per_byte'] * 1e9:.3f} ns per byte (1/beta = "
          f"{1 / summary['beta_s_per_byte'] / 1e9 if summary['beta_s_per_byte'] > 0 else math.inf:.2f} GB/s)")
    summary["fit_bandwidth_GBps"] = 1 / summary["beta_s_per_byte"] / 1e9 if summary["beta_s_per_byte"] > 0 else None
    summary["fit_bandwidth_text"] = (f"{summary['fit_bandwidth_GBps']:.2f} GB/s" if summary["fit_bandwidth_GBps"]
                                     else "unbounded: the fit found no per-byte cost")
    (a_ring, _), (a_tree, _) = cost_terms("ring", w), cost_terms("tree", w)
    tree_time = {r["size (B)"]: r["time (us)"] for r in rows if r["algorithm"] == "tree"}
    print("predicted ring-vs-tree crossover: " + (f"{size_text(cross)} (tree faster below, ring above)"
          if cross else f"none: with {w} ranks the ring takes {a_ring} steps, the tree {a_tree}, and the ring moves "
          "fewer bytes, so in the model (not necessarily in the measurement) the ring is never slower"
          if a_ring <= a_tree
          else "none: the fit found no per-byte cost (beta = 0), so the model has the ring slower at every size"))
    faster = {name: [size_text(r["size (B)"]) for r in rows if r["algorithm"] == "ring" and
                     (r["time (us)"] < tree_time[r["size (B)"]]) == (name == "ring")] for name in ("ring", "tree")}
    every = f"every size, {size_text(min(tree_time))} to {size_text(max(tree_time))}"
    summary["measured_text"] = (f"the tree was faster than the ring at {every}" if not faster["ring"] else
                                f"the ring was faster than the tree at {every}" if not faster["tree"] else
                                f"the ring was faster at {', '.join(faster['ring'])}; the tree at "
                                f"{', '.join(faster['tree'])}")
    summary["predicted_crossover_text"] = size_text(cross) if cross else "none"
    print("measured (median times above): " + summary["measured_text"])
    print(f"ceiling: memcpy {ceiling['memcpy_GBps']:.2f} GB/s, loopback TCP {ceiling['loopback_tcp_GBps']:.2f} GB/s;"
          f" best busbw at {size_text(summary['largest_size'])} = {best:.3f} GB/s = "
          f"{summary['fraction_of_tcp']:.1%} of TCP, {summary['fraction_of_memcpy']:.1%} of memcpy")
    if summary["fit_bandwidth_GBps"] and summary["fit_bandwidth_GBps"] > ceiling["memcpy_GBps"]:
        print(f"note: the fitted 1/beta ({summary['fit_bandwidth_GBps']:.2f} GB/s) is above the memcpy ceiling; "
              "nothing on this box moves bytes faster than a memory copy, so the fit's beta is noise here (too few "
              "sizes where the bytes dominate, or scheduling delays in the small ones)")
    print(f"ring busbw / gloo all_reduce busbw at {size_text(summary['largest_size'])} with {w} ranks: "
          f"{summary['ring_over_gloo_busbw']:.2f}")
    draw(rows, summary, w, args)
    steps = draw_steps(w, args)  # the tree's and halving-doubling's messages, step by step
    if args.json:
        report.write_json(args.json, {"world_size": w, "rows": rows, "max_abs_error": result["max_abs_error"],
                                      "steps_numel": 16 * w, "steps": steps, **summary}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
