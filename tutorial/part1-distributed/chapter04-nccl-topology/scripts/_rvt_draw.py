"""ring_vs_tree.py's figures: the ring's, the tree's and halving-doubling's messages step by step, what each rank
waits for in one ring step and one tree step, the measured times, the alpha-beta model against its points, and
busbw under the box's ceilings."""

from __future__ import annotations

import math

import numpy as np
from _rvt_model import cost_terms, halving_doubling_schedule, ring_schedule, size_text, tree_schedule

from mlsys import cli, plot
from mlsys.collectives import is_power_of_two


# --8<-- [start:draw_steps]
def draw_steps(world_size: int, args: cli.PlotArgs) -> dict[str, list[dict]]:
    """One row per algorithm (ring, tree, halving-doubling), one panel per step: who sends to whom and how much (as
    a fraction of the n-element buffer), from the schedules above. Returns the schedules it drew."""
    from fractions import Fraction

    from matplotlib.patches import FancyArrowPatch

    p, numel = world_size, 16 * world_size  # a size every step divides evenly, so the labels are exact fractions
    drawn = {"ring": ring_schedule(p, numel), "tree": tree_schedule(p, numel)}
    if is_power_of_two(p):
        drawn["halving-doubling"] = halving_doubling_schedule(p, numel)
    tree_pos = {}
    for r in range(p):  # heap layout: depth d on row -d, spread evenly within the row
        d = (r + 1).bit_length() - 1
        tree_pos[r] = ((r + 1 - 2**d + 0.5) / 2**d * (p - 1), -1.2 * d)
    line_pos = {r: (float(r), 0.0) for r in range(p)}
    ring_pos = {r: ((p - 1) / 2 * (1 + 0.8 * math.sin(2 * math.pi * r / p)), 1.2 * math.cos(2 * math.pi * r / p))
                for r in range(p)}  # clockwise on a circle, rank 0 on top
    plt = plot.pyplot()
    cols = max(m["step"] for sched in drawn.values() for m in sched) + 1
    size = 0.55 * p + 0.8  # inches per panel
    fig, axes = plt.subplots(len(drawn), cols, figsize=(size * cols, (size + 0.3) * len(drawn)), squeeze=False)
    for row, (name, sched) in enumerate(drawn.items()):
        pos = {"tree": tree_pos, "ring": ring_pos}.get(name, line_pos)
        sent = [sum(Fraction(m["hi"] - m["lo"], numel) for m in sched if m["src"] == r) for r in range(p)]
        for step in range(cols):
            ax = axes[row, step]
            ax.set_axis_off()
            if step > max(m["step"] for m in sched):
                continue  # this algorithm is done: a blank panel
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
        footer = "bytes sent, per rank: " + ", ".join(f"{r}: {v}n".replace(": 1n", ": n") for r, v in enumerate(sent))
        axes[row, 0].text(0, -0.02, footer, transform=axes[row, 0].transAxes, fontsize=7, ha="left", va="top",
                          clip_on=False)
    fig.suptitle(f"all-reduce on {p} ranks, step by step\norange: the receiver adds it, green: the receiver copies it; "
                 "n = the buffer's size", fontsize=9)
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'steps')}")
    return drawn
# --8<-- [end:draw_steps]


