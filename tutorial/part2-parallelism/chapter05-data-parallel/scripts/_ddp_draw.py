"""The chapter's drawings. ddp_from_scratch.py's figures: the ideal-overlap model and the profiled step, and the
interval arithmetic both the drawing and the script's overlap numbers use; dp_training.py's step 1 on every rank;
local_sgd.py's drift of the replicas. A file starting with _ is a helper, not a script."""

from __future__ import annotations

from mlsys import plot

ALL_REDUCE = "all-reduce (bucket number)"


LAUNCH = "launch call (thread held in it)"


def minus(intervals: list[tuple[float, float]], cuts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of `intervals` outside every interval of `cuts` (all half-open (start, end) pairs)."""
    out = list(intervals)
    for c0, c1 in cuts:
        out = [piece for a, b in out for piece in ((a, min(b, c0)), (max(a, c1), b)) if piece[1] > piece[0]]
    return out


def draw_ideal(args, ideal: dict):
    """The two schedules of `ideal_schedule` one above the other, on the same time axis."""
    plt = plot.pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(11, 4.4), sharex=True)
    lanes = ["backward", "all-reduce"]
    owner = {i: k for k, b in enumerate(ideal["buckets"]) for i in b}
    kinds = [f"bucket {k}" for k in range(len(ideal["buckets"]))]
    palette = plot.colours(kinds)
    for ax, name in zip(axes, ("bucketed", "overlapped")):
        spans = [plot.Span("backward", a, b, "", f"bucket {owner[i]}") for i, (a, b) in enumerate(ideal["backward"])]
        spans += [plot.Span("all-reduce", a, b, f"b{k}", f"bucket {k}") for k, (a, b) in enumerate(ideal[name])]
        plot.timeline(ax, spans, lanes, palette=palette, legend=ax is axes[0], fontsize=9)
        end = ideal[f"{name}_end"]
        ax.axvline(end, color="black", linewidth=1.2)
        right = end > 0.9 * ideal["bucketed_end"]  # near the right edge: write it on the line's left
        ax.text(end, 1.55, f" step ends at {end:.2f} ", ha="right" if right else "left", va="center", fontsize=9)
        if name == "overlapped":
            for t in ideal["ready"]:  # where each bucket's last gradient is ready: its launch
                ax.axvline(t, color="black", linestyle=":", linewidth=1)
        ax.set_title(f"{name}: " + ("every all-reduce after the backward" if name == "bucketed" else
                                    "each bucket's all-reduce starts once its last gradient is ready"
                                    " (dotted) and the previous one is done"), fontsize=10, loc="left")
        ax.set_ylim(-0.6, 1.8)
    saved = ideal["bucketed_end"] - ideal["overlapped_end"]
    if saved > 0:
        axes[1].annotate("", xy=(ideal["overlapped_end"], 0), xytext=(ideal["bucketed_end"], 0),
                         arrowprops={"arrowstyle": "<->", "color": "black"})
        axes[1].text((ideal["overlapped_end"] + ideal["bucketed_end"]) / 2, 0.08, f"saved {saved:.2f}",
                     ha="center", va="bottom", fontsize=9)
    axes[1].set_xlabel(f"time, in units of one backward (model: all-reducing all gradients takes "
                       f"{ideal['comm_share']:g} of it)")
    axes[1].set_xlim(0, ideal["bucketed_end"] * 1.02)
    fig.suptitle("Ideal overlap: the run's real buckets, modelled timings (not measured)", fontsize=11)
    fig.tight_layout()
    return plot.save(fig, args, "ideal_overlap_vs_bucketed_model")


GAP = "training thread in no named range"


def _levels(centres_widths: list[tuple[float, float]]) -> list[int]:
    """A text row for each label (x centre, width) so that labels on the same row do not overlap."""
    ends: list[float] = []  # the right end of the last label on each row
    out = []
    for x, w in centres_widths:
        level = next((i for i, e in enumerate(ends) if x - w / 2 > e), len(ends))
        ends[level:level + 1] = [x + w / 2]
        out.append(level)
    return out


def draw_overlap(args, spans: list[plot.Span]):
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.2))
    launches = [s for s in spans if s.lane == "launch"]
    cuts = [(s.start, s.end) for s in launches]
    named = sorted((s for s in spans if s.lane == "compute"), key=lambda s: s.start)  # the training thread's ranges
    boxes = []
    for s in spans:
        if s.lane == "copy back":  # the wait's copies into .grad: microseconds each, too thin to draw
            continue
        if s.lane == "launch":  # the hook's launch call, on the training thread: drawn on the compute row
            boxes.append(plot.Span("compute", s.start, s.end, "", LAUNCH))  # named by its dotted "launch k" line
        elif s.lane == "compute":  # a range minus the launch calls inside it; its name is written above the row
            boxes += [plot.Span("compute", a, b, "", s.kind) for a, b in minus([(s.start, s.end)], cuts)]
        else:
            boxes.append(plot.Span(s.lane, s.start, s.end, s.label, s.kind))
    # what is left of the training thread's row between its named ranges and launch calls: drawn grey
    covered = sorted([(s.start, s.end) for s in named] + cuts)
    gaps = minus([(covered[0][0], max(b for _, b in covered))], covered)
    # a gap too narrow to see (autograd's step between two blocks, on a core) is drawn without a legend entry
    visible = (max(b for _, b in covered) - covered[0][0]) / 200
    boxes += [plot.Span("compute", a, b, "", GAP if b - a > visible else "") for a, b in gaps if b - a > 0.01]
    lanes = ["compute"] + sorted({s.lane for s in boxes} - {"compute"})
    palette = plot.colours(["forward", "backward", ALL_REDUCE, "wait for all-reduces", LAUNCH]) | {GAP: "0.85",
                                                                                                  "": "0.85"}
    plot.timeline(ax, boxes, lanes, unit="ms since the profiled step's forward started (rank 0)", palette=palette,
                  fontsize=8)
    top, bottom = len(lanes) - 1 + 0.4, -0.4  # the upper edge of the top row, the lower edge of the bottom row
    x_max = max(s.end for s in spans)  # launch calls keep their measured width: a short one is a thin line
    char = x_max / 110  # about one character of 7-point text (with room to spare), in ms, on this axis
    # the name of each range of the training thread above its row, with a bracket over the whole range
    names = [(s, {"wait for all-reduces": "wait"}.get(s.label, s.label.replace("block ", "blk "))) for s in named]
    name_levels = _levels([((s.start + s.end) / 2, (len(t) + 1) * char) for s, t in names])
    marks = [(s.start + (len(f"launch {k}") / 2 + 0.5) * char, (len(f"launch {k}") + 1) * char)
             for k, s in enumerate(launches)]
    mark_levels = _levels(marks)
    # a short backward in a long step stacks the labels into many rows: make room for every row
    above, below = max(name_levels, default=0), max(mark_levels, default=0)
    fig.set_figheight(4.2 + 0.25 * (max(0, above - 2) + max(0, below - 2)))
    for (s, text), level in zip(names, name_levels):
        y = top + 0.12 + 0.3 * level
        ax.plot([s.start, s.start, s.end, s.end], [top + 0.02, y, y, top + 0.02], color="black", linewidth=0.7,
                clip_on=False)
        ax.text((s.start + s.end) / 2, y + 0.03, text, ha="center", va="bottom", fontsize=7)
    # where the gradient hook launched each bucket: a dotted line down, named below the bottom row
    for (k, s), level in zip(enumerate(launches), mark_levels):
        y = bottom - 0.08 - 0.28 * level
        ax.plot([s.start, s.start], [top - 1.0, y], color="black", linestyle=":", linewidth=1)
        ax.text(s.start, y, f" launch {k}", ha="left", va="top", fontsize=7)
    ax.set_ylim(bottom - 0.9 - 0.28 * max(0, below - 2), top + 1.0 + 0.3 * max(0, above - 2))
    ax.set_xlim(0, x_max * 1.02)
    ax.set_title("One overlapped DDP step on rank 0, from its torch.profiler trace", pad=4)
    fig.tight_layout()
    return plot.save(fig, args, "ddp_overlap")


# ---- dp_training.py: one data-parallel step ------------------------------------------------------------------
def entry_names(model, entries: list[int]) -> list[str]:
    """A short name for each flat parameter position, e.g. h.0.mlp.c_fc.w[5,17] (the order of model.parameters())."""
    import numpy as np

    names, start = [], 0
    spans = []
    for name, p in model.named_parameters():
        spans.append((start, start + p.numel(), name.replace(".weight", ".w").replace(".bias", ".b"), p.shape))
        start += p.numel()
    for e in entries:
        first, _, name, shape = next(s for s in spans if s[0] <= e < s[1])
        index = np.unravel_index(e - first, tuple(shape))
        names.append(f"{name}[{','.join(str(int(i)) for i in index)}]")
    return names


def draw_dp_step(args, step1: dict, shards: list[dict], names: list[str], block_size: int):
    """One row per rank: (a) its shard of the stream and its first batch's windows, (b) its own gradient g_r on the
    chosen entries, (c) the averaged gradient after the all-reduce, with every rank's g_r as dots, (d) the change
    the optimizer step made to those entries. An all-reduce box joins (b) to (c)."""
    import numpy as np
    from matplotlib.patches import FancyArrowPatch

    plt = plot.pyplot()
    world = len(shards)
    local, averaged = np.array(step1["local"]), np.array(step1["averaged"])  # (W, n)
    change = np.array(step1["after"]) - np.array(step1["before"])  # (W, n)
    colours = plot.colours([f"rank {r}" for r in range(world)])
    height = 1.55 * world + 2.6  # inches: the rows, 1.1 above them for the titles, 1.5 below for the entry names
    fig = plt.figure(figsize=(16, height))
    grid = fig.add_gridspec(world, 5, width_ratios=[3.0, 2.2, 0.9, 2.2, 2.2], left=0.04, right=0.99,
                            top=1 - 1.1 / height, bottom=1.5 / height, wspace=0.28, hspace=0.35)
    n = len(names)
    xs = np.arange(n)
    g_lim = 1.15 * max(np.abs(local).max(), np.abs(averaged).max())
    d_lim = 1.15 * np.abs(change).max()
    total = shards[-1]["last token"] + 1
    rows = []
    for r in range(world):
        stream, own, mean, step = (fig.add_subplot(grid[r, c]) for c in (0, 1, 3, 4))
        colour = colours[f"rank {r}"]
        for s in shards:  # the stream as a bar, one segment per shard
            mine = s["rank"] == r
            stream.barh(0, s["tokens"], left=s["first token"], height=0.6, color=colour if mine else "0.88",
                        edgecolor="white")
            stream.text(s["first token"] + s["tokens"] / 2, 0.45, f"rank {s['rank']}'s shard", ha="center",
                        va="bottom", fontsize=8, fontweight="bold" if mine else "normal")
        for start in step1["starts"][r]:  # this rank's first-batch windows, drawn at least a pixel wide
            stream.axvspan(shards[r]["first token"] + start, shards[r]["first token"] + start + block_size,
                           ymin=0.2, ymax=0.5, color="black", lw=0.8)
        stream.set(xlim=(0, total), ylim=(-0.5, 1.0), yticks=[], ylabel=f"rank {r}")
        stream.locator_params(axis="x", nbins=4)  # token positions are long numbers: few ticks, small type
        stream.tick_params(axis="x", labelsize=8)
        stream.grid(False)
        own.bar(xs, local[r], color=colour)
        mean.bar(xs, averaged[r], color="0.35", label="mean over ranks")
        for q in range(world):  # every rank's g_r, as dots: the bar is their mean
            mean.plot(xs, local[q], "o", ms=3.5, color=colours[f"rank {q}"], label=f"rank {q}'s g_r")
        step.bar(xs, change[r], color="0.55")
        for ax, lim in ((own, g_lim), (mean, g_lim), (step, d_lim)):
            ax.axhline(0, color="black", lw=0.6)
            ax.set(xlim=(-0.6, n - 0.4), ylim=(-lim, lim), xticks=xs)
            ax.tick_params(axis="y", labelsize=7)
            ax.set_xticklabels(names if r == world - 1 else [], rotation=90, fontsize=7)
        rows.append((own, mean))
        if r == 0:
            marked = f"black: its {len(step1['starts'][r])} windows" if step1["starts"][r] else "windows not marked"
            stream.set_title(f"(a) this rank's batch: its shard of the stream\n({marked})", fontsize=10)
            own.set_title("(b) g_r: this rank's own gradient\n(its own batch, before any communication)",
                          fontsize=10)
            mean.set_title("(c) after the all-reduce: (1/W) sum of g_r\n(dots: every rank's g_r)", fontsize=10)
            step.set_title("(d) after the optimizer step:\nparameter after - before", fontsize=10)
    rows[-1][0].set_xlabel("")
    stream.set_xlabel("position in the token stream")
    # the all-reduce: an arrow from every rank's (b) into one box, and from the box to every rank's (c)
    own_x = rows[0][0].get_position().x1
    mean_x = rows[0][1].get_position().x0
    box_x = (own_x + mean_x) / 2
    box_y = (rows[0][0].get_position().y1 + rows[-1][0].get_position().y0) / 2
    fig.text(box_x, box_y, f"all-reduce\n(sum, / {world})", ha="center", va="center", fontsize=10,
             bbox={"boxstyle": "round", "facecolor": "#fff3c4", "edgecolor": "black"})
    for own, _ in rows:
        y = (own.get_position().y0 + own.get_position().y1) / 2
        for a, b in (((own_x + 0.004, y), (box_x - 0.03, box_y)), ((box_x + 0.03, box_y), (mean_x - 0.004, y))):
            fig.add_artist(FancyArrowPatch(a, b, transform=fig.transFigure, arrowstyle="-|>", mutation_scale=12,
                                           color="black", lw=1.0))
    chosen = "where the ranks' gradients differ most" if world > 1 else "with the largest gradient (one rank)"
    fig.suptitle(f"Step 1 of the run on each of its {world} rank(s), on the {n} parameter entries {chosen}",
                 fontsize=12)
    return plot.save(fig, args, "dp_step")


# ---- local_sgd.py: how far the replicas drift between synchronisations ------------------------------------------
def draw_drift(args, drift: dict):
    """One panel per run: each rank's ||theta_r - mean theta|| after every step, dropping at each averaging (the
    line goes straight down at that step); a grey line at every all-reduce the run makes."""
    plt = plot.pyplot()
    runs = list(drift)
    world = len(drift[runs[0]]["after_step"][0])
    fig, axes = plt.subplots(1, len(runs), figsize=(12, 3.4), sharey=True)
    colours = plot.colours([f"rank {r}" for r in range(world)])
    h = args.sync_every
    what = {"sync": "gradients all-reduced every step", "local": f"parameters averaged every {h} steps",
            "diloco": f"outer step every {h} steps"}
    top = max(max(map(max, d["after_step"])) for d in drift.values())
    for ax, run in zip(axes, runs):
        d = drift[run]
        steps = range(1, len(d["after_step"]) + 1)
        reduces = list(steps) if run == "sync" else d["sync_steps"]  # where this run all-reduces
        for k, s in enumerate(reduces):
            ax.axvline(s, color="crimson", alpha=0.5, lw=0.8, ls=":", zorder=1,
                       label="an all-reduce" if k == 0 else None)
        after = dict(zip(d["sync_steps"], d["after_sync"]))
        for r in range(world):  # the point after the step, then (at an averaging) the point after the averaging
            xs = [x for s in steps for x in ([s, s] if s in after else [s])]
            ys = [y for s in steps for y in ([d["after_step"][s - 1][r], after[s][r]] if s in after
                                              else [d["after_step"][s - 1][r]])]
            ax.plot(xs, ys, color=colours[f"rank {r}"], lw=2.2 if r == 0 else 1.2, ls="-" if r == 0 else "--",
                    zorder=2, label=f"rank {r}")
        ax.set(title=f"{run}: {what.get(run, run)}", xlabel="step", xlim=(0, len(steps) + 0.5))
        ax.title.set_fontsize(10)
        ax.grid(axis="x", visible=False)  # vertical lines are the all-reduces only
        if world == 1:
            ax.text(0.5, 0.5, "W = 1: one replica,\nnothing to drift", transform=ax.transAxes, ha="center")
    axes[0].set_ylabel("||theta_r - mean over ranks||")
    top = top if top > 0 else 1.0  # W = 1: every distance is 0
    axes[0].set_ylim(-0.03 * top, 1.12 * top)
    handles, labels = axes[-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize="small", frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return plot.save(fig, args, "replica_drift")
