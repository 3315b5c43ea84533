"""CUDA graphs for the decode step: capture per batch size, pad, replay; or, on a CPU, what they would remove.

What it shows
    1. Padding: a batch of n sequences runs in the smallest captured size B >= n (vLLM's default sizes 1,
       2, 4, then multiples of 8 below 256 and of 16 from 256 on; this script's --sizes stop at 256), its extra
       rows writing into a scratch KV block. For several n (captured sizes and sizes in between) the
       static-buffer decode step's logits are compared with the eager ModelRunner's.
    2. Sampling inside a graph: uniform noise is drawn outside the graph into a static buffer (each row from
       its request's own generator) and turned into a sample with the Gumbel-max trick. Checked two ways:
       replay == the same function run eagerly on the same noise, and 20,000 draws match softmax(logits / T).
    FIGURE launches.png (into --plot-dir), drawn from a torch.profiler trace of one decode step run eagerly and
       one through the graph path, each the fastest of 5 tries (the trace itself: launches.trace.json): the ops
       called from Python, one box each, on the CPU lane; on a GPU also the CUDA launch calls and the kernels.
       On a CPU there is no graph, and the picture shows the static step running op by op like the eager one.
    FIGURE launch_order.png, on a GPU: the same step's launch calls and kernels in order, on a model time axis
       (a launch call 1 unit, a kernel 1/4): each eager kernel waits for its own call, a replay's run back to
       back. --launches-from draws it from a recorded GPU run's --json, on any machine.
    3. On a GPU: eager vs graph time of one decode step (host preparation + forward) for each captured
       batch size, and the engine with graphs generating exactly the eager engine's tokens.
       On a CPU there is no graph to capture; the script says so and measures the CPU analogue: the fixed
       cost of dispatching one op (a 1-element add; the median of 5 timings, with their range), the number of
       ops one decode forward calls from Python (profiler), and the share of the batch-1 forward that this per-op
       cost explains, which is the part a graph replay removes on a GPU.

How to run
    python tutorial/part3-inference/chapter10-scheduling-cuda-graphs/scripts/cuda_graphs.py
    python .../cuda_graphs.py --sizes 1 2 4 8 16 32 64 --iters 200     # on a GPU
    python .../cuda_graphs.py --launches-from \
        tutorial/part3-inference/chapter10-scheduling-cuda-graphs/results/h200/cuda_graphs.json

Runtime: about 8 s on 2 idle CPU cores (3 s with --smoke); on a busy machine (a printed load average above the
core count) up to about load average / cores times that. On a GPU it also captures and times a graph per size.

Try next
    python tutorial/part3-inference/chapter10-scheduling-cuda-graphs/scripts/cuda_graphs.py --sizes 1 3 8
        -> graphs of 1, 3 and 8: a batch of 2 pads to 3 and one of 7 pads to 8 (the rows checked: n = 1, 2, 3, 7,
           8); the padding check still holds
    python tutorial/part3-inference/chapter10-scheduling-cuda-graphs/scripts/cuda_graphs.py --temperature 0.5
        -> a sharper softmax: the 20,000 Gumbel-max draws still match softmax(logits / T)
    python tutorial/part3-inference/chapter10-scheduling-cuda-graphs/scripts/cuda_graphs.py --device cuda
        -> on a machine with a GPU: real capture and replay, and the eager-vs-graph timing table
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

# Before `import torch` loads OpenMP, which reads this once: with --threads > 1 OpenMP's idle threads spin
# between ops by default, and on 2 shared cores the spinning takes the core that the thread with work needs
# (the forward then runs many times slower). A user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F

from mlsys import bench, cli, plot, report
from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.engine.cuda_graphs import gumbel_sample, pick_graph_size
from mlsys.engine.step_profile import count_ops, decode_engine, decode_prompts, decode_step_inputs, time_tiny_op
from mlsys.weights import load_pretrained


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    """Batch sizes to capture a graph for."""
    prompt_len: int = 32
    """Prompt tokens of every decoding sequence."""
    iters: int = 50
    """Timed steps per batch size (the median is reported)."""
    temperature: float = 1.5
    """Temperature of the sampling check."""
    threads: int = 1
    """torch intra-op threads on a CPU."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu or cuda."""
    launches_from: str = ""
    """Only draw launch_order.png from the launch lists in a --json this script wrote on a GPU (e.g. the
    chapter's results/h200/cuda_graphs.json), then stop."""

    def validate(self) -> None:
        if not self.sizes or min(self.sizes) < 1 or max(self.sizes) > 256:
            raise cli.UsageError("--sizes must be in 1..256")
        if not 2 <= self.prompt_len <= 200 or not 1 <= self.iters <= 10_000:
            raise cli.UsageError("--prompt-len must be in 2..200 and --iters in 1..10000")
        if not self.temperature > 0 or self.threads < 1:
            raise cli.UsageError("--temperature must be > 0 and --threads >= 1")
        if self.device not in ("auto", "cpu", "cuda"):
            raise cli.UsageError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise cli.UsageError("--device cuda: no GPU on this machine")
        if self.launches_from:
            recorded_launches(self.launches_from)  # a UsageError when it holds no GPU run's launch lists


