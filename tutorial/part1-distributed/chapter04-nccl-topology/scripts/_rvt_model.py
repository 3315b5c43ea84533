"""ring_vs_tree.py's model side: the message schedules its figure draws, the alpha-beta model, and the sentences the
run prints from its measured times (which algorithm was faster where, how far the model is off). No process group
here: everything takes the measured rows, so the tests can feed it synthetic timings."""

from __future__ import annotations

import math
import os

import numpy as np

from mlsys import report
from mlsys.collectives import halving_doubling_plan, tree_children, tree_parent

FITTED = ("ring", "tree")  # the algorithms whose points the alpha-beta fit sees
MODELLED = ("ring", "tree", "halving-doubling")  # the algorithms the model gives a time for


def ring_schedule(world_size: int, numel: int) -> list[dict]:
    """Every message ring_all_reduce sends (mlsys/collectives.py): the buffer cut like torch.tensor_split into p
    chunks; at step s of the reduce-scatter rank r sends chunk (r-s) to r+1 (the receiver adds it), at step s of the
    all-gather chunk (r+1-s) (the receiver copies it). Same dicts as tree_schedule below."""
    p, out = world_size, []
    edge = [k * (numel // p) + min(k, numel % p) for k in range(p + 1)]  # chunk k is [edge[k], edge[k+1])
    for s in range(2 * (p - 1)):
        reduce = s < p - 1
        for r in range(p):
            k = (r - s) % p if reduce else (r + 1 - (s - (p - 1))) % p
            out.append({"step": s, "phase": "reduce-scatter" if reduce else "all-gather", "src": r,
                        "dst": (r + 1) % p, "lo": edge[k], "hi": edge[k + 1], "op": "add" if reduce else "copy"})
    return out


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


def schedule_table(schedules: dict[str, list[dict]], world_size: int, numel: int) -> dict[str, dict]:
    """The step picture in numbers (the lesson's table), bytes as multiples of n: each algorithm's steps, the most
    any one rank sends (the footer's largest), and its critical path: each step costs its busiest rank's larger of
    bytes sent and bytes received (one full-duplex link per rank), summed over the steps."""
    out = {}
    for name, sched in schedules.items():
        steps = max(m["step"] for m in sched) + 1
        moved = np.zeros((steps, world_size, 2))  # [step, rank, sent/received] elements
        for m in sched:
            moved[m["step"], m["src"], 0] += m["hi"] - m["lo"]
            moved[m["step"], m["dst"], 1] += m["hi"] - m["lo"]
        out[name] = {"steps": steps, "most_sent": float(moved[:, :, 0].sum(axis=0).max()) / numel,
                     "critical_path": float(moved.max(axis=2).max(axis=1).sum()) / numel}
    return out


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
    return {"ring": (2 * (p - 1), 2 * (p - 1) / p), "tree": (2 * levels, 2 * sum(tree_level_fans(p))),
            "halving-doubling": (2 * levels, 2 * (p - 1) / p)}[algorithm]


def tree_level_fans(world_size: int) -> list[int]:
    """For each depth d of the heap-order tree that has parents, the most children any parent at depth d has: 2,
    except where the last level is cut short. [2, 1] for 4 ranks: the root has two children, rank 1 one."""
    p = world_size
    return [max(len(tree_children(r, p)) for r in range(2**d - 1, min(2 ** (d + 1) - 1, p)))
            for d in range(p.bit_length() - 1)]


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


def split_sizes(sizes: list[int]) -> tuple[list[int], list[int]]:
    """(sizes the model is fitted on, sizes held out to test it): every other size of the sweep counting from the
    smallest, plus the largest, so that every held-out size lies between two fitted ones. With an even number of
    sizes the two largest are both fitted (e.g. 1 MiB and 2 MiB of -w 8 --max-bytes 2097152)."""
    fit = sizes[::2] + ([sizes[-1]] if len(sizes) % 2 == 0 else [])
    return fit, [s for s in sizes if s not in fit]


def fit_on(rows: list[dict], world_size: int, fit_sizes: list[int]) -> tuple[float, float]:
    """One (alpha, beta) for the ring and the tree together, from their measured times at `fit_sizes` only: the
    same two numbers must explain both algorithms, each with its own steps and bytes."""
    points = [(*cost_terms(r["algorithm"], world_size), r["size (B)"], r["time (us)"] * 1e-6) for r in rows
              if r["algorithm"] in FITTED and r["size (B)"] in fit_sizes]
    steps, factor, size, seconds = (np.array(col, dtype=float) for col in zip(*points))
    return fit_alpha_beta(steps, factor * size, seconds)


def model_vs_measured(rows: list[dict], world_size: int, fit_sizes: list[int], alpha: float,
                      beta: float) -> list[dict]:
    """Every measured point of a modelled algorithm beside the model's time for it. Role "fit": a ring or tree
    point the fit saw; "held out": every other point (halving-doubling's were never fitted at all)."""
    out = []
    for r in rows:
        if r["algorithm"] not in MODELLED:
            continue
        a, b = cost_terms(r["algorithm"], world_size)
        model_us = 1e6 * (a * alpha + b * r["size (B)"] * beta)
        fitted = r["algorithm"] in FITTED and r["size (B)"] in fit_sizes
        out.append({"algorithm": r["algorithm"], "size (B)": r["size (B)"], "role": "fit" if fitted else "held out",
                    "measured (us)": r["time (us)"], "model (us)": model_us,
                    "measured/model": r["time (us)"] / model_us if model_us > 0 else math.inf})
    return out


def crossover_bytes(alpha: float, beta: float, world_size: int) -> float | None:
    """Size where the model's ring and tree times are equal (tree faster below it); None if there is none."""
    (a_ring, b_ring), (a_tree, b_tree) = cost_terms("ring", world_size), cost_terms("tree", world_size)
    if a_ring <= a_tree or b_tree <= b_ring or beta <= 0 or alpha <= 0:
        return None  # the ring has no more steps than the tree (p = 2), or the fit pinned alpha or beta at 0
    return alpha * (a_ring - a_tree) / (beta * (b_tree - b_ring))


MORE_RANKS = (8, 64, 512)  # rank counts whose real links one box cannot show; the model's crossover, off the fit


def crossover_at_more_ranks(alpha: float, beta: float, ranks: tuple[int, ...] = MORE_RANKS) -> dict[int, float]:
    """The model's n* at larger rank counts, with this run's fitted alpha and beta: a prediction of the model (the
    same formula, each p with its own steps and bytes), not a measurement. Empty when the fit pinned alpha or beta
    at 0 (no crossover at any p)."""
    return {p: crossover_bytes(alpha, beta, p) for p in ranks} if alpha > 0 and beta > 0 else {}


def more_ranks_text(crossovers: dict[int, float]) -> str:
    if not crossovers:
        return "none: the fit pinned alpha or beta at 0, so the model has no crossover at any number of ranks"
    return ", ".join(f"{p} ranks: {size_text(n)}" for p, n in crossovers.items())


def more_ranks_line(summary: dict, world_size: int, cores: int | None) -> str | None:
    """The printed line for the model's n* at the rank counts of MORE_RANKS above this run's: a prediction. This
    box can start that many ranks (a -w 8 run works), but they share its cores and its memory, so no run here
    times that many real links. None when the run already has at least the largest of them."""
    if world_size >= max(MORE_RANKS):
        return None
    why = (f" (a prediction, not a measurement: this box can start that many ranks, but they share its "
           f"{cores or 'few'} cores and one memory, so its timings cannot show that many real links)"
           if summary["more_ranks_crossover_bytes"] else "")
    return (f"the model's crossover at more ranks, with this fit's alpha and beta: "
            f"{summary['more_ranks_crossover_text']}{why}")
# --8<-- [end:model]


def tied(a: dict, b: dict) -> bool:
    """Whether two algorithms' times at one size are a tie within the measurement's own spread: the ranges of
    their rounds (fastest to slowest round) overlap. A row without its rounds counts as one round at its time."""
    lo_a, hi_a = min(a.get("rounds (us)") or [a["time (us)"]]), max(a.get("rounds (us)") or [a["time (us)"]])
    lo_b, hi_b = min(b.get("rounds (us)") or [b["time (us)"]]), max(b.get("rounds (us)") or [b["time (us)"]])
    return max(lo_a, lo_b) <= min(hi_a, hi_b)


def summarise(rows: list[dict], world_size: int) -> dict:
    """The measured comparison (which of ring and tree was faster where, ring against gloo), then the alpha-beta
    model fitted on every other size and tested on the sizes it did not see. A size where the ring's and the
    tree's round-to-round ranges overlap is a tie: neither is named faster there, and a crossover is only claimed
    between sizes where the winner is clear."""
    sizes = sorted({r["size (B)"] for r in rows})
    row_of = {(r["algorithm"], r["size (B)"]): r for r in rows}
    time_of = {key: r["time (us)"] for key, r in row_of.items()}
    busbw_of = {key: r["busbw (GB/s)"] for key, r in row_of.items()}
    ties = [s for s in sizes if tied(row_of["ring", s], row_of["tree", s])]
    ring_faster = [s for s in sizes if s not in ties and time_of["ring", s] < time_of["tree", s]]
    tree_faster = [s for s in sizes if s not in ties and s not in ring_faster]
    clear = [s for s in sizes if s not in ties]  # the sizes with a clear winner, in order
    every = f"every size, {size_text(sizes[0])} to {size_text(sizes[-1])}"
    tie_note = (f". The ring and the tree were a tie within the rounds' spread at {', '.join(map(size_text, ties))}"
                if ties else "")  # a sentence of its own, after the verdict
    measured_text = (f"the ring and the tree were a tie within the rounds' spread at {every}" if not clear else
                     f"the tree was faster than the ring at {every}" if not ring_faster and not ties else
                     f"the ring was faster than the tree at {every}" if not tree_faster and not ties else
                     "; ".join(part for part in (
                         f"the ring was faster at {', '.join(map(size_text, ring_faster))}" if ring_faster else "",
                         f"the tree was faster at {', '.join(map(size_text, tree_faster))}" if tree_faster else "",
                         f"a tie within the rounds' spread at {', '.join(map(size_text, ties))}" if ties else "")
                               if part))
    fit_sizes, held_sizes = split_sizes(sizes)
    alpha, beta = fit_on(rows, world_size, fit_sizes)
    points = model_vs_measured(rows, world_size, fit_sizes, alpha, beta)
    off = lambda p: max(p["measured/model"], 1 / p["measured/model"])  # how many times off, either way
    held, fitted = ([p for p in points if p["role"] == role] for role in ("held out", "fit"))
    cross = crossover_bytes(alpha, beta, world_size)
    # among the sizes with a clear winner: tree at every one below clear[split], ring at every one from it on
    split = next((i for i in range(1, len(clear)) if set(clear[:i]) == set(tree_faster) and set(clear[i:]) ==
                  set(ring_faster)), None)
    backwards = next((i for i in range(1, len(clear)) if set(clear[:i]) == set(ring_faster) and set(clear[i:]) ==
                      set(tree_faster)), None)  # one switch the other way: ring faster below clear[i], tree above
    # "even above n*" only where a clear tree win lies above the model's crossover; wins at or below it agree with it;
    # where every size above n* is a tie, the run does not test the crossover at all, and the sentence says so
    where = (f"the model's crossover n* ({size_text(cross)}) lies beyond the largest size"
             if cross and cross > sizes[-1] else
             f"even above the model's crossover n* ({size_text(cross)})"
             if cross and max(tree_faster, default=0) > cross else
             f"but the sizes above the model's crossover n* ({size_text(cross)}) were ties, so this run does not "
             "test the model's crossover"
             if cross and any(s > cross for s in sizes) and all(s in ties for s in sizes if s > cross) else
             f"none of those sizes above the model's crossover n* ({size_text(cross)})"
             if cross else "and the model has no crossover")
    wherever = "at every size" if not ties else "at every size where the winner was clear"
    crossover_measured_text = (
        "does not show a crossover: the ring and the tree were a tie within the rounds' spread at every size"
        if not clear else
        f"does not show a crossover: the tree was faster {wherever}, {where}{tie_note}" if not ring_faster else
        f"does not show a crossover: the ring was faster {wherever}{tie_note}" if not tree_faster else
        f"shows a crossover: the tree was faster up to {size_text(clear[split - 1])}, the ring from "
        f"{size_text(clear[split])} (the model's n*: {size_text(cross) if cross else 'none'}){tie_note}"
        if split else
        f"shows one switch, the opposite way to the model's: the ring was faster up to "
        f"{size_text(clear[backwards - 1])}, the tree from {size_text(clear[backwards])} (the model has the tree "
        f"faster below n* and the ring above){tie_note}" if backwards else
        "does not show a clean crossover: which of the two was faster flips back and forth between "
        f"neighbouring sizes{tie_note}")
    more = tuple(p for p in MORE_RANKS if p > world_size)  # a -w 8 run's own n* is not printed again as 8's
    step_sizes = latency_bound_sizes(alpha, beta, world_size, sizes)
    gloo_beaten = [s for s in sizes if time_of["tree", s] < time_of["gloo all_reduce", s]]
    names = list(dict.fromkeys(r["algorithm"] for r in rows))
    gap = lambda s: max(time_of[n, s] for n in names) / min(time_of[n, s] for n in names)
    widest = max(sizes, key=gap)  # the size where the fastest and the slowest algorithm are furthest apart
    fast, slow = (sorted(names, key=lambda n: time_of[n, widest])[i] for i in (0, -1))
    crossover_kind = ("all ties" if not clear else "tree everywhere" if not ring_faster else
                      "ring everywhere" if not tree_faster else "as the model" if split else
                      "opposite to the model" if backwards else "back and forth")
    return {"crossover_measured_text": crossover_measured_text, "crossover_kind": crossover_kind,
            "sizes_count": len(sizes),
            "tree_faster_than_gloo_count": len(gloo_beaten),
            "tree_faster_than_gloo_text": ", ".join(map(size_text, gloo_beaten)) or "no size",
            "largest_size": sizes[-1], "measured_text": measured_text,
            "widest_gap_text": f"at {size_text(widest)}, the {fast} took 1/{gap(widest):.1f} of the {slow}'s "
                               "median time",
            "tied_sizes": ties,
            "faster_at_largest": "ring" if sizes[-1] in ring_faster else "tree" if sizes[-1] in tree_faster else
            "tie",
            "tree_faster_at_every_size": not ring_faster and not ties,
            "ring_over_gloo_busbw": busbw_of["ring", sizes[-1]] / busbw_of["gloo all_reduce", sizes[-1]],
            "fit_sizes": fit_sizes, "held_out_sizes": held_sizes, "alpha_s": alpha, "beta_s_per_byte": beta,
            "fit_bandwidth_GBps": 1 / beta / 1e9 if beta > 0 else None, "model_points": points,
            "alpha_pinned_at_zero": alpha == 0 and beta > 0,
            "held_out_points": len(held), "held_out_worst_factor": max(map(off, held), default=None),
            "held_out_median_factor": float(np.median([off(p) for p in held])) if held else None,
            "held_out_off_by_2x": sum(off(p) > 2 for p in held),
            "fit_worst_factor": max(map(off, fitted)), "predicted_crossover_bytes": cross,
            **{f"{name}_median_ratio": float(np.median([p["measured/model"] for p in points if p["algorithm"] == name]))
               for name in dict.fromkeys(p["algorithm"] for p in points)},
            "predicted_crossover_text": size_text(cross) if cross else "none",
            "more_ranks_crossover_bytes": crossover_at_more_ranks(alpha, beta, more),
            "more_ranks_crossover_text": more_ranks_text(crossover_at_more_ranks(alpha, beta, more)) if more else
            "no larger rank count to predict",
            "ring_latency_bound_text": ring_latency_bound_text(alpha, beta, world_size, sizes),
            "step_cost_text": step_cost_text(time_of, world_size, step_sizes, alpha),
            "step_sizes": step_sizes, "step_us": step_us(time_of, world_size, step_sizes),
            "line_nearer_text": line_nearer_text(points, time_of, sizes)}


def ring_latency_bound_text(alpha: float, beta: float, world_size: int, sizes: list[int]) -> str:
    """At how many of the sweep's sizes the fitted model puts more of the ring's time on its steps (a * alpha) than
    on its bytes (b * n * beta): where the per-message cost dominates, the ring's fewer bytes cannot pay off."""
    if alpha <= 0:
        return "none of the sizes: this fit pinned alpha at 0 (its `note:` line), so it cannot show the fixed cost"
    a, b = cost_terms("ring", world_size)
    below = [s for s in sizes if a * alpha > b * s * beta]
    knee = f" (below its knee, {size_text(a * alpha / (b * beta))})" if beta > 0 else ""
    return f"{len(below)} of the {len(sizes)} sizes{knee}"


def steps_taken(world_size: int) -> dict[str, int]:
    """The steps of each timed algorithm: ours from the model, gloo's ring 2(p-1), as ours."""
    return {"ring": cost_terms("ring", world_size)[0], "tree": cost_terms("tree", world_size)[0],
            "gloo all_reduce": 2 * (world_size - 1)}


def latency_bound_sizes(alpha: float, beta: float, world_size: int, sizes: list[int]) -> list[int]:
    """The sizes where the fitted model puts both the ring and the tree below their knee (steps cost more than
    bytes): a time per step is read there, over several sizes, so that one noisy size cannot set it. When the fit
    pinned alpha at 0 no size is latency-bound in the model: then the smaller half of the sweep."""
    terms = [cost_terms(name, world_size) for name in FITTED]
    below = [s for s in sizes if alpha > 0 and all(a * alpha > b * s * beta for a, b in terms)]
    return below or sizes[:max(1, len(sizes) // 2)]


def step_us(time_of: dict, world_size: int, sizes: list[int]) -> dict[str, float]:
    """Each algorithm's median, over `sizes`, of its time per all-reduce divided by the steps it takes (us)."""
    return {name: float(np.median([time_of[name, s] / a for s in sizes]))
            for name, a in steps_taken(world_size).items()}


def step_cost_text(time_of: dict, world_size: int, sizes: list[int], alpha: float) -> str:
    """The median time per step of each algorithm over the latency-bound `sizes`, also in units of the fitted
    alpha (a model with one cost per step would give every algorithm the same), and the ring's step over the tree's."""
    steps, per = steps_taken(world_size), step_us(time_of, world_size, sizes)
    where = (f"at {size_text(sizes[0])}" if len(sizes) == 1 else
             f"median over the {len(sizes)} sizes {size_text(sizes[0])} to {size_text(sizes[-1])}")
    return (f"{where}, where the fit has ring and tree latency-bound: " + ", ".join(
        f"a step of {'gloo' if name.startswith('gloo') else 'our ' + name} took {per[name]:.0f} us "
        f"({a} steps" + (f", each step = {per[name] / (alpha * 1e6):.2f} x alpha)" if alpha > 0 else ")")
        for name, a in steps.items()) + f"; a step of our ring took {per['ring'] / per['tree']:.1f}x one of our tree")


def line_nearer_text(points: list[dict], time_of: dict, sizes: list[int]) -> str:
    """Which of the ring's and the tree's points the one fitted line passes nearer (the smaller median of
    |log(measured/model)|), and which of the two had the lower median time at more sizes: both read off the run,
    so the sentence never claims the line follows the faster one when it does not."""
    ratio = {name: [p["measured/model"] for p in points if p["algorithm"] == name] for name in FITTED}
    off = {name: float(np.median(np.abs(np.log(r)))) for name, r in ratio.items()}
    near, far = sorted(FITTED, key=lambda n: off[n])
    wins = {name: sum(time_of[name, s] < time_of[other, s] for s in sizes) for name, other in (FITTED, FITTED[::-1])}
    faster = ("the faster of the two" if wins[near] > wins[far] else "the slower of the two" if wins[near] < wins[far]
              else "neither the faster nor the slower of the two")
    return (f"the line passes nearer the {near}'s points (median {float(np.median(ratio[near])):.2f}x the line) "
            f"than the {far}'s ({float(np.median(ratio[far])):.2f}x); the {near}, {faster}, had the lower median "
            f"time at {wins[near]} of the {len(sizes)} sizes (medians only; section 2's ties compare ranges)")


def size_text(num_bytes: float) -> str:
    """256 B, 64.0 KiB, 8.0 MiB: the unit that keeps the number readable."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def fit_vs_ceilings(fit_GBps: float | None, ceiling: dict, best_busbw_GBps: float) -> str:
    """The fitted 1/beta held against the two measured ceilings and the best busbw the run reached."""
    if not fit_GBps:
        return "no per-byte cost was fitted, so there is no bandwidth to compare"
    side = lambda limit: "above" if fit_GBps > limit else "below"
    return (f"{fit_GBps:.2f} GB/s is {side(ceiling['loopback_tcp_GBps'])} the loopback TCP ceiling "
            f"({ceiling['loopback_tcp_GBps']:.2f} GB/s), {side(ceiling['memcpy_GBps'])} the memcpy one "
            f"({ceiling['memcpy_GBps']:.2f} GB/s), and {fit_GBps / best_busbw_GBps:.1f}x the best busbw any "
            f"algorithm reached at the largest size ({best_busbw_GBps:.3f} GB/s)")


def alpha_pinned_note(summary: dict) -> str | None:
    """The `note:` line for a fit that pinned alpha at 0 (the unconstrained least-squares alpha was negative, so
    fit_alpha_beta kept beta alone): the model then gives a small size little more than its few bytes' time, and
    measured/model there runs into the hundreds or thousands. None for a fit with a positive alpha."""
    if summary["alpha_s"] > 0 or not summary["beta_s_per_byte"]:
        return None
    return ("note: the fit pinned alpha at 0 us per step (the best least-squares alpha was negative): the small "
            "sizes' fixed cost could not be separated from the noise and the size term, so the model gives a small "
            "size only its bytes' time, and the measured/model factors at the small sizes are meaningless (only "
            "the large sizes test the model). This happens under load or with 2 ranks; rerun on a quieter machine")


def beta_pinned_note(summary: dict) -> str | None:
    """The `note:` line for a fit that pinned beta at 0 (fit_alpha_beta kept alpha alone): the model then charges
    the bytes nothing, so every size gets the same model time, and there is no 1/beta to hold against
    the ceilings. None for a fit with a positive beta."""
    if summary["beta_s_per_byte"] > 0 or not summary["alpha_s"]:
        return None
    return ("note: the fit pinned beta at 0 ns per byte (no per-byte cost): the model gives every size the same "
            "time, its steps times alpha, so the measured/model factors only show how the measured times vary with "
            "the size, and section 4 has no fitted bandwidth to compare. This happens under load or with 2 ranks; "
            "rerun on a quieter machine")


HELD_OUT_LIMIT = 5.0  # a held-out median off by more than this factor: the model misses the sizes it did not see
STEP_LIMIT = 4.0  # every measured step costs more than this many alphas: alpha explains little of any step


def fit_sanity_note(summary: dict) -> str | None:
    """The `note:` line for a fit that is clearly wrong though neither value was pinned at 0: its held-out points
    are off by more than HELD_OUT_LIMIT (median), or alpha is below 1/STEP_LIMIT of every measured time per step
    (a few fast points pulled the relative-error fit down). Built from the run's own values; None otherwise."""
    alpha, median = summary["alpha_s"], summary["held_out_median_factor"]
    if alpha <= 0 or not summary["beta_s_per_byte"]:  # pinned: the notes above say so
        return None
    cheapest = min(summary["step_us"].values())
    why = ([f"the held-out points are off by {median:.2f}x (median), more than {HELD_OUT_LIMIT:.0f}x"]
           if median and median > HELD_OUT_LIMIT else [])
    if cheapest > STEP_LIMIT * alpha * 1e6:
        why.append(f"alpha ({alpha * 1e6:.1f} us) is below 1/{STEP_LIMIT:.0f} of every measured time per step "
                   f"(the cheapest {cheapest:.0f} us)")
    return ("note: do not trust this fit: " + ", and ".join(why) + ". Its alpha, beta and n* describe these "
            "times poorly and can change several-fold on a rerun") if why else None


def ring_vs_gloo(ratio: float, largest: str) -> tuple[str, str]:
    """(the ratio as printed, its label): the label is read off the printed three digits, so "0.995" says
    below 1 and a ratio that prints as 1.000 says about 1, never a direction the printed number does not show."""
    shown = f"{ratio:.3f}"
    label = (f"above 1: our Python ring finished faster than gloo's own all-reduce at {largest}" if float(shown) > 1
             else f"below 1: gloo's own all-reduce finished faster than our Python ring at {largest}"
             if float(shown) < 1 else f"about 1: the two took the same time to three digits at {largest}")
    return shown, label


def print_model(summary: dict, w: int) -> str:
    """Section 3 of the output: the fit, measured/model at every size, and the model's crossover. Prints it and
    returns it (the run's JSON keeps it, so the lesson can show it beside the model's explanation)."""
    out = []
    fit, held = summary["fit_sizes"], summary["held_out_sizes"]
    out.append(f"\n3. alpha-beta model: one (alpha, beta) fitted to the ring's and the tree's times at "
               f"{', '.join(map(size_text, fit))}; held out: " + (", ".join(map(size_text, held)) or "no size")
               + (" and every halving-doubling point" if any(p["algorithm"] == "halving-doubling"
                                                               for p in summary["model_points"]) else ""))
    out.append(f"fit: alpha = {summary['alpha_s'] * 1e6:.1f} us per step, "
               f"beta = {summary['beta_s_per_byte'] * 1e9:.3f} ns per byte "
               + (f"(1/beta = {summary['fit_bandwidth_GBps']:.2f} GB/s)" if summary["fit_bandwidth_GBps"]
                  else "(no per-byte cost: the fit put all of every time into alpha)"))
    out.append(f"time per step, measured: {summary['step_cost_text']}")
    ratio = {(p["algorithm"], p["size (B)"]): p["measured/model"] for p in summary["model_points"]}
    names = list(dict.fromkeys(p["algorithm"] for p in summary["model_points"]))
    out.append(report.table([{"size (B)": s, "ring, tree points": "fit" if s in fit else "held out",
                              **{f"{n} measured/model": ratio[n, s] for n in names}} for s in sorted(fit + held)],
                            floatfmt=".2f"))
    if summary["held_out_points"]:
        out.append(f"held out: {summary['held_out_points']} points, measured/model off by a factor of "
                   f"{summary['held_out_median_factor']:.2f} (median) and "
                   f"{summary['held_out_worst_factor']:.2f} at worst; {summary['held_out_off_by_2x']} of them"
                   " more than 2x off (on the fitted points themselves: "
                   f"{summary['fit_worst_factor']:.2f} at worst)")
    for note in (alpha_pinned_note(summary), beta_pinned_note(summary), fit_sanity_note(summary)):
        if note:
            out.append(note)
    out.append("median measured/model over every size: " + ", ".join(f"{n} {summary[f'{n}_median_ratio']:.2f}"
                                                                       for n in names))
    (a_ring, _), (a_tree, _) = cost_terms("ring", w), cost_terms("tree", w)
    cross = summary["predicted_crossover_bytes"]
    out.append("the model's ring-vs-tree crossover: " + (
        f"{size_text(cross)} (tree faster below, ring above); measured: {summary['measured_text']}" if cross else
        f"none: with {w} ranks the ring takes {a_ring} steps, the tree {a_tree}, and the ring moves fewer bytes, so "
        "in the model (not necessarily in the measurement) the ring is never slower" if a_ring <= a_tree else
        "none: the fit pinned alpha at 0 (see the note above), so in the model the ring, with fewer bytes, is faster "
        "at every size" if summary["alpha_s"] <= 0 else
        "none: the fit found no per-byte cost (beta = 0), so the model has the ring slower at every size"))
    line = more_ranks_line(summary, w, os.cpu_count())
    if line:
        out.append(line)
    out.append(f"the one line against the two algorithms: {summary['line_nearer_text']}")
    print("\n".join(out))
    return "\n".join(out).strip("\n")