def draw_waits(world_size: int, args: cli.PlotArgs) -> dict[str, dict[int, list[str]]]:
    """Step 0 of the ring beside step 0 of the tree, one lane per rank: the step's messages (arrows, sender to
    receiver) and, on each lane, what that rank posted and must wait for before its step is over. From ring_schedule
    and tree_schedule; a sketch of who waits for what, not a measured time. Returns each rank's waits."""
    p, plt = world_size, plot.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 0.6 * p + 1.4))
    waits = {}
    for ax, (name, sched) in zip(axes, (("ring", ring_schedule(p, 16 * p)), ("tree", tree_schedule(p, 16 * p)))):
        step = [m for m in sched if m["step"] == 0]
        waits[name] = {r: [f"send to {m['dst']}" for m in step if m["src"] == r]
                       + [f"recv from {m['src']}" for m in step if m["dst"] == r] for r in range(p)}
        for r, items in waits[name].items():  # a lane per rank; its bar: red for two waits, orange for one
            ax.axhline(-r, color="0.85", lw=1, zorder=0)
            if items:
                ax.barh(-r, 1.0, height=0.45, color="#cc0000" if len(items) > 1 else "#ff9900", alpha=0.55)
            ax.text(1.08, -r, " + ".join(items) or "nothing to do", va="center", fontsize=8)
            ax.text(-0.06, -r, f"rank {r}", ha="right", va="center", fontsize=8)
        for i, m in enumerate(step):  # one arrow per message, spread along the step
            x = 0.1 + 0.8 * (i + 0.5) / len(step)
            ax.annotate("", (x, -m["dst"]), (x, -m["src"]), arrowprops={"arrowstyle": "-|>", "color": "C0"})
        most = max(map(len, waits[name].values()))
        ax.set(xlim=(-0.45, 2.5), ylim=(-p + 0.5, 0.7))
        ax.set_axis_off()
        ax.set_title(f"{name}, step 0: {len(step)} message(s); a rank waits for up to {most}", fontsize=9)
    fig.suptitle(f"one step on {p} ranks: what each rank posts and waits for (a sketch from the schedules, "
                 "not measured times)", fontsize=9)
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'waits')}")
    return waits


def draw_times(rows: list[dict], world_size: int, args: cli.PlotArgs) -> dict[str, list[list[float]]]:
    """Time per all-reduce of every algorithm against size, as measured (no model): the median, and a bar from the
    fastest to the slowest round. Returns [size, fastest, median, slowest] per algorithm."""
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    drawn = {}
    for i, name in enumerate(dict.fromkeys(r["algorithm"] for r in rows)):
        drawn[name] = [[r["size (B)"], min(r.get("rounds (us)") or [r["time (us)"]]), r["time (us)"],
                        max(r.get("rounds (us)") or [r["time (us)"]])] for r in rows if r["algorithm"] == name]
        n, lo, mid, hi = np.array(sorted(drawn[name])).T
        ax.errorbar(n * 1.06**i, mid, yerr=[mid - lo, hi - mid], fmt="o-", color=f"C{i}", capsize=2, label=name)
    ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="time per all-reduce (us)")
    ax.legend(fontsize=8)
    ax.set_title(f"all-reduce algorithms, {world_size} ranks, gloo on CPU (measured): dot the median, "
                 "bar fastest to slowest round", fontsize=9)
    print(f"figure: {plot.save(fig, args, 'ring_vs_tree')}")
    return drawn


