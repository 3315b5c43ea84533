"""ddp_from_scratch.py's figures: the ideal-overlap model and the profiled step, drawn; and the interval arithmetic
both the drawing and the script's overlap numbers use. A file starting with _ is a helper, not a script."""

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
