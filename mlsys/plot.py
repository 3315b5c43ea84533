"""Figures: a headless matplotlib with the book's seaborn style, saved where the script's `--plot-dir` says.

Besides `pyplot`/`save`, three helpers the lessons' pictures share, so that every picture is drawn from a real
object (a schedule a script ran, a block table the engine built, a trace the profiler wrote), never by hand:

    timeline(ax, spans, lanes)        boxes on named lanes: a pipeline schedule, a profile, two ranks' calls
    animate(fig, draw, n, args, name) an animated GIF of n frames plus a static strip of the same frames (print)
    trace_spans(path)                 the events of a torch.profiler Chrome trace as spans for `timeline`
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend, with the book's theme applied."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")
    return plt


def figure_dir(args: Any) -> Path:
    """`args.plot_dir`, or `.cache/figures/<script name>` under the repository."""
    chosen = getattr(args, "plot_dir", "")
    path = Path(chosen) if chosen else REPO_ROOT / ".cache" / "figures" / Path(sys.argv[0]).stem
    path.mkdir(parents=True, exist_ok=True)
    return path


def save(fig: Any, args: Any, name: str) -> Path:
    """Save `fig` as `<figure_dir>/<name>.png`, close it, and return the path."""
    path = figure_dir(args) / f"{name}.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    pyplot().close(fig)
    return path


# ---- timelines ------------------------------------------------------------------------------------------------
@dataclass
class Span:
    """One box on a timeline: `lane` (a row name), [start, end) in any unit, a short label, and a kind that
    picks its colour (the same kind always gets the same colour, so a legend can name it)."""

    lane: str
    start: float
    end: float
    label: str = ""
    kind: str = ""


def colours(kinds: Iterable[str]) -> dict[str, Any]:
    """A fixed colour per kind, in first-seen order, from the book's colour-blind palette."""
    import seaborn as sns

    order = list(dict.fromkeys(kinds))
    palette = sns.color_palette("colorblind", max(10, len(order)))
    return {k: palette[i % len(palette)] for i, k in enumerate(order)}


def timeline(ax: Any, spans: Sequence[Span], lanes: Sequence[str] | None = None, *, unit: str = "",
             palette: dict[str, Any] | None = None, legend: bool = True, fontsize: float = 8) -> dict[str, Any]:
    """Draw `spans` as labelled boxes, one row per lane (the first lane on top). Returns the kind -> colour map.

    Labels are written inside a box when it is wide enough for them; the x axis is time in `unit`."""
    lanes = list(lanes) if lanes is not None else list(dict.fromkeys(s.lane for s in spans))
    row = {name: i for i, name in enumerate(lanes)}
    palette = palette or colours(s.kind for s in spans)
    span_x = max((s.end for s in spans), default=1.0) - min((s.start for s in spans), default=0.0) or 1.0
    for s in spans:
        y = len(lanes) - 1 - row[s.lane]
        ax.barh(y, s.end - s.start, left=s.start, height=0.8, color=palette.get(s.kind, "0.7"),
                edgecolor="black", linewidth=0.5)
        if s.label and (s.end - s.start) / span_x * 60 >= len(s.label) * fontsize / 8:
            ax.text((s.start + s.end) / 2, y, s.label, ha="center", va="center", fontsize=fontsize)
    ax.set_yticks(range(len(lanes)), list(reversed(lanes)))
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.grid(axis="y", visible=False)
    if unit:
        ax.set_xlabel(unit)
    if legend and any(palette.get(k) is not None for k in palette if k):
        from matplotlib.patches import Patch

        used = [k for k in palette if k and any(s.kind == k for s in spans)]
        ax.legend(handles=[Patch(facecolor=palette[k], edgecolor="black", label=k) for k in used],
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=fontsize, frameon=False)
    return palette


# ---- animations ---------------------------------------------------------------------------------------------
def animate(fig: Any, draw: Callable[[int], None], frames: int, args: Any, name: str, *, fps: float = 1.0,
            strip_columns: int = 4, dpi: int = 80) -> tuple[Path, Path]:
    """Write `<name>.gif` (an animation of `frames` frames; `draw(i)` redraws `fig` for frame i) and
    `<name>_strip.png` (the same frames side by side, `strip_columns` per row: the static version for print).

    matplotlib's animation module renders each frame once; the strip is assembled from those very images, so
    the strip and the animation cannot disagree. Returns their paths. Keep frames few and dpi low: every
    figure is drawn during the book build."""
    import numpy as np
    from matplotlib.animation import FuncAnimation, PillowWriter

    class KeepFrames(PillowWriter):   # PillowWriter keeps the rendered frames; hold on to them for the strip
        def finish(self):
            self.kept = list(self._frames)
            super().finish()

    plt = pyplot()
    out = figure_dir(args)
    gif, strip = out / f"{name}.gif", out / f"{name}_strip.png"
    if fig.get_layout_engine() is None:   # frames are rendered without bbox_inches="tight": keep legends inside
        fig.set_layout_engine("constrained")
    writer = KeepFrames(fps=fps)
    # init_func given, so frame 0 is not drawn an extra time before the frames are grabbed
    FuncAnimation(fig, lambda i: draw(i) or [], frames=frames, init_func=lambda: [], blit=False,
                  repeat=False).save(gif, writer=writer, dpi=dpi)
    plt.close(fig)
    images = [np.asarray(im.convert("RGB")) for im in writer.kept]
    cols = max(1, min(strip_columns, frames))
    rows = -(-len(images) // cols)
    h, w = images[0].shape[:2]
    sheet = np.full((rows * h, cols * w, 3), 255, dtype=np.uint8)
    for i, img in enumerate(images):
        r, c = divmod(i, cols)
        sheet[r * h:(r + 1) * h, c * w:(c + 1) * w] = img[:h, :w]
    from PIL import Image

    Image.fromarray(sheet).save(strip, optimize=True)
    return gif, strip


# ---- profiler traces ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def quiet_stderr():
    """torch's profiler backend writes 'USDT: profiler_start/stop' lines to the C stderr; keep them off the page
    (the scripts that write a Chrome trace profile inside this)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def trace_spans(path: str | Path, *, lane_of: Callable[[dict], str | None] | None = None,
                kind_of: Callable[[dict], str] | None = None) -> list[Span]:
    """Complete events ("ph": "X") of a Chrome trace written by `torch.profiler` (`export_chrome_trace`),
    as spans in milliseconds from the first event. `lane_of(event)` names its lane (None drops it; default: the
    event's thread); `kind_of(event)` its kind (default: its category)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        events = json.load(f)
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    t0 = min((float(e["ts"]) for e in complete), default=0.0)
    spans = []
    for e in complete:
        lane = lane_of(e) if lane_of else f"thread {e.get('tid')}"
        if lane is None:
            continue
        start = (float(e["ts"]) - t0) / 1000.0
        spans.append(Span(lane, start, start + float(e["dur"]) / 1000.0, str(e.get("name", "")),
                          kind_of(e) if kind_of else str(e.get("cat", ""))))
    return spans