# --8<-- [start:draw_model]
def draw_alpha_beta(summary: dict, world_size: int, args: cli.PlotArgs) -> dict:
    """Top row, one panel per modelled algorithm: its measured points (filled: seen by the fit; hollow: held out,
    with measured/model written beside them), the model a*alpha + b*n*beta (dashed) and its two terms (dotted), and
    the sizes where the latency term is the larger (latency-bound) or the byte term (bandwidth-bound) shaded.
    A second figure, crossover.png: the ring's and the tree's model lines on one set of axes, their measured
    medians as dots, and the model's crossover n* (the printed one, summary["predicted_crossover_bytes"]) marked,
    the size range widened to include it. Returns what it drew, both figures."""
    plt = plot.pyplot()
    alpha, beta, points = summary["alpha_s"], summary["beta_s_per_byte"], summary["model_points"]
    names = list(dict.fromkeys(p["algorithm"] for p in points))
    fig = plt.figure(figsize=(max(4.3 * len(names), 9.0), 5.0))
    grid_spec = fig.add_gridspec(2, len(names), height_ratios=[4.0, 0.45])
    axes = np.array([[fig.add_subplot(grid_spec[0, i]) for i in range(len(names))]])
    for ax in axes[0, 1:]:
        ax.sharey(axes[0, 0])
        ax.tick_params(labelleft=False)
    lo, hi = min(p["size (B)"] for p in points), max(p["size (B)"] for p in points)
    grid = np.geomspace(lo, hi, 64)
    panels, ratios = {}, []
    for ax, name in zip(axes[0], names):
        a, b = cost_terms(name, world_size)
        knee = a * alpha / (b * beta) if beta > 0 else math.inf  # latency term == byte term
        ax.axvspan(lo, min(max(knee, lo), hi), color="C1", alpha=0.15, label="latency-bound")
        if knee < hi:
            ax.axvspan(max(knee, lo), hi, color="C0", alpha=0.10, label="bandwidth-bound")
        ax.loglog(grid, 1e6 * (a * alpha + b * grid * beta), "--", color="0.2", label="model a·α + b·n·β")
        ax.loglog(grid, np.full_like(grid, 1e6 * a * alpha), ":", color="C1", lw=1.2, label="latency term a·α")
        if beta > 0:
            ax.loglog(grid, 1e6 * b * grid * beta, ":", color="C0", lw=1.2, label="byte term b·n·β")
        mine = [p for p in points if p["algorithm"] == name]
        for role, face in (("fit", "C3"), ("held out", "none")):
            pts = [p for p in mine if p["role"] == role]
            if pts:
                ax.loglog([p["size (B)"] for p in pts], [p["measured (us)"] for p in pts], "o", color="C3",
                          mfc=face, label=f"measured, {'seen by the fit' if role == 'fit' else 'held out'}")
        held = [p for p in mine if p["role"] == "held out"]
        for i, p in enumerate(held):  # away from the model line, which rises to the right: above the line, up
            above = p["measured/model"] >= 1  # and to the left; below it, down and to the right; every other
            dy = 4 + 9 * (i % 2)  # label further out, so that neighbours at the same height do not collide
            # at the panel's left or right end the label turns inwards, so that it stays inside the axes
            left = (above and p["size (B)"] > lo) or (not above and p["size (B)"] >= hi)
            ratio = p["measured/model"]  # two digits, without an exponent: x1.2, x43, x104
            text = f"×{ratio:.2g}" if ratio < 100 else f"×{ratio:.0f}"  # overlaps are moved apart at the end
            ratios.append(ax.annotate(text, (p["size (B)"], p["measured (us)"]),
                                      xytext=(-2 if left else 2, dy if above else -dy), ha="right" if left else "left",
                                      va="bottom" if above else "top", textcoords="offset points", fontsize=7,
                                      color="C3", bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none",
                                                        "alpha": 0.7}))
        ax.set_title(f"{name}: {a:g}α + {b:.3g}·nβ", fontsize=10)
        ax.set_xlabel("message size n (bytes)")
        panels[name] = {"steps": a, "bytes_factor": b, "knee_bytes": knee if math.isfinite(knee) else None,
                        "points": mine}
    axes[0, 0].set_ylabel("time per all-reduce (us)")
    shown = [p["measured (us)"] for p in points] + [p["model (us)"] for p in points]
    # the term lines may run far below: keep the points, with room above the highest for its label
    axes[0, 0].set_ylim(0.5 * min(shown), 3 * max(shown))
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_legend_handles_labels()[0]}
    legend_ax = fig.add_subplot(grid_spec[1, :])  # the top row's legend, right under it
    legend_ax.axis("off")
    legend_ax.legend(list(handles.values()), list(handles), loc="center", ncol=4, fontsize=8, frameon=False)
    bandwidth = f"1/β = {1 / beta / 1e9:.2f} GB/s" if beta > 0 else "β = 0"
    fig.suptitle(f"one alpha-beta model, fitted to ring and tree at {len(summary['fit_sizes'])} of "
                 f"{len(summary['fit_sizes']) + len(summary['held_out_sizes'])} sizes: α = {alpha * 1e6:.0f} us "
                 f"per step, {bandwidth} ({world_size} ranks)", fontsize=10)
    fig.tight_layout()
    _separate_labels(fig, ratios)
    print(f"figure: {plot.save(fig, args, 'alpha_beta')}")
    fig2, ax2 = plt.subplots(figsize=(10.0, 4.2))  # the crossover, a figure of its own
    crossover = draw_ring_and_tree(ax2, summary, world_size, lo, hi)
    fig2.tight_layout()
    print(f"figure: {plot.save(fig2, args, 'crossover')}")
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "fit_sizes": summary["fit_sizes"],
            "held_out_sizes": summary["held_out_sizes"], "panels": panels, "crossover": crossover}


