"""The two figures of parallel_planner.py, drawn from the candidate layouts it costed (the same dicts it prints):
layouts.png (every layout's step time split into its components, fitting or not) and stages.png (one pipeline's
per-stage times, and its 1F1B timeline on the ideal clock with those times). What each draws is returned as plain
numbers for the script's --json. A file starting with _ is a helper, not a script."""

from __future__ import annotations

from pathlib import Path

from mlsys import plot
from mlsys.pipeline import simulate

# the step-time components the planner computes (mlsys.memory.step_time_estimate), in the order they are stacked
COMPONENTS = ("compute", "bubble", "imbalance", "tp", "dp", "pp", "ep")
NAMES = {"compute": "compute", "bubble": "bubble (fill and drain)", "imbalance": "imbalance (waiting for the "
         "slowest stage)", "tp": "TP communication", "dp": "DP communication", "pp": "PP communication",
         "ep": "EP communication"}


def name(row: dict, experts: int) -> str:
    return f"dp={row['dp']} tp={row['tp']} pp={row['pp']}" + (f" ep={row['ep']}" if experts > 1 else "")


def layout_bars(rows: list[dict], best: dict | None, experts: int) -> list[dict]:
    """One bar per costed layout, fastest first: its step-time components in seconds, its total and its memory."""
    bars = []
    for r in sorted(rows, key=lambda r: r["t_total"]):
        bars.append({"layout": name(r, experts), "dp": r["dp"], "tp": r["tp"], "pp": r["pp"], "ep": r["ep"],
                     "components": {k: r[f"t_{k}"] for k in COMPONENTS}, "t_total": r["t_total"],
                     "fits": r["fits"], "total_GiB": r["total_GiB"], "recommended": r is best})
    return bars


def stage_picture(row: dict, peak_flops: float, mfu: float, fwd_share: float, m: int, experts: int) -> dict:
    """Per-micro-batch time of each stage of `row`'s pipeline (its flops on its tp GPUs at mfu of peak; forward
    `fwd_share` of it, backward the rest), and the ideal 1F1B timeline of those stages for m micro-batches."""
    stage_ms = [1e3 * f / (row["tp"] * peak_flops * mfu) for f in row["stage_flops"]]
    p = len(stage_ms)
    events = simulate("1f1b", p, m, [fwd_share * t for t in stage_ms], [(1 - fwd_share) * t for t in stage_ms])
    end = max(e["end"] for stage in events for e in stage)
    idle = [end - sum(e["end"] - e["start"] for e in stage) for stage in events]
    return {"layout": name(row, experts), "pp": p, "planned_micro_batches": row["micro"], "stage_ms": stage_ms,
            "mean_ms": sum(stage_ms) / p, "last_over_mean": stage_ms[-1] / (sum(stage_ms) / p),
            "timeline_m": m, "forward_share": fwd_share, "events": events, "end_ms": end, "idle_ms": idle}