LAUNCH_LANES = ("CPU: CUDA launch calls", "GPU: kernels")


def recorded_launches(path: str) -> dict:
    """The launch lists ("eager" and "graph" steps) of a GPU run's --json, or a UsageError saying what is missing."""
    try:
        launches = json.loads(Path(path).read_text(encoding="utf-8"))["results"]["launches"]
        lists = {step: {lane: list(launches[step][lane]) for lane in LAUNCH_LANES} for step in ("eager", "graph")}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise cli.UsageError(f"--launches-from {path}: not a --json of a GPU run of this script ({exc!r})") from None
    if not all(lists[step][lane] for step in lists for lane in LAUNCH_LANES):
        raise cli.UsageError(f"--launches-from {path}: a launch list is empty (a CPU run records no launches)")
    return lists


def graph_engine(model, n: int, args: Settings, device: str) -> Engine:
    """n sequences past prefill in an engine whose runner is a CUDAGraphRunner over args.sizes."""
    return decode_engine(model, n, args.prompt_len, max_tokens=8, device=device, cuda_graph_sizes=args.sizes)


# --8<-- [start:padding]
def check_padding(model, args: Settings, device: str) -> list[dict]:
    """For n sequences: logits of the padded static (graph) step vs the eager runner's, same inputs."""
    rows = []
    for n in sorted({1, 3, max(args.sizes), *(s - 1 for s in args.sizes if s > 2)}):
        engine = graph_engine(model, n, args, device)
        g, inputs = engine.runner, decode_step_inputs(engine)  # g: CUDAGraphRunner, g.runner: the eager ModelRunner
        eager = g.runner.execute(g.runner.prepare(*inputs))  # (n, V)
        graph = g.execute(g.prepare(*inputs))  # padded to B and replayed (on a CPU: run uncaptured)
        report.expect_equal(f"n={n}: greedy tokens, graph vs eager", graph.argmax(-1), eager.argmax(-1))
        report.expect_close(f"n={n}: logits, graph vs eager", graph, eager, rtol=1e-4, atol=1e-4)
        rows.append({"n": n, "padded to": pick_graph_size(n, args.sizes),
                     "max |logit diff|": float((graph - eager).abs().max()), "graph steps": g.num_graph_steps})
    return rows
# --8<-- [end:padding]


