"""Parallel-strategy calculator: memory per GPU and bytes per step of every (dp, tp, pp, ep) layout, and a pick.

What it shows
    For a published model shape (mlsys.kv_memory.MODEL_SHAPES, plus Mixtral-8x7B for expert parallelism) or one
    given by flags, and a cluster (GPUs, GPUs per node, memory per GPU, global batch, sequence length), every
    layout dp * tp * pp = GPUs (ep dividing dp and the number of experts) is costed with the formulas of
    mlsys.memory:
      memory per GPU  weights, gradients, optimizer state (ZeRO stage) on the heaviest pipeline
                      stage (its layers plus the embedding or the head), activations (Korthikanti et al., with the
                      1F1B in-flight count, plus the fp32 logits the cross-entropy keeps on the last stage; an
                      MoE layer's MLP part scaled by top-k x capacity factor, the token copies its experts keep);
      bytes per step  sent by one GPU for DP (gradient all-reduce; an expert's gradient only over the dp / ep
                      replicas of that expert), TP (4 all-reduces per layer and micro-batch),
                      PP (activations and gradients between stages) and EP (4 all-to-alls per MoE layer);
      step time       a rough model: 6 flops per weight and token (8 in recomputed layers), counted stage by stage
                      (the embedding is a lookup: no flops; the output head's V*h matmul on the last stage), at
                      --mfu of --peak-tflops; the pipeline is paced by its slowest stage (fill and drain, then one
                      slowest-stage time per micro-batch); plus each dimension's bytes over NVLink (group inside
                      one node) or the network (group spans nodes), with no overlap. The run prints these
                      assumptions.
    Layouts that do not fit in memory, or break a divisibility rule, are dropped with their reason counted. The
    recommendation is the fastest layout that fits, followed by why it beats the best layout that differs from
    it in each dimension. Everything is arithmetic: no GPU is needed, and none is used.

    FIGURES (with --plot-dir; _planner_figures.py draws them from the costed layouts, and the JSON keeps what
    they show under "picture")
      layouts.png  every costed layout, fastest on top: its step time as a stacked bar of the components above
                   (compute, bubble, imbalance, communication per dimension); layouts that do not fit hatched,
                   with their memory per GPU against the usable memory; the recommendation marked
      stages.png   the best-ranked layout with the most pipeline stages: each stage's time per micro-batch
                   (the last one also runs the output head) against the mean, and the ideal 1F1B timeline of
                   those stages for --timeline-m micro-batches (mlsys.pipeline.simulate), idle time in grey

How to run
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/parallel_planner.py
    ... --model llama-3-8b --gpus 8 --global-batch 64       # one node
    ... --model mixtral-8x7b --gpus 64                       # with expert parallelism
    ... --model custom --layers 48 --hidden 6144 --heads 48 --kv-heads 8 --ffn 16384 --vocab 50000
    ... --layout 8 8 1 1                                     # cost one layout (dp tp pp ep) and explain it

Runtime on 2 cores: about 2-3 s on an idle machine (about 10 s at load 6 to 9, other programs sharing the cores),
the same with --smoke: nearly all of it is Python importing torch (mlsys.kv_memory, where the model shapes live,
imports the book's GPT config); the arithmetic itself takes under 0.1 s. --plot-dir (the book passes it) adds 1-3 s
on an idle machine for importing matplotlib and drawing the two figures.

Try next
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/parallel_planner.py \\
        --model mistral-7b --gpus 8 --global-batch 64 --layout 8 1 1 1 --zero-stage 0
        -> --layout takes dp tp pp ep: plain data parallelism over 8 GPUs. With --zero-stage 0 every GPU holds all
           16 B/param of a 7B model and it does not fit in 80 GiB; the default ZeRO-1 (or 3) makes it fit
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/parallel_planner.py \\
        --model llama-3-8b --gpus 8 --global-batch 64
        -> one node: the ranking of every layout of 8 GPUs for an 8B model, and the pick
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/parallel_planner.py --gpus 7
        -> 7 GPUs leave no layout that satisfies the divisibility rules: a one-line error, nothing else, exit 2
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import _planner_figures as figures  # this script's two figures (_planner_figures.py)

from mlsys import cli, report
from mlsys import memory as mem
from mlsys.kv_memory import MODEL_SHAPES, ModelShape

GIB = 1024**3
MOE_SHAPES: dict[str, tuple[ModelShape, int, int]] = {  # name -> (shape, experts, experts per token)
    # 46,702,792,704 parameters: Llama-style layers whose MLP is 8 experts, 2 active per token
    "mixtral-8x7b": (ModelShape("mixtral-8x7b", 32, 4096, 32, 8, 128, 14336, 32000, 46_702_792_704,
                                "https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json"), 8, 2),
}
MODELS = sorted([*MODEL_SHAPES, *MOE_SHAPES, "custom"])


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    model: str = "llama-3-70b"
    """A published shape (llama-3-8b, llama-3-70b, mistral-7b, llama-2-7b, mixtral-8x7b, mlsys-small) or custom."""
    layers: int = 0
    """custom: number of layers."""
    hidden: int = 0
    """custom: hidden size."""
    heads: int = 0
    """custom: attention heads."""
    kv_heads: int = 0
    """custom: key/value heads (default: --heads)."""
    ffn: int = 0
    """custom: MLP intermediate size (gated, three matrices)."""
    vocab: int = 32000
    """custom: vocabulary size."""
    experts: int = 1
    """custom: experts per MoE layer (1: dense)."""
    top_k: int = 2
    """custom: experts per token when --experts > 1."""
    gpus: int = 64
    """GPUs in the job."""
    gpus_per_node: int = 8
    """GPUs per node: tensor parallelism stays inside a node."""
    gpu_mem_gib: float = 80.0
    """Memory per GPU in GiB."""
    reserve: float = 0.1
    """Fraction of each GPU's memory kept free (CUDA context, allocator fragmentation, temporary buffers)."""
    global_batch: int = 512
    """Sequences per optimizer step, over all data-parallel replicas."""
    micro_batch: int = 1
    """Sequences per micro-batch on one pipeline."""
    seq: int = 4096
    """Sequence length in tokens."""
    zero_stage: int = 1
    """ZeRO stage of the data-parallel dimension (0-3)."""
    recompute: str = "selective"
    """Activation recomputation: none, selective (attention scores) or full."""
    sequence_parallel: bool = True
    """Megatron sequence parallelism in the TP group (--no-sequence-parallel to turn off)."""
    capacity_factor: float = 1.25
    """MoE capacity factor (sizes the all-to-all)."""
    peak_tflops: float = 989.0
    """Dense bf16 peak per GPU in TFLOP/s (989: H100 SXM)."""
    mfu: float = 0.4
    """Fraction of peak the compute reaches."""
    intra_gbps: float = 450.0
    """GB/s one GPU sends inside a node (450: NVLink 4, one direction)."""
    inter_gbps: float = 50.0
    """GB/s one GPU sends across nodes (50: one 400 Gb/s NIC per GPU)."""
    layout: list[int] = field(default_factory=list)
    """Cost only this layout: four numbers dp tp pp ep."""
    top: int = 8
    """Candidate layouts to print."""
    timeline_m: int = 6
    """Micro-batches in the 1F1B timeline of stages.png (few, to stay readable; the step has more)."""

    def validate(self) -> None:
        if self.model not in MODELS:
            raise cli.UsageError(f"--model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.model == "custom":
            for name in ("layers", "hidden", "heads", "ffn", "vocab"):
                if getattr(self, name) < 1:
                    raise cli.UsageError(f"--model custom needs --{name} >= 1")
            if self.hidden % self.heads:
                raise cli.UsageError(f"--hidden {self.hidden} is not divisible by --heads {self.heads}")
            kv = self.kv_heads or self.heads
            if kv < 1 or self.heads % kv:
                raise cli.UsageError(f"--kv-heads must divide --heads, got {kv} and {self.heads}")
            if self.experts < 1 or not 1 <= self.top_k <= max(1, self.experts):
                raise cli.UsageError("--experts must be >= 1 and --top-k in 1..experts")
        for name in ("gpus", "gpus_per_node", "global_batch", "micro_batch", "seq", "top", "timeline_m"):
            if getattr(self, name) < 1:
                raise cli.UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("gpu_mem_gib", "capacity_factor", "peak_tflops", "intra_gbps", "inter_gbps"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise cli.UsageError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
        if not 0 <= self.reserve < 1 or not 0 < self.mfu <= 1:
            raise cli.UsageError("--reserve must be in [0, 1) and --mfu in (0, 1]")
        if self.zero_stage not in (0, 1, 2, 3):
            raise cli.UsageError(f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.recompute not in mem.RECOMPUTE:
            raise cli.UsageError(f"--recompute must be one of {', '.join(mem.RECOMPUTE)}, got {self.recompute!r}")
        if self.layout and (len(self.layout) != 4 or min(self.layout) < 1):
            raise cli.UsageError(f"--layout takes four numbers >= 1 (dp tp pp ep), got {self.layout}")


@dataclass(frozen=True)
class Model:
    shape: ModelShape
    experts: int
    top_k: int
    dense_params: int
    expert_params: int
    tied: bool  # the head shares the embedding matrix

    @property
    def active_params(self) -> float:
        """Parameters one token goes through: the dense part and k of the E experts."""
        return self.dense_params + self.expert_params * self.top_k / self.experts

    @property
    def layer_matmul_params(self) -> float:
        """Weights one token multiplies in one layer: attention, router and k of the E expert MLPs (no norms)."""
        s = self.shape
        outside = s.vocab_size * s.hidden_size * (1 if self.tied else 2) + s.hidden_size  # embedding, head, norm
        dense_layer = (self.dense_params - outside) / s.num_layers - 2 * s.hidden_size  # minus the two norms
        return dense_layer + self.expert_params / s.num_layers * self.top_k / self.experts


def load_model(args: Settings) -> Model:
    if args.model == "custom":
        kv = args.kv_heads or args.heads
        shape = ModelShape("custom", args.layers, args.hidden, args.heads, kv, args.hidden // args.heads, args.ffn,
                           args.vocab, 0, "command-line flags")
        experts, top_k = args.experts, args.top_k if args.experts > 1 else 1
    elif args.model in MOE_SHAPES:
        shape, experts, top_k = MOE_SHAPES[args.model]
    else:
        shape, experts, top_k = MODEL_SHAPES[args.model], 1, 1
    tied = shape.name.startswith("mlsys")  # the book's GPT ties its head to the embedding
    counts = mem.transformer_params(shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads,
                                    shape.head_dim, shape.intermediate_size, shape.vocab_size, experts,
                                    gated_mlp=not tied, tied_embeddings=tied)
    return Model(shape, experts, top_k, counts["dense"], counts["expert"], tied)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def inside_node(span: int, args: Settings) -> bool:
    """Do groups of `span` consecutive ranks stay inside nodes? (Whole job in one node, or span tiles a node.)"""
    return args.gpus <= args.gpus_per_node or (span <= args.gpus_per_node and args.gpus_per_node % span == 0)


def cost(model: Model, args: Settings, dp: int, tp: int, pp: int, ep: int) -> dict:
    """Memory per GPU, bytes per step and the step-time estimate of one layout (raises ValueError if invalid)."""
    s = model.shape
    if dp * tp * pp != args.gpus:
        raise ValueError(f"dp*tp*pp = {dp * tp * pp} != {args.gpus} GPUs")
    if not inside_node(tp, args) or s.num_heads % tp:
        raise ValueError("tp must divide the heads and its group must fit in one node")
    if s.num_layers % pp or dp % ep or model.experts % ep:
        raise ValueError("pp must divide the layers, ep must divide dp and the experts")
    if args.global_batch % (dp * args.micro_batch):
        raise ValueError("dp * micro_batch must divide the global batch")
    m = args.global_batch // (dp * args.micro_batch)  # micro-batches per pipeline per step
    b, L = args.micro_batch, s.num_layers

    # flops per micro-batch of each stage: 2 per weight and token forward, 4 backward (+2 when full recompute
    # re-runs a layer's forward); the embedding is a lookup (0 flops), the head a V x h matmul on the last stage
    tokens, per_weight = b * args.seq, 8.0 if args.recompute == "full" else 6.0
    stages = mem.stage_flops(per_weight * tokens * model.layer_matmul_params, L, pp,
                             head_flops=6.0 * tokens * s.vocab_size * s.hidden_size)
    shares = [f / sum(stages) for f in stages]
    slowest = max(range(pp), key=lambda i: (stages[i], i))
    on_stage = mem.worst_stage_dense_params(model.dense_params, L, pp, s.vocab_size, s.hidden_size, model.tied)
    state = mem.model_state_bytes_per_gpu(model.dense_params, model.expert_params, dp, tp, pp, ep, args.zero_stage,
                                          dense_on_stage=on_stage)
    per_layer = mem.activation_bytes_per_layer(args.seq, b, s.hidden_size, s.num_heads, tp, args.sequence_parallel,
                                               args.recompute,
                                               mlp_copies=model.top_k * args.capacity_factor if model.experts > 1
                                               else 1.0)
    logits = mem.logits_bytes(b, args.seq, s.vocab_size, tp)  # fp32 log-probabilities for the cross-entropy
    act = mem.pipeline_activation_peak(per_layer, L, pp, m, logits, "1f1b")
    dense_here, expert_here = on_stage / tp, model.expert_params / (tp * pp * ep)
    # dense gradients are reduced over all dp replicas, an expert's over the dp / ep ranks that hold that expert
    sent = {"dp": mem.dp_comm_bytes(2 * dense_here, dp, args.zero_stage, m)
            + mem.dp_comm_bytes(2 * expert_here, dp // ep, args.zero_stage, m),
            "tp": mem.tp_comm_bytes(b, args.seq, s.hidden_size, tp, L // pp, m, 2, args.sequence_parallel,
                                    args.recompute),
            "pp": mem.pp_comm_bytes(b, args.seq, s.hidden_size, pp, m, 2, tp, args.sequence_parallel),
            "ep": 0.0 if model.experts == 1 else mem.ep_comm_bytes(b, args.seq, s.hidden_size, model.top_k, ep,
                                                                    L // pp, m, args.capacity_factor)}
    # ranks are laid out pp-major, tp fastest: a group spans (its stride * its size) consecutive ranks
    span = {"tp": tp, "dp": tp * dp, "ep": tp * ep, "pp": tp * dp * pp}
    links = {k: (sent[k], 1e9 * (args.intra_gbps if inside_node(span[k], args) else args.inter_gbps))
             for k in sent}
    flops = sum(stages) * m * dp  # one step: m micro-batches on each of the dp pipelines
    time = mem.step_time_estimate(flops, args.gpus, args.peak_tflops * 1e12, args.mfu, pp, m, links, shares)
    total = state["total"] + act
    return {"dp": dp, "tp": tp, "pp": pp, "ep": ep, "micro": m, **{f"{k}_GiB": v / GIB for k, v in state.items()
            if k != "total"}, "act_GiB": act / GIB, "logits_GiB": logits / GIB, "total_GiB": total / GIB,
            "stage_flops": stages, "slowest_stage": slowest, "slowest_share": shares[slowest],
            **{f"{k}_GB_sent": v / 1e9 for k, v in sent.items()}, **{f"t_{k}": v for k, v in time.items()},
            "fits": total <= args.gpu_mem_gib * GIB * (1 - args.reserve),
            "inside_node": [k for k in ("tp", "dp", "pp", "ep") if inside_node(span[k], args)]}


def candidates(model: Model, args: Settings) -> tuple[list[dict], dict[str, int]]:
    """Every valid layout, costed; and how many were rejected for each reason."""
    rows, rejected = [], {"breaks a divisibility rule": 0, "does not fit in memory": 0}
    for tp in divisors(args.gpus):
        for pp in divisors(args.gpus // tp):
            dp = args.gpus // (tp * pp)
            for ep in divisors(dp):
                if ep > 1 and model.experts == 1:
                    continue
                try:
                    row = cost(model, args, dp, tp, pp, ep)
                except ValueError:
                    rejected["breaks a divisibility rule"] += 1
                    continue
                rows.append(row)
                rejected["does not fit in memory"] += not row["fits"]
    return sorted(rows, key=lambda r: (not r["fits"], r["t_total"])), rejected


def reasons(best: dict, rows: list[dict], args: Settings) -> list[str]:
    """Why `best` wins: against the best layout that differs from it in each dimension."""
    lines = []
    usable = args.gpu_mem_gib * (1 - args.reserve)
    alts: dict[str, list[str]] = {}  # one line per distinct alternative, naming every dimension it answers
    for dim in ("tp", "pp", "dp", "ep"):
        others = [r for r in rows if r[dim] != best[dim]]
        if others:
            alt = min(others, key=lambda r: (not r["fits"], r["t_total"]))
            alts.setdefault(f"dp={alt['dp']} tp={alt['tp']} pp={alt['pp']} ep={alt['ep']}", []).append(dim)
    for name, dims in alts.items():
        alt = next(r for r in rows if f"dp={r['dp']} tp={r['tp']} pp={r['pp']} ep={r['ep']}" == name)
        dim = " or ".join(dims)
        mine = ", ".join(f"{d}={best[d]}" for d in dims)
        if not alt["fits"]:
            lines.append(f"{mine}: every layout with another {dim} needs more memory; the closest, {name}, "
                         f"needs {alt['total_GiB']:.1f} GiB > {usable:.1f} GiB usable")
            continue
        diff = {k: alt[f"t_{k}"] - best[f"t_{k}"] for k in ("compute", "bubble", "imbalance", "tp", "dp", "pp", "ep")}
        worst = max(diff, key=diff.get)
        lines.append(f"{mine}: the best layout with another {dim}, {name}, takes {alt['t_total']:.2f} s "
                     f"vs {best['t_total']:.2f} s per step, mostly from {worst} time (+{diff[worst]:.2f} s)"
                     + (f"; it would also use {alt['total_GiB']:.1f} GiB vs {best['total_GiB']:.1f} GiB"
                        if abs(alt["total_GiB"] - best["total_GiB"]) > 0.05 else ""))
    return lines


def slowest_stage(row: dict, layers: int) -> str:
    """Which stage paces the pipeline, what it holds and its share of the flops against an even split."""
    p, i = row["pp"], row["slowest_stage"]
    if p == 1:
        return "one stage: no pipeline to pace"
    n = layers // p + (i < layers % p)
    held = f"{n} layers" + (" + the output head" if i == p - 1 else "") + (" + the embedding" if i == 0 else "")
    return (f"stage {i} of 0..{p - 1} ({held}) does {100 * row['slowest_share']:.2f} % of the flops vs "
            f"{100 / p:.2f} % if even; every stage waits for it, so each micro-batch takes "
            f"{row['slowest_share'] * p:.3f}x the even time")


def describe(row: dict, layers: int) -> str:
    return (f"dp={row['dp']} tp={row['tp']} pp={row['pp']} ep={row['ep']} ({row['micro']} micro-batches per step)\n"
            f"  memory per GPU: weights {row['params_GiB']:.2f} + grads {row['grads_GiB']:.2f} + optimizer "
            f"{row['optimizer_GiB']:.2f} + activations {row['act_GiB']:.2f} (logits {row['logits_GiB']:.2f} of it) "
            f"= {row['total_GiB']:.2f} GiB\n"
            f"  sent per GPU per step: DP {row['dp_GB_sent']:.2f} GB, TP {row['tp_GB_sent']:.2f} GB, "
            f"PP {row['pp_GB_sent']:.2f} GB, EP {row['ep_GB_sent']:.2f} GB "
            f"(inside a node: {', '.join(row['inside_node'])})\n"
            f"  slowest stage: {slowest_stage(row, layers)}\n"
            f"  step estimate: compute {row['t_compute']:.2f} s + bubble {row['t_bubble']:.2f} s + imbalance "
            f"{row['t_imbalance']:.2f} s + comm TP "
            f"{row['t_tp']:.2f} / DP {row['t_dp']:.2f} / PP {row['t_pp']:.2f} / EP {row['t_ep']:.2f} s = "
            f"{row['t_total']:.2f} s")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"top": 3})
    model = load_model(args)
    s = model.shape
    usable = args.gpu_mem_gib * (1 - args.reserve)
    if args.layout:  # validate before printing anything: a usage error is one line
        try:
            rows = [cost(model, args, *args.layout)]
        except ValueError as err:
            raise cli.UsageError(f"--layout {' '.join(map(str, args.layout))}: {err}") from None
        rejected: dict[str, int] = {}
    else:
        rows, rejected = candidates(model, args)
    if not rows:
        raise cli.UsageError("no layout satisfies the divisibility rules for these sizes")
    published = f", published {s.num_params / 1e9:.2f} B" if s.num_params else ""
    print(f"model {s.name}: {s.num_layers} layers, hidden {s.hidden_size}, {s.num_heads} heads ({s.num_kv_heads} KV), "
          f"MLP {s.intermediate_size}, vocab {s.vocab_size}" + (f", {model.experts} experts, top-{model.top_k}"
                                                                  if model.experts > 1 else ""))
    print(f"  parameters from the shape: {(model.dense_params + model.expert_params) / 1e9:.2f} B{published} "
          f"({model.active_params / 1e9:.2f} B active per token); source: {s.source}")
    floor = mem.zero_bytes_per_rank(model.dense_params + model.expert_params, 1, 0)["total"] / GIB
    print(f"cluster: {args.gpus} GPUs, {args.gpus_per_node} per node, {args.gpu_mem_gib:g} GiB each "
          f"({usable:.1f} GiB usable); batch {args.global_batch} x {args.seq} tokens, "
          f"micro-batch size {args.micro_batch}, "
          f"ZeRO-{args.zero_stage}, recompute {args.recompute}")
    print(f"  weights + grads + Adam state at 16 B/param: {floor:.1f} GiB = {floor / usable:.1f} GPUs' worth")
    print(f"step-time assumptions: {args.peak_tflops:g} TFLOP/s dense bf16 peak per GPU (989: H100 SXM) at "
          f"{args.mfu:g} of it (MFU); {args.intra_gbps:g} GB/s per GPU inside a node (450: NVLink 4), "
          f"{args.inter_gbps:g} GB/s across nodes (50: one 400 Gb/s NIC per GPU); no overlap of communication "
          "with compute")
    if model.experts > 1:
        print(f"  MoE activations: the MLP part counted {model.top_k} x {args.capacity_factor:g} times (top-k x "
              "capacity factor token copies in the experts)")
    print()

    shown = ("dp", "tp", "pp", "ep", "micro", "total_GiB", "act_GiB", "dp_GB_sent", "tp_GB_sent", "pp_GB_sent",
             "ep_GB_sent", "t_bubble", "t_imbalance", "t_total")
    table = [{("micro-batches" if k == "micro" else k): r[k] for k in shown} | {"fits": "yes" if r["fits"] else "no"}
             for r in rows[:args.top]]
    broken = rejected.get("breaks a divisibility rule", 0)
    fit = sum(bool(r["fits"]) for r in rows)  # counted from the rows: a --layout run has no rejection counts
    print((f"{len(rows) + broken} layouts tried, {broken} break a divisibility rule; " if broken else "")
          + f"{len(rows)} costed, {fit} fit{'s' if fit == 1 else ''} in memory"
          + (f"; the best {len(table)} shown:" if len(table) < len(rows) else ":"))
    print(report.table(table, floatfmt=".2f"))
    best = rows[0]
    print()
    if best["fits"]:  # with --layout there is one layout and nothing to recommend it over
        print(("the one layout given: " if args.layout else "recommended: ") + describe(best, s.num_layers))
        spare = usable - best["total_GiB"]
        print(f"  headroom: {spare:.2f} GiB of the {usable:.1f} GiB usable"
              + (" -- tight: a real run adds temporary buffers (all-gather staging, fragmentation) that the "
                 "formulas leave out; raise --reserve to demand more" if spare < 0.05 * usable else ""))
        for line in reasons(best, rows, args):
            print("  - " + line)
    elif args.layout:
        print(f"the one layout given does not fit in {usable:.1f} GiB per GPU. Try a higher --zero-stage, "
              "--recompute full, a smaller --micro-batch, or another layout.\nit: " + describe(best, s.num_layers))
    else:
        print(f"no layout fits in {usable:.1f} GiB per GPU; the smallest need is shown first. Try a higher "
              "--zero-stage, --recompute full, a smaller --micro-batch, or more GPUs.\nclosest: " +
              describe(min(rows, key=lambda r: r["total_GiB"]), s.num_layers))
    picture = {"usable_GiB": usable, "layouts": figures.layout_bars(rows, best if best["fits"] else None,
                                                                     model.experts)}
    piped = max(rows, key=lambda r: r["pp"])  # the best-ranked layout with the most stages
    if piped["pp"] > 1:
        picture["stages"] = figures.stage_picture(piped, args.peak_tflops * 1e12, args.mfu,
                                                  2 / (8 if args.recompute == "full" else 6), args.timeline_m,
                                                  model.experts)
    if args.plot_dir:  # matplotlib only when figures are asked for: the printed run stays quick
        print()
        title = f"Every layout of {s.name} on {args.gpus} GPUs, by estimated step time"
        print(f"figure: {figures.draw_layouts(picture['layouts'], usable, title, args)}")
        if "stages" in picture:
            print(f"figure: {figures.draw_stages(picture['stages'], args)}")
    if args.json:
        report.write_json(args.json, {"model": s.name, "params": model.dense_params + model.expert_params,
                                      "active_params": model.active_params,
                                      "recommended": best if best["fits"] else None,
                                      "candidates": rows, "rejected": rejected, "picture": picture},
                          args)  # all, best first
    return 0


if __name__ == "__main__":
    cli.run(main)