def draw_layouts(bars: list[dict], usable_gib: float, title: str, args) -> Path:
    """One horizontal stacked bar per layout (fastest on top); layouts that do not fit hatched and faded."""
    plt = plot.pyplot()
    from matplotlib.patches import Patch

    used = [k for k in COMPONENTS if any(b["components"][k] > 0 for b in bars)]
    palette = plot.colours(k for k in COMPONENTS if k != "compute")
    palette["compute"] = "0.78"
    palette["imbalance"] = "#ece133"  # yellow: the palette's orange sat too close to the dp piece's vermilion
    n, longest = len(bars), max(b["t_total"] for b in bars)
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.34 * n))
    for y, b in enumerate(bars):
        left = 0.0
        style = {} if b["fits"] else {"alpha": 0.35, "hatch": "///"}
        for k in used:
            w = b["components"][k]
            ax.barh(y, w, left=left, height=0.7, color=palette[k], edgecolor="black", linewidth=0.4, **style)
            left += w
        ax.text(b["components"]["compute"] / 2, y, f"compute {b['components']['compute']:.2f} s", ha="center",
                va="center", fontsize=7, color="0.2")
        note = (f"{b['t_total']:.2f} s, {b['total_GiB']:.1f} GiB per GPU" if b["fits"] else
                f"{b['t_total']:.2f} s, does not fit: {b['total_GiB']:.1f} > {usable_gib:.1f} GiB")
        if b["recommended"]:
            note += "  \u2190 recommended"
        ax.text(1.01, y, note, va="center", fontsize=8, transform=ax.get_yaxis_transform(),
                fontweight="bold" if b["recommended"] else "normal", color="black" if b["fits"] else "0.35")
    ax.set_yticks(range(n), [b["layout"] for b in bars], fontsize=8)
    for tick, b in zip(ax.get_yticklabels(), bars):
        tick.set_fontweight("bold" if b["recommended"] else "normal")
        tick.set_color("black" if b["fits"] else "0.45")
    ax.set_ylim(n - 0.4, -0.6)  # the fastest on top
    ax.set_xlim(0, longest * 1.01)
    ax.grid(axis="y", visible=False)
    ax.set(xlabel="estimated step time (s)", title=title)
    handles = [Patch(facecolor=palette[k], edgecolor="black", label=NAMES[k]) for k in used]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="does not fit in memory"))
    fig.tight_layout()  # then the legend goes right under the axis label, whatever the figure's height
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=4, fontsize=8, frameon=False)
    return plot.save(fig, args, "layouts")


def draw_stages(pic: dict, args) -> Path:
    """Top: each stage's time per micro-batch, the mean dashed. Bottom: the 1F1B timeline of those stages."""
    plt = plot.pyplot()
    p, ms = pic["pp"], pic["stage_ms"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 3.2 + 0.26 * p),
                                      gridspec_kw={"height_ratios": [2.2, 0.26 * p + 0.4]})
    palette = {"forward": "#4c72b0", "backward": "#dd8452", "idle": "0.9"}
    top.bar(range(p), ms, color=["#4c72b0"] * (p - 1) + ["#c44e52"], edgecolor="black", linewidth=0.4)
    top.axhline(pic["mean_ms"], color="black", linestyle="--", linewidth=1,
                label=f"mean of the {p} stages: {pic['mean_ms']:.1f} ms")
    top.legend(loc="upper left", fontsize=8)
    top.text(p - 1, ms[-1], f"{ms[-1]:.1f} ms = {pic['last_over_mean']:.3f}x the mean\n(its layers + the output "
             "head)", ha="right", va="bottom", fontsize=8)
    top.set_xticks(range(p), [str(s) for s in range(p)], fontsize=8)
    top.set_xlim(-0.6, p - 0.4)
    top.set_ylim(0, max(ms) * 1.35)
    top.set(xlabel="stage", ylabel="ms per micro-batch\n(forward + backward)",
            title=f"{pic['layout']}: each stage's time per micro-batch")
    spans = []
    for s, events in enumerate(pic["events"]):
        lane, clock = f"stage {s}", 0.0
        for e in events:
            if e["start"] > clock:
                spans.append(plot.Span(lane, clock, e["start"], "", "idle"))
            spans.append(plot.Span(lane, e["start"], e["end"], str(e["mb"]),
                                   "forward" if e["kind"] == "F" else "backward"))
            clock = e["end"]
        if clock < pic["end_ms"]:
            spans.append(plot.Span(lane, clock, pic["end_ms"], "", "idle"))
    plot.timeline(bottom, spans, [f"stage {s}" for s in range(p)], unit="ms since the step started",
                  palette=palette, fontsize=6, legend=False)
    from matplotlib.patches import Patch

    bottom.legend(handles=[Patch(facecolor=c, edgecolor="black", label=k) for k, c in palette.items()],
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    bottom.tick_params(axis="y", labelsize=8)
    bottom.axvline(pic["end_ms"], color="black", linewidth=1)
    bottom.set_xlim(0, pic["end_ms"] * 1.01)
    bottom.set_title(f"1F1B with these stage times, m = {pic['timeline_m']} micro-batches (the planned step has "
                     f"{pic['planned_micro_batches']}): ends at {pic['end_ms']:.0f} ms "
                     "= sum of the stage times + (m-1) x the slowest", fontsize=10)
    fig.tight_layout()
    return plot.save(fig, args, "stages")