# --8<-- [start:sampling]
def check_sampling(model, args: Settings, device: str, num_draws: int = 20_000) -> dict:
    """Gumbel-max sampling inside the step, noise drawn outside it from each request's own generator."""
    n = min(8, max(args.sizes))
    # prompts '{"name": ' : the prefill step samples the opening quote, so the decode step measured here
    # chooses the name's first letter, an uncertain choice (elsewhere the trained model is nearly sure)
    config = EngineConfig(max_num_seqs=n, max_model_len=64, device=device, cuda_graph_sizes=args.sizes)
    engine = Engine(model, config=config)
    for _ in range(n):
        engine.add_request('{"name": ', SamplingParams(max_tokens=8))
    engine.step()
    g, (starts, chunks, tables, _) = engine.runner, decode_step_inputs(engine)
    V = model.config.vocab_size
    gens = [torch.Generator().manual_seed(args.seed + i) for i in range(n)]  # one per request, on the CPU
    noise = torch.stack([torch.rand(V, generator=gen) for gen in gens])  # (n, V), outside the graph
    temps = [args.temperature] * n
    logits, ids = g.run([c[0] for c in chunks], starts, tables, temps, noise.to(g.device))
    again = gumbel_sample(logits.clone(), torch.tensor(temps, device=g.device)[:, None], noise.to(g.device))
    report.expect_equal("sampled ids: replay vs the same Gumbel-max eagerly", ids, again)
    # the distribution: many draws from the least certain row against softmax(logits / T)
    gen = torch.Generator().manual_seed(args.seed)
    probs = F.softmax(logits.float().cpu() / args.temperature, dim=-1)  # (n, V)
    row = int((-(probs * probs.clamp_min(1e-30).log()).sum(-1)).argmax())  # highest entropy
    z = logits[row : row + 1].float().cpu().expand(num_draws, V)  # (draws, V)
    draws = gumbel_sample(z, torch.full((num_draws, 1), args.temperature), torch.rand(num_draws, V, generator=gen))
    p = probs[row]
    freq = torch.bincount(draws, minlength=V).float() / num_draws
    ref = torch.bincount(torch.multinomial(p, num_draws, replacement=True, generator=gen), minlength=V) / num_draws
    tv, tv_ref = 0.5 * float((freq - p).abs().sum()), 0.5 * float((ref - p).abs().sum())
    if tv > 0.05:
        raise cli.SelfCheckFailed(f"Gumbel-max draws are {tv:.3f} (total variation) from softmax(logits / T)")
    return {"ids": ids.tolist(), "tv_gumbel": tv, "tv_multinomial": tv_ref, "draws": num_draws,
            "p_max": float(p.max()), "p_support": int((p > 1e-3).sum())}
# --8<-- [end:sampling]


def median_time(fn, iters: int, device: str) -> float:
    """Median seconds of fn() including a device synchronisation (the latency a caller sees)."""
    times = []
    with bench.steady_timing():  # no garbage-collector pass inside a timed call
        for i in range(iters + 3):
            t0 = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= 3:  # the first calls warm up
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --8<-- [start:speedup]
def graph_speedups(model, args: Settings) -> list[dict]:
    """GPU: eager vs graph, the whole step (host preparation + forward) and the forward alone."""
    rows = []
    for B in args.sizes:
        engine = graph_engine(model, B, args, "cuda")
        g, inputs = engine.runner, decode_step_inputs(engine)
        batch, gbatch = g.runner.prepare(*inputs), g.prepare(*inputs)  # repeated steps rewrite the same slots
        t = {"eager step": median_time(lambda: g.runner.execute(g.runner.prepare(*inputs)), args.iters, "cuda"),  # noqa: B023
             "graph step": median_time(lambda: g.execute(g.prepare(*inputs)), args.iters, "cuda"),  # noqa: B023
             "eager forward": median_time(lambda: g.runner.execute(batch), args.iters, "cuda"),  # noqa: B023
             "graph replay": median_time(lambda: g.replay(gbatch.buffers), args.iters, "cuda")}  # noqa: B023
        rows.append({"B": B, **{f"{k} ms": v * 1e3 for k, v in t.items()},
                     "step speed-up": t["eager step"] / t["graph step"],
                     "forward speed-up": t["eager forward"] / t["graph replay"]})
    return rows
# --8<-- [end:speedup]


TINY_TRIES = 5  # timings of the tiny op; the median is the per-op cost


