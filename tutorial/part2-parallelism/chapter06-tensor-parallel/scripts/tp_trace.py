"""One tensor-parallel training step of the tiny GPT under torch.profiler: where the time goes, compute and collectives.

What it shows
    The GPT is sharded over the W ranks (t = W, gloo on CPU). After one unprofiled warm-up step, one more forward
    and backward runs under torch.profiler on every rank, each layer wrapped in a named range (forward: when the
    module is called; backward: from the moment the gradient of its output arrives). Rank 0 writes the profile as
    a Chrome trace, tp_step.trace.json (open it in https://ui.perfetto.dev), and draws it as tp_trace.png: the
    forward and backward on one row, the layers on the next, and every gloo collective on the row of the gloo
    worker thread that ran it. Each collective sits inside the layer that issued it, and rank 0's training thread
    waits until it is done: tensor parallelism's communication is on the critical path.
    Before profiling, the sharded model's loss and every gradient are checked against the dense GPT.

How to run
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_trace.py
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_trace.py -w 4 --seq 128

Prints the collectives found in the trace by layer and direction, their total time against the step's, and where
the trace and the figure were written. Runtime on 2 cores: about 8 s; --smoke about 6 s.

Try next
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_trace.py --seq 128 --batch 8
        -> sixteen times the tokens, so the all-reduces carry sixteen times the bytes. This script prints only
           times; the same GPT at the same shape,
           python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_shards.py -w 2 --seq 128 --batch 8
           lists every collective's bytes: 16 times those of its default run. Compare the closing
           "forward + backward took ... ms; the collectives were busy ... ms" line with the default run's: how the
           step and the collectives' share change depends on the machine and its load, and single rows of the
           table may not move the same way as the total
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_trace.py -w 4
        -> four ranks on two cores: the collectives wait longer for the slowest rank
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_trace.py -w 1
        -> one rank: no collective at all. On an idle machine the same layers take a fraction of the 2-rank
           step's time. Under load they may take longer: the launcher gives each rank cores / W intra-op threads,
           so the lone rank runs 2 threads on 2 cores (each rank of -w 2 runs 1), and when other processes hold
           the cores those 2 threads wait for each other at every operator (OMP_NUM_THREADS=1 before the command
           gives the lone rank one thread)
"""

from __future__ import annotations

import contextlib
import typing
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.launch import RankContext, launch
from mlsys.model import GPT, GPTConfig
from mlsys.tensor_parallel import check_tp_run, grads_as_model, shard_gpt

COMM = {"gloo:all_reduce": "all-reduce", "gloo:all_gather": "all-gather", "gloo:reduce_scatter": "reduce-scatter"}


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    backend: typing.Literal["auto", "gloo", "nccl"] = "gloo"
    """gloo (auto means gloo here): the figure reads the events gloo's worker threads record."""
    n_layer: int = 2
    """Blocks in the GPT."""
    n_head: int = 4
    """Attention heads; must be divisible by the world size."""
    n_embd: int = 64
    """Model width C."""
    batch: int = 2
    """Sequences in the batch."""
    seq: int = 32
    """Tokens per sequence."""

    def validate(self) -> None:
        if self.backend == "nccl":
            raise cli.UsageError(f"--backend {self.backend}: this script profiles gloo's CPU threads; use gloo")
        try:
            check_tp_run(self.config(), self.world_size, [self.world_size], self.batch, self.seq)
        except ValueError as err:
            raise cli.UsageError(str(err)) from None

    def config(self) -> GPTConfig:
        return GPTConfig(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd, block_size=256)