def draw_ring_and_tree(ax, summary: dict, world_size: int, lo: float, hi: float) -> dict:
    """The ring's and the tree's model lines on one set of axes, their measured medians as dots, and the model's
    crossover n* as a vertical line (when there is one), the size range widened to include it. Returns what it
    drew: n* and the size range."""
    alpha, beta, cross = summary["alpha_s"], summary["beta_s_per_byte"], summary["predicted_crossover_bytes"]
    left, right = min(lo, cross / 4) if cross else lo, max(hi, cross * 4) if cross else hi
    left, right = left / 1.4, right * 1.4  # a margin, so that the end points are not cut in half
    sizes = np.geomspace(left, right, 128)
    for name, color, style in (("ring", "C0", "-"), ("tree", "C2", "--")):  # dashed: visible where they coincide
        a, b = cost_terms(name, world_size)
        ax.loglog(sizes, 1e6 * (a * alpha + b * sizes * beta), style, color=color, lw=1.8,
                  label=f"{name} model {a:g}α + {b:.3g}·nβ")
        mine = sorted((p["size (B)"], p["measured (us)"]) for p in summary["model_points"] if p["algorithm"] == name)
        ax.loglog(*zip(*mine), "o", color=color, ms=5, alpha=0.7, label=f"{name} measured (median)")
    if cross:
        a, b = cost_terms("ring", world_size)
        ax.axvline(cross, color="0.2", ls=":", lw=1.4, label=f"model crossover n* = {size_text(cross)}")
        ax.plot([cross], [1e6 * (a * alpha + b * cross * beta)], "o", color="0.2", ms=7, mfc="white")
    ax.set_title("ring and tree models on one set of axes: tree faster left of n*, ring right of it" if cross else
                 "ring and tree models on one set of axes: no crossover in the model", fontsize=10)
    ax.set(xlabel="message size n (bytes)", ylabel="time per all-reduce (us)", xlim=(left, right))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes, off the data
    return {"n_star_bytes": cross, "size_range": [float(left), float(right)]}
# --8<-- [end:draw_model]


def _separate_labels(fig, labels: list) -> None:
    """Move each label that would overlap an earlier one of its panel further out (away from its point), in steps."""
    renderer = fig.canvas.get_renderer()
    placed: dict = {}
    for label in labels:
        earlier = placed.setdefault(label.axes, [])
        dx, dy = label.xyann
        for _ in range(4):  # 10 points further out per try; after that, it stays where the last try put it
            box = label.get_window_extent(renderer).expanded(1.05, 1.2)
            if not any(box.overlaps(e) for e in earlier):
                break
            dy += 10 if dy > 0 else -10
            label.xyann = (dx, dy)
        earlier.append(label.get_window_extent(renderer).expanded(1.05, 1.2))


def draw_ceiling(rows: list[dict], ceiling: dict, world_size: int, args: cli.PlotArgs) -> dict:
    """busbw of every algorithm against size, under the box's two ceilings. Returns the lines it drew."""
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    lines = {}
    for i, name in enumerate(dict.fromkeys(r["algorithm"] for r in rows)):
        mine = sorted((r["size (B)"], r["busbw (GB/s)"]) for r in rows if r["algorithm"] == name)
        ax.loglog(*zip(*mine), "o-", color=f"C{i}", label=name)
        lines[name] = {"size (B)": [s for s, _ in mine], "busbw (GB/s)": [b for _, b in mine]}
    ax.axhline(ceiling["memcpy_GBps"], color="0.2", ls="--", label=f"memcpy {ceiling['memcpy_GBps']:.2f} GB/s")
    ax.axhline(ceiling["loopback_tcp_GBps"], color="0.4", ls=":",
               label=f"loopback TCP {ceiling['loopback_tcp_GBps']:.2f} GB/s")
    ax.set(xlabel="message size (bytes)", ylabel="busbw (GB/s): algbw × 2(p-1)/p for every algorithm")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"busbw under the ceilings of this box, {world_size} ranks", fontsize=10)
    print(f"figure: {plot.save(fig, args, 'ceiling')}")
    return {"lines": lines, **ceiling}