# --8<-- [start:analogue]
def dispatch_overhead(model, args: Settings, device: str) -> dict:
    """The fixed cost per op, the ops of a batch-1 decode forward, and the share of it they explain:
    overhead share = (ops called from Python x seconds per tiny op) / forward seconds."""
    from torch.utils.flop_counter import FlopCounterMode

    tiny = sorted(time_tiny_op(device) for _ in range(TINY_TRIES))  # one timing can land on a burst of load
    per_op = statistics.median(tiny)
    engine = decode_engine(model, 1, args.prompt_len, max_tokens=4, device=device)
    runner, inputs = engine.runner, decode_step_inputs(engine)
    batch = runner.prepare(*inputs)
    forward = median_time(lambda: runner.execute(batch), args.iters, device)
    ops = count_ops(lambda: runner.execute(batch))
    with FlopCounterMode(display=False) as counter:
        runner.execute(batch)
    a = torch.randn(512, 512, device=device)
    matmul = median_time(lambda: a @ a, 20, device)
    return {"tiny_op_us": per_op * 1e6, "tiny_op_min_us": tiny[0] * 1e6, "tiny_op_max_us": tiny[-1] * 1e6,
            "forward_ms": forward * 1e3, "python_ops": ops["python_ops"],
            "aten_ops": ops["aten_ops"], "kernels": ops["kernels"],
            "overhead_ratio": ops["python_ops"] * per_op / forward,  # raw; above 1 when the timings disagree
            "overhead_share": min(1.0, ops["python_ops"] * per_op / forward),
            "forward_gflops": counter.get_total_flops() / forward / 1e9,
            "matmul_gflops": 2 * 512**3 / matmul / 1e9}
# --8<-- [end:analogue]