# --8<-- [start:profile]
@contextlib.contextmanager
def named_layers(tp_model):
    """A profiler range per layer, "forward <layer>" from the call of its module to the call of the next one, and
    "backward <layer>" from the moment its output's gradient arrives to the moment the next layer's does. So the
    LayerNorm and residual after a layer count with it, and so does the embedding's all-reduce (TPGPT.embed runs
    it after the lookup). finish() closes the last range of a pass."""
    layers = [("embedding", tp_model.wte)] + [(f"block {i} {part}", getattr(b, part))
                                              for i, b in enumerate(tp_model.h) for part in ("attn", "mlp")]
    layers.append(("head", tp_model.lm_head))
    open_range, handles = [], []

    def finish():
        while open_range:
            open_range.pop().__exit__(None, None, None)

    def start(key):
        finish()
        open_range.append(torch.profiler.record_function(key))
        open_range[-1].__enter__()

    def on_output(name):
        def hook(module, inputs, out):  # returns None: a forward hook's return value would replace the output
            out.register_hook(lambda grad: start(f"backward {name}"))
        return hook

    for name, module in layers:
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: start(f"forward {name}")))
        handles.append(module.register_forward_hook(on_output(name)))
    try:
        yield finish
    finally:
        finish()
        for h in handles:
            h.remove()


def profile_step(tp_model, idx: torch.Tensor, targets: torch.Tensor, trace_path) -> None:
    """One warm-up step, then one profiled forward and backward; `trace_path` (rank 0 only) gets the trace."""
    tp_model(idx, targets)[1].backward()  # warm-up: first calls allocate and set up what later ones reuse
    tp_model.zero_grad(set_to_none=True)
    with plot.quiet_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dist.barrier()  # the ranks start the profiler at different moments: start the step together
        with named_layers(tp_model) as finish:
            with torch.profiler.record_function("forward"):
                _, loss = tp_model(idx, targets)
                finish()
            with torch.profiler.record_function("backward"):
                loss.backward()
                finish()
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
# --8<-- [end:profile]


def trace_picture(trace_path) -> list[plot.Span]:
    """The trace's spans to draw, in ms from the start of the forward: the step and the layers of rank 0's training
    thread, and every gloo collective on its worker thread's row, labelled with the layer whose range holds it."""
    def lane_of(e: dict) -> str | None:
        name = e.get("name", "")
        if name in ("forward", "backward"):
            return "step"
        if name.startswith(("forward ", "backward ")):
            return "layer"
        return f"gloo {e.get('tid')}" if name in COMM else None

    raw = plot.trace_spans(trace_path, lane_of=lane_of, kind_of=lambda e: COMM.get(e.get("name", ""), ""))
    t0 = min(s.start for s in raw if s.lane == "step")
    for s in raw:
        s.start, s.end = s.start - t0, s.end - t0
    layers = [s for s in raw if s.lane == "layer"]
    threads = sorted({s.lane for s in raw if s.lane.startswith("gloo")})
    spans = [plot.Span("step", s.start, s.end, s.label, s.label) for s in raw if s.lane == "step"]
    spans += [plot.Span("layers", s.start, s.end, s.label, s.label.split(" ")[0]) for s in layers]
    for s in sorted((s for s in raw if s.lane in threads), key=lambda s: s.start):
        mid = (s.start + s.end) / 2
        inside = [ly for ly in layers if ly.start <= mid <= ly.end]
        where = min(inside, key=lambda ly: ly.end - ly.start).label if inside else "(no layer)"
        spans.append(plot.Span(f"gloo thread {threads.index(s.lane) + 1}", s.start, s.end, where, s.kind))
    return spans