# --8<-- [start:trace]
def trace_launches(model, args: Settings, device: str, tries: int = 5) -> Path:
    """Profile one decode step of the same batch two ways, eager and the graph path (on a GPU one replay of
    the captured graph; on a CPU, where nothing can be captured, the same static-buffer step run op by op).
    Each path is profiled `tries` times on its own, and for each the try whose step spans the least time is kept
    (on a busy machine the others are the ones the OS interrupted). The two kept steps are written one after the
    other as the Chrome trace <plot_dir>/launches.trace.json (open it in ui.perfetto.dev). Returns its path."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # quiet: the profiler logs every start and stop otherwise
    engine = graph_engine(model, min(8, max(args.sizes)), args, device)
    g, inputs = engine.runner, decode_step_inputs(engine)
    batch, gbatch = g.runner.prepare(*inputs), g.prepare(*inputs)
    g.runner.execute(batch), g.replay(gbatch.buffers)  # warm-up
    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    events, offset = [], 0.0
    for name, step in (("eager step", lambda: g.runner.execute(batch)),
                       ("graph step", lambda: g.replay(gbatch.buffers))):
        best, best_us = None, float("inf")
        for _ in range(tries):
            with bench.steady_timing(), profile(activities=activities) as prof:
                with record_function(name):
                    step()
                    if cuda:
                        torch.cuda.synchronize()  # the step's kernels end inside its span
            us = sum(e.cpu_time_total for e in prof.events() if e.name == name)  # the step's span
            if us < best_us:
                best, best_us = prof, us
        with tempfile.TemporaryDirectory() as tmp:  # the kept try's events, shifted to follow the previous step
            best.export_chrome_trace(f"{tmp}/t.json")
            with open(f"{tmp}/t.json", encoding="utf-8") as f:
                trace = json.load(f)
        mine = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "ts" in e]
        t0 = min(float(e["ts"]) for e in mine)
        for e in mine:
            e["ts"] = float(e["ts"]) - t0 + offset
        offset = max(float(e["ts"]) + float(e.get("dur", 0)) for e in mine) + 50.0  # 50 us apart
        events += mine
    path = plot.figure_dir(args) / "launches.trace.json"
    path.write_text(json.dumps({"traceEvents": events}), encoding="utf-8")
    return path
# --8<-- [end:trace]


def launch_lanes(path: Path) -> dict[str, list[plot.Span]]:
    """The trace's events per step ("eager step", "graph step"), in ms from the step's start: the aten ops
    called from Python (top level: not inside another aten op), and on a GPU the CUDA launch calls and kernels."""
    def lane_of(e: dict) -> str | None:
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat == "user_annotation" and name in ("eager step", "graph step"):
            return "step"
        if cat == "cpu_op" and name.startswith("aten::"):
            return "CPU: ops called from Python"
        if cat == "cuda_runtime" and "Launch" in name:
            return "CPU: CUDA launch calls"
        if cat == "kernel":
            return "GPU: kernels"
        return None

    spans = plot.trace_spans(path, lane_of=lane_of, kind_of=lambda e: e.get("name", "").removeprefix("aten::"))
    steps = sorted((s for s in spans if s.lane == "step"), key=lambda s: s.start)
    out: dict[str, list[plot.Span]] = {}
    for k, step in enumerate(steps):
        end = steps[k + 1].start if k + 1 < len(steps) else float("inf")
        mine = sorted((s for s in spans if s.lane != "step" and step.start <= s.start < end), key=lambda s: s.start)
        top, reach = [], -1.0
        for s in mine:
            if s.lane == "CPU: ops called from Python":
                if s.start < reach:  # nested inside the previous top-level op: dispatched from C++
                    continue
                reach = s.end
            top.append(plot.Span(s.lane, s.start - step.start, s.end - step.start, "", s.kind))
        out[step.label] = top
    return out


KIND_ORDER = ("cudaGraphLaunch", "cudaLaunchKernel", "cudaLaunchKernelExC", "index_copy_", "kernel", "layer_norm",
              "linear", "other op", "scaled_dot_product_attention", "view")
VISIBLE = 0.003  # of the time axis: about 3 pixels of the saved figure, the least width whose fill can be seen


def draw_launches(lanes: dict[str, list[plot.Span]], args: Settings, device: str) -> dict:
    """Eager step above, graph path below, same time axis. Returns what was drawn: per step, the ops and
    launches per lane in order."""
    plt = plot.pyplot()
    from matplotlib.patches import Patch

    common = ("linear", "layer_norm", "scaled_dot_product_attention", "index_copy_", "view")
    kind = {s.kind: s.kind if s.kind in common else ("kernel" if s.lane.startswith("GPU") else "other op")
            for spans in lanes.values() for s in spans}
    kind |= {k: k for k in kind if "Launch" in k}  # every CUDA launch API its own entry: cudaGraphLaunch too
    # one fixed colour per kind, whatever the device: this order is the sorted set of the recorded H200 run's
    # kinds, so a CPU picture colours linear, layer_norm, ... as the recorded picture does; other launch APIs last
    palette = plot.colours(list(KIND_ORDER) + sorted(set(kind.values()) - set(KIND_ORDER)))
    names = ["CPU: ops called from Python"] + (["CPU: CUDA launch calls", "GPU: kernels"] if device == "cuda" else [])
    fig, axes = plt.subplots(len(lanes), 1, figsize=(11, 1.3 + 0.9 * len(names) * len(lanes)), sharex=True)
    drawn, named = {}, set()
    # an op kind whose every box is narrower than VISIBLE of the time axis shows no colour: the legend skips it
    # (the GPU lanes' launch calls and kernels are always named)
    thin = VISIBLE * max((s.end for spans in lanes.values() for s in spans), default=1.0)
    for ax, (step, spans) in zip(axes, lanes.items()):
        shown = [plot.Span(s.lane, s.start, s.end, "", kind[s.kind]) for s in spans]
        plot.timeline(ax, shown, names, palette=palette, legend=False)
        seen = {s.kind for s in shown if s.end - s.start >= thin or s.lane != names[0]}
        new = [k for k in palette if k not in named and k in seen]
        if new:  # each panel names the kinds no panel above it named (the replay's cudaGraphLaunch, on a GPU)
            ax.legend(handles=[Patch(facecolor=palette[k], edgecolor="black", label=k) for k in new],
                      loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
            named |= set(new)
        key = step.split()[0]  # "eager" or "graph"
        drawn[key] = {lane: [s.kind for s in spans if s.lane == lane] for lane in names}
        drawn[key] |= {"num_ops": len(drawn[key][names[0]]), "ms": max((s.end for s in spans), default=0.0)}
        n = drawn[key]["num_ops"]
        if key == "eager":
            title = f"eager decode step: {n} ops called from Python, each dispatched (and on a GPU launched) alone"
        elif device == "cuda":
            title = (f"graph replay: {len(drawn[key]['CPU: CUDA launch calls'])} launch call(s) for "
                     f"{len(drawn[key]['GPU: kernels'])} kernels")
        else:
            title = (f"static-buffer step, run uncaptured (no CUDA graph on a CPU): {n} ops called from Python "
                     "one by one")
        ax.set_title(title, fontsize=9)
    axes[-1].set_xlabel("ms from the start of the step (torch.profiler trace)")
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'launches')}")
    return drawn


KERNEL_UNITS = 0.25  # the picture's model: a launch call takes 1 unit of CPU time, a small decode kernel a quarter


def draw_launch_order(lists: dict, args: Settings) -> dict:
    """The launch lists of one eager step and one graph replay, drawn in order on a model time axis: every
    launch call 1 unit of CPU time, every kernel KERNEL_UNITS of GPU time, and a kernel starts once its launch
    call has returned and the kernel before it has finished. Eager, each kernel has its own launch call (the
    library may start a second kernel from one call: it follows the first); a replay has one call for them all."""
    plt = plot.pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(11, 3.6), sharex=True)
    palette = plot.colours(["kernel", *sorted({k for s in lists.values() for k in s[LAUNCH_LANES[0]]})])
    drawn = {}
    for ax, step in zip(axes, ("eager", "graph")):
        calls, kernels = lists[step][LAUNCH_LANES[0]], lists[step][LAUNCH_LANES[1]]
        spans = [plot.Span(LAUNCH_LANES[0], i, i + 1, "", name) for i, name in enumerate(calls)]
        gpu_free = 0.0
        for j in range(len(kernels)):
            launched = spans[min(j, len(calls) - 1)].end
            start = max(launched, gpu_free)
            gpu_free = start + KERNEL_UNITS
            spans.append(plot.Span(LAUNCH_LANES[1], start, gpu_free, "", "kernel"))
        plot.timeline(ax, spans, LAUNCH_LANES, palette=palette)
        drawn[step] = {"launch calls": len(calls), "kernels": len(kernels), "units": max(s.end for s in spans)}
        ax.set_title(f"eager step: {len(calls)} launch calls for {len(kernels)} kernels, each kernel waiting for its "
                     "call" if step == "eager" else
                     f"graph replay: {len(calls)} launch call ({', '.join(sorted(set(calls)))}), then "
                     f"{len(kernels)} kernels back to back", fontsize=9)
    axes[-1].set_xlabel(f"model time: a launch call = 1 unit, a kernel = {KERNEL_UNITS:g} unit (the counts are the "
                        "run's, the widths are not measured)")
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'launch_order')}")
    return drawn


def check_engine(model, args: Settings, device: str) -> dict:
    """The engine with graphs generates exactly the eager engine's greedy tokens."""
    prompts = decode_prompts(max(args.sizes), args.prompt_len, seed=args.seed + 1)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    out, secs = {}, {}
    for name, sizes in (("eager", None), ("graphs", args.sizes)):
        engine = Engine(model, config=EngineConfig(max_num_seqs=len(prompts), device=device, cuda_graph_sizes=sizes))
        engine.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        with bench.steady_timing():
            t0 = time.perf_counter()
            out[name] = [o.token_ids for o in engine.generate(prompts, params)]
            secs[name] = time.perf_counter() - t0
    report.expect_equal("engine tokens: graphs vs eager", out["graphs"], out["eager"])
    tokens = sum(len(t) for t in out["eager"])
    return {"tokens": tokens, "eager_tok_s": tokens / secs["eager"], "graphs_tok_s": tokens / secs["graphs"]}


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"sizes": [1, 2, 4], "iters": 5})
    if args.launches_from:
        results = {"launch_order": draw_launch_order(recorded_launches(args.launches_from), args),
                   "launches_from": args.launches_from}
        if args.json:
            report.write_json(args.json, results, args)
        return 0
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model = load_pretrained("small")
    results: dict = {"device": device, "sizes": args.sizes}
    if device == "cpu":
        print("No CUDA GPU here: CUDA graphs cannot be captured on this machine. The padded static-buffer step "
              "runs uncaptured, op by op: sections 1 and 2 check it, section 3 measures the CPU analogue of launch "
              "overhead, and the last line runs the engine with it.\n")
    else:
        print(f"GPU: {torch.cuda.get_device_name(0)}; graphs captured for batch sizes {args.sizes}\n")
    results["padding"] = check_padding(model, args, device)
    print("1. Padded static step vs eager runner (same sequences, same KV cache)")
    print(report.table(results["padding"], floatfmt=".2g"))
    results["sampling"] = s = check_sampling(model, args, device)
    print("\n2. Sampling in the step (Gumbel-max, noise from per-request generators): replay == eager on the same "
          f"noise.\n   {s['draws']} draws for one sequence (T={args.temperature:g}: {s['p_support']} tokens above "
          f"0.1%, the likeliest at {s['p_max']:.2f}) are {s['tv_gumbel']:.4f} from softmax(logits / T) in total "
          f"variation; torch.multinomial's draws: {s['tv_multinomial']:.4f}")
    if device == "cuda":
        results["speedups"] = graph_speedups(model, args)
        print("\n3. Eager vs CUDA graph, median of", args.iters, "steps (step = host preparation + forward)")
        print(report.table(results["speedups"], floatfmt=".3f"))
    results["dispatch"] = d = dispatch_overhead(model, args, device)
    print(f"\n{'4' if device == 'cuda' else '3'}. Dispatch overhead on {device}: one op on 1-element tensors "
          f"takes {d['tiny_op_us']:.1f} us (median of {TINY_TRIES} timings, {d['tiny_op_min_us']:.1f} to "
          f"{d['tiny_op_max_us']:.1f} us); a batch-1 decode forward makes {d['python_ops']} op calls from Python "
          f"({d['aten_ops']} aten ops in all) in {d['forward_ms']:.2f} ms: ops x per-op cost / forward = "
          f"{d['overhead_ratio']:.2f}, "
          + (f"so about {100 * d['overhead_share']:.0f}% of it is per-op fixed cost, the part a graph replay "
             + ("removes" if device == "cuda" else "would remove if this CPU had graphs")
             if d["overhead_ratio"] <= 1 else
             "above 1, so the share is capped at 100%: the tiny op and the forward were timed under different load,"
             " and the estimate is too rough to say more than that fixed cost is most of the forward")
          + f" ({bench.load_average()}: the ratio moves with the machine's load).\n"
          f"   That forward runs at {d['forward_gflops']:.2f} GFLOP/s; a 512x512 matmul here at "
          f"{d['matmul_gflops']:.1f} GFLOP/s.")
    d["load_average"] = bench.load_average()
    trace = trace_launches(model, args, device)
    print(f"   trace: {trace}")
    results["launches"] = draw_launches(launch_lanes(trace), args, device)
    if device == "cuda":
        results["launch_order"] = draw_launch_order({k: results["launches"][k] for k in ("eager", "graph")}, args)
    results["engine"] = e = check_engine(model, args, device)
    e["graphs_over_eager"] = e["graphs_tok_s"] / e["eager_tok_s"]
    r = e["graphs_over_eager"]
    e["direction_text"] = ("slower than" if r < 1 else "faster than" if r > 1 else "as fast as") + " the eager engine"
    results["load_average"] = bench.load_average()
    path = "graphs" if device == "cuda" else "static-buffer path"  # a CPU runs the graph's step uncaptured
    print(f"\nEngine with {path} == eager engine, token for token ({e['tokens']} tokens); "
          f"{path} {e['graphs_tok_s']:.0f} vs eager {e['eager_tok_s']:.0f} tokens/s ({e['graphs_over_eager']:.2f}x"
          f"{', no graph captured: a CPU has none' if device == 'cpu' else ''}); {results['load_average']}")
    if args.json:
        report.write_json(args.json, results, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