def draw(args: Settings, spans: list[plot.Span], world: int):
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(12, 3.4))
    lanes = ["step", "layers"] + sorted({s.lane for s in spans} - {"step", "layers"})

    def short(label: str) -> str:  # "backward block 1 attn" -> "attn 1": labels that fit in narrow boxes
        words = label.split()
        return f"{words[3]} {words[2]}" if len(words) == 4 else {"embedding": "emb."}.get(words[-1], words[-1])

    boxes = [plot.Span(s.lane, s.start, s.end, s.label if s.lane == "step" else "", s.kind) for s in spans]
    palette = plot.colours(["forward", "backward", *COMM.values()])
    plot.timeline(ax, boxes, lanes, unit="ms since the profiled forward started (rank 0)", palette=palette,
                  fontsize=7)
    y = len(lanes) - 1 - lanes.index("layers")
    end = max(s.end for s in spans)
    for s in spans:  # the layer names: across wide boxes, upright in narrow ones, beside the narrowest
        if s.lane == "layers":
            width = (s.end - s.start) / end
            if width >= 0.05:
                ax.text((s.start + s.end) / 2, y, short(s.label), ha="center", va="center", fontsize=8)
            elif width >= 0.012:
                ax.text((s.start + s.end) / 2, y, short(s.label), rotation=90, ha="center", va="center",
                        fontsize=8)
            else:
                ax.text(s.end + 0.003 * end, y, short(s.label), rotation=90, ha="left", va="center", fontsize=8)
    ax.set_xlim(0, 1.03 * end)  # room for a label beside the last, narrowest box
    ax.set_title(f"One tensor-parallel training step on rank 0 of {world}, from its torch.profiler trace")
    fig.tight_layout()
    return plot.save(fig, args, "tp_trace")


def summary(spans: list[plot.Span]) -> dict:
    step = [s for s in spans if s.lane == "step"]
    comm = [s for s in spans if s.kind in COMM.values()]
    total = max(s.end for s in step) - min(s.start for s in step)
    busy = sum(s.end - s.start for s in comm)
    return {"step_ms": total, "comm_ms": busy, "comm_share": busy / total if total else 0.0,
            "collectives": len(comm)}


def worker(ctx: RankContext, args: Settings) -> dict:
    torch.manual_seed(args.seed)
    cfg = args.config()
    model = GPT(cfg)  # the same on every rank: same seed
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(
        args.seed))
    tp_model = shard_gpt(model)
    loss = tp_model(idx[:, :-1], idx[:, 1:])[1]
    loss.backward()
    ref = model(idx[:, :-1], idx[:, 1:])[1]
    ref.backward()
    report.expect_close("loss", loss.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    want = dict(shard_gpt(grads_as_model(model), None).named_parameters())  # dense grads, sharded like weights
    for name, p in tp_model.named_parameters():
        report.expect_close(f"grad of {name}", p.grad, want[name], rtol=1e-4, atol=2e-5)
    ctx.print(f"t={ctx.world_size}: loss and all {len(want)} gradients of the sharded GPT equal the dense one's")

    trace_path = plot.figure_dir(args) / "tp_step.trace.json" if ctx.is_main else None
    profile_step(tp_model, idx[:, :-1], idx[:, 1:], trace_path)
    if not ctx.is_main:
        return {}
    spans = trace_picture(trace_path)
    rows: dict = {}
    for s in (s for s in spans if s.kind in COMM.values()):
        where = s.label.split(" ", 1) if s.label.startswith(("forward", "backward")) else ["-", s.label]
        key = (where[0], where[-1])
        rows.setdefault(key, {"direction": where[0], "layer": where[-1], "collectives": [], "ms": 0.0})
        rows[key]["collectives"].append(s.kind)
        rows[key]["ms"] += s.end - s.start
    table = [{**r, "collectives": ", ".join(r["collectives"])} for r in rows.values()]
    o = summary(spans)
    ctx.print(f"rank 0's trace: {o['collectives']} gloo collectives, by the layer range that holds each one:")
    ctx.print(report.table(table, ".2f"))
    ctx.print(f"forward + backward took {o['step_ms']:.1f} ms on rank 0; the collectives were busy "
              f"{o['comm_ms']:.1f} ms of it ({o['comm_share']:.0%})"
              + (", and the training thread waited for each" if o["collectives"] else ""))
    ctx.print(f"trace: {trace_path}")
    ctx.print(f"figure: {draw(args, spans, ctx.world_size)}")
    return {"trace": str(trace_path), "by_layer": table, **o, "spans": [vars(s) for s in spans]}


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"n_layer": 1, "seq": 8},
                     world_sizes=range(1, 9), world_sizes_text="1..8 (dividing --n-head and --n-embd)")
    result = launch(worker, args)
    if result is not None and args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
