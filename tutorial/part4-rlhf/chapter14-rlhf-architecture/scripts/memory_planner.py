"""RLHF memory planner: the four models' memory in each phase, per GPU, co-located vs disaggregated, and a pick.

What it shows
    PPO-style RLHF keeps four models: the actor (trained), the critic (trained), the reward model and the reference
    (frozen). For published shapes (mlsys.kv_memory.MODEL_SHAPES: Llama-3-8B/70B, ... each with its config.json
    source) and one rollout workload, it prices every model in every phase with the book's formulas:
      weights, gradients, optimizer state  mlsys.memory.zero_bytes_per_rank (bf16 + fp32 Adam: 16 B per trained
                                           parameter; 2 B per frozen one), ZeRO-3-sharded over the GPUs that hold it
      KV cache (generation)                mlsys.kv_memory.kv_bytes_per_token: 2 * layers * kv_heads * head_dim *
                                           2 B, GQA's kv_heads, times sequences in flight times their full length
      activations (training)               mlsys.memory.activation_bytes_per_layer (Korthikanti et al.) * layers,
                                           plus the fp32 logits over the vocabulary for the actor
      forward working set (scoring)        the fp32 logits of one micro-batch (4*b*s*V B) plus one layer's
                                           activations at the selective count, 34*s*b*h B (no attention scores)
    Then it sizes two placements on --gpu:
      co-located    every GPU holds a ZeRO-3 shard of all four models and runs every phase in turn, with the
                    inference engine's bf16 actor during generation (the "hybrid engine" of verl): a whole copy on
                    each GPU, or split over engine_tp GPUs (tensor-parallel) when a whole one does not fit beside
                    the rest; the output's "engine TP" is the smallest that fits
      disaggregated trainer GPUs hold actor, critic, reward and reference (ZeRO-3 over them); rollout GPUs hold
                    only the bf16 actor (tensor-parallel when it does not fit on one GPU) and the KV cache
    and recommends the one that needs fewer GPUs. Under the co-located table, a line gives each smaller engine TP
    on the same GPUs, its peak as the sum of its parts and how far it overflows (unrounded: an overflow of a few MiB
    hides in the table's one-decimal columns); another line and a small table show why fewer GPUs do not fit:
    each count from the best smaller try up, its engine TP and its peak. Figures: roles.png (each model's own
    memory, unsharded) and memory_phases.png (per-GPU memory in each phase, co-located and disaggregated).

How to run
    python tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/memory_planner.py
    ... --actor llama-3-70b --critic llama-3-8b --gpu h100-80gb
    ... --rollout-batch 1024 --prompt-len 2048 --response-len 2048 --recompute selective

Runtime: under a second of arithmetic (about 2 s with the imports, several times that on a loaded machine);
the same with --smoke.

Try next
    python tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/memory_planner.py \\
        --rollout-batch 1024 --recompute selective
        -> four times the rollouts in flight and more activations kept: a bigger KV cache and training peak;
           the line under the co-located table says by how much each smaller engine TP overflows
    python tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/memory_planner.py \\
        --actor llama-3-70b --critic llama-3-8b
        -> the lesson's second run: a 70B actor with an 8B critic and reward model shifts where the memory goes
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlsys import cli, plot, report
from mlsys import kv_memory as kvm
from mlsys import memory as mem

GIB = kvm.GIB
PHASES = ("generation", "scoring", "training")
ROLES = ("actor", "critic", "reward", "reference")
TRAINED = {"actor": True, "critic": True, "reward": False, "reference": False}


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    actor: str = "llama-3-8b"
    """Shape of the actor and the reference (a name from mlsys.kv_memory.MODEL_SHAPES)."""
    critic: str = "llama-3-8b"
    """Shape of the critic and the reward model (their LM head replaced by a scalar head)."""
    gpu: str = "h100-80gb"
    """GPU preset: l4, rtx4090, a100-40gb, a100-80gb, h100-80gb, h200."""
    reserve_fraction: float = 0.1
    """Fraction of each GPU kept back for the CUDA context, allocator fragmentation and buffers."""
    rollout_batch: int = 256
    """Sequences generated per iteration, all in flight at once (one wave)."""
    prompt_len: int = 1024
    """Prompt tokens per sequence."""
    response_len: int = 1024
    """Generated tokens per sequence (the KV cache holds prompt + response)."""
    micro_batch: int = 2
    """Sequences per GPU per forward/backward in scoring and training."""
    recompute: str = "full"
    """Activation recomputation in training: none, selective or full (gradient checkpointing)."""

    def validate(self) -> None:
        for flag, name in (("--actor", self.actor), ("--critic", self.critic)):
            if name not in kvm.MODEL_SHAPES:
                raise cli.UsageError(f"{flag} must be one of {sorted(kvm.MODEL_SHAPES)}, got {name!r}")
        if self.gpu not in kvm.GPU_MEMORY_GIB:
            raise cli.UsageError(f"--gpu must be one of {sorted(kvm.GPU_MEMORY_GIB)}, got {self.gpu!r}")
        if not 0 <= self.reserve_fraction < 1:
            raise cli.UsageError(f"--reserve-fraction must be in [0, 1), got {self.reserve_fraction}")
        if min(self.rollout_batch, self.prompt_len, self.response_len, self.micro_batch) < 1:
            raise cli.UsageError("--rollout-batch, --prompt-len, --response-len and --micro-batch must be >= 1")
        if self.recompute not in mem.RECOMPUTE:
            raise cli.UsageError(f"--recompute must be one of {mem.RECOMPUTE}, got {self.recompute!r}")


# --8<-- [start:per_model]
def scalar_head_params(shape: kvm.ModelShape) -> int:
    """Critic / reward model: the LM trunk with its (vocab x hidden) head replaced by a (hidden -> 1) linear."""
    return shape.num_params - shape.vocab_size * shape.hidden_size + shape.hidden_size + 1


def state_bytes(num_params: int, trained: bool, shards: int) -> dict[str, float]:
    """Weights, gradients, optimizer state of one model on one of `shards` GPUs (ZeRO-3: all three sharded).

    Trained: bf16 weights + bf16 grads + fp32 master and Adam m, v = 2 + 2 + 12 B per parameter (mlsys.memory).
    Frozen (reward, reference): bf16 weights only, 2 B per parameter.
    """
    if trained:
        z = mem.zero_bytes_per_rank(num_params, shards, stage=3, precision="mixed")
        return {"weights": z["params"], "grads": z["grads"], "optimizer": z["optimizer"]}
    return {"weights": kvm.weight_bytes(num_params, "bf16") / shards, "grads": 0.0, "optimizer": 0.0}


def kv_cache_bytes(shape: kvm.ModelShape, num_seqs: float, seq_len: int, tp: int = 1) -> float:
    """K and V of num_seqs sequences of seq_len tokens (GQA: the shape's kv_heads), split over tp GPUs."""
    per_token = kvm.shape_kv_bytes_per_token(shape, "bf16")  # 2 * layers * kv_heads * head_dim * 2 B
    return per_token * num_seqs * seq_len / min(tp, shape.num_kv_heads)


def logits_bytes(micro_batch: int, seq_len: int, vocab: int) -> float:
    """fp32 logits of one micro-batch over the vocabulary (log-softmax for the log-probs): 4 B each."""
    return 4.0 * micro_batch * seq_len * vocab


def train_activation_bytes(shape: kvm.ModelShape, micro_batch: int, seq_len: int, recompute: str,
                           lm_head: bool) -> float:
    """Activations kept for backward: Korthikanti et al.'s per-layer bytes times layers (+ fp32 logits)."""
    per_layer = mem.activation_bytes_per_layer(seq_len, micro_batch, shape.hidden_size, shape.num_heads,
                                               recompute=recompute)
    head = logits_bytes(micro_batch, seq_len, shape.vocab_size) if lm_head else 0.0
    return per_layer * shape.num_layers + head


def forward_bytes(shape: kvm.ModelShape, micro_batch: int, seq_len: int, lm_head: bool) -> float:
    """No-grad forward (scoring): one layer's activations live at a time, plus the fp32 logits."""
    layer = mem.activation_bytes_per_layer(seq_len, micro_batch, shape.hidden_size, shape.num_heads,
                                           recompute="selective")
    return layer + (logits_bytes(micro_batch, seq_len, shape.vocab_size) if lm_head else 0.0)
# --8<-- [end:per_model]


def models_of(args: Settings) -> dict[str, tuple[kvm.ModelShape, int]]:
    """role -> (shape, parameter count)."""
    a, c = kvm.MODEL_SHAPES[args.actor], kvm.MODEL_SHAPES[args.critic]
    return {"actor": (a, a.num_params), "critic": (c, scalar_head_params(c)),
            "reward": (c, scalar_head_params(c)), "reference": (a, a.num_params)}


# --8<-- [start:colocated]
def colocated_phases(args: Settings, num_gpus: int, engine_tp: int = 1) -> dict[str, dict[str, float]]:
    """Per-GPU bytes by component in each phase when all four models share `num_gpus` GPUs (ZeRO-3 each).

    generation: every state stays resident (no offload) + the engine's bf16 actor, split over engine_tp GPUs
                (num_gpus / engine_tp engines, so engine_tp must divide num_gpus), + the KV cache of this GPU's
                share: each engine runs batch * engine_tp / num_gpus sequences at full length, its KV split over tp
    scoring:    resident + the largest no-grad forward (actor/reference logits dominate)
    training:   resident + the actor's or the critic's backward activations, whichever is larger
    """
    models, seq = models_of(args), args.prompt_len + args.response_len
    resident: dict[str, float] = {}
    for role, (shape, n) in models.items():  # noqa: B007
        for part, b in state_bytes(n, TRAINED[role], num_gpus).items():
            resident[part] = resident.get(part, 0.0) + b
    actor = models["actor"][0]
    gen = {**resident, "engine weights": kvm.weight_bytes(models["actor"][1], "bf16") / engine_tp,
           "KV cache": kv_cache_bytes(actor, args.rollout_batch * engine_tp / num_gpus, seq, engine_tp)}
    score = {**resident, "activations": max(forward_bytes(s, args.micro_batch, seq, role in ("actor", "reference"))
                                            for role, (s, _) in models.items())}
    train = {**resident, "activations": max(train_activation_bytes(s, args.micro_batch, seq, args.recompute,
                                                                   role == "actor")
                                            for role, (s, _) in models.items() if TRAINED[role])}
    return {"generation": gen, "scoring": score, "training": train}


def colocated_peak(args: Settings, num_gpus: int, budget: float) -> tuple[float, int]:
    """(per-GPU peak over the phases, engine tp): the smallest tp in 1, 2, 4, 8 that divides num_gpus (the GPUs form
    num_gpus / tp whole engines) and fits the budget (less tensor parallelism means less communication per
    generated token), else the lowest peak."""
    options = [(max(sum(v.values()) for v in colocated_phases(args, num_gpus, tp).values()), tp)
               for tp in (1, 2, 4, 8) if num_gpus % tp == 0]
    fitting = [(peak, tp) for peak, tp in options if peak <= budget]
    return fitting[0] if fitting else min(options)


# --8<-- [end:colocated]


# --8<-- [start:disaggregated]
def trainer_peak(args: Settings, num_gpus: int) -> float:
    """Per-GPU peak of the trainer pool: the co-located scoring/training phases without engine or KV cache."""
    phases = colocated_phases(args, num_gpus)
    return max(sum(phases[p].values()) for p in ("scoring", "training"))


def rollout_pool(args: Settings, budget: float) -> dict[str, float] | None:
    """The smallest rollout pool: for each tensor-parallel size tp in 1, 2, 4, 8, the bf16 actor split over tp
    GPUs and enough replicas that the whole batch's KV cache fits beside the weights; the tp needing the fewest
    GPUs wins (ties: the smaller tp). None if the weights do not fit even at tp = 8."""
    shape, n = models_of(args)["actor"]
    seq, best = args.prompt_len + args.response_len, None
    for tp in (1, 2, 4, 8):
        weights = kvm.weight_bytes(n, "bf16") / tp
        one_seq = kv_cache_bytes(shape, 1, seq, tp)
        if budget - weights < one_seq:
            continue
        replicas = math.ceil(args.rollout_batch / int((budget - weights) // one_seq))
        if best is None or tp * replicas < best["gpus"]:
            best = {"tp": tp, "replicas": replicas, "gpus": tp * replicas, "weights": weights,
                    "KV cache": kv_cache_bytes(shape, args.rollout_batch / replicas, seq, tp)}
    return best
# --8<-- [end:disaggregated]


def smallest_gpus(peak_of, budget: float, limit: int = 4096) -> int | None:
    """The smallest GPU count n with peak_of(n) <= budget (None beyond `limit`). Every count is a candidate, as for
    the rollout pool (tp x replicas): one grid for both placements, so neither wins by rounding. Bisection: the
    peak falls as n grows (every term is a share 1/n of a fixed total, or does not depend on n)."""
    if peak_of(limit) > budget:
        return None
    lo, hi = 0, limit  # peak_of(hi) fits; lo does not (0 GPUs never fit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if peak_of(mid) <= budget else (mid, hi)
    return hi


def below_reason(n_co: int, gpus: int, tp: int) -> str:
    """Why the best co-located try below n_co GPUs is on `gpus` GPUs with engine TP `tp`: the engine's TP must divide
    the GPU count, so the counts between may allow only smaller TPs (a larger engine share on every GPU)."""
    between = range(gpus + 1, n_co)
    if not between:
        return f"the count just below {n_co}"
    widest = max(t for n in between for t in (1, 2, 4, 8) if n % t == 0)
    if widest < tp:
        return (f"TP {tp} needs a multiple of {tp} GPUs, and {gpus} is the largest below {n_co}; {gpus + 1} to "
                f"{n_co - 1} allow at most TP {widest}, so each GPU holds at least {tp // widest}x the engine weights")
    return f"the count below {n_co} with the lowest peak"


def tp_overflow(args: Settings, num_gpus: int, tp: int, budget: float) -> dict:
    """A co-located try that does not fit: its peak phase, that phase's per-GPU parts and the excess, unrounded."""
    phases = colocated_phases(args, num_gpus, tp)
    phase = max(phases, key=lambda p: sum(phases[p].values()))
    peak = sum(phases[phase].values())
    return {"engine_tp": tp, "phase": phase, "parts_gib": {k: v / GIB for k, v in phases[phase].items() if v},
            "peak_gib": peak / GIB, "over_bytes": peak - budget, "over_mib": (peak - budget) / 2**20}


def tp_overflow_text(num_gpus: int, tried: list[dict], budget: float) -> str:
    """Why the smaller engine TPs at the chosen count were rejected, at enough precision to see it: each one's
    peak phase as the sum of its parts, and the excess over the usable memory (in MiB below 1 GiB)."""
    parts = []
    for t in tried:
        over = t["over_bytes"]
        excess = f"{over / GIB:.2f} GiB" if over >= GIB else f"{over / 2**20:.0f} MiB" if over >= 2**20 else \
            f"{over:,.0f} bytes"
        parts.append(f"  TP {t['engine_tp']}, {t['phase']}: "
                     f"{' + '.join(f'{v:.2f}' for v in t['parts_gib'].values())} = {t['peak_gib']:.3f} GiB, "
                     f"{excess} over")
    return (f"Smaller engine TPs on {num_gpus} GPUs overflow the {budget / GIB:.3f} GiB usable (peak phase, sum of "
            f"its columns):\n" + "\n".join(parts))


def near_shown(near: list[dict]) -> list[dict]:
    """The rows of the table under 'Fewer GPUs do not fit': the best try below, the count in between with the lowest
    peak (every other one peaks higher), and the chosen count."""
    between = near[1:-1]
    return near[:1] + ([min(between, key=lambda r: r["peak GiB"])] if between else []) + near[-1:]


def plan(args: Settings) -> dict:
    budget = kvm.GPU_MEMORY_GIB[args.gpu] * GIB * (1 - args.reserve_fraction)
    # co-located: not a bisection, since the peak is not monotone in n (the engine's tp must divide n: 5 GPUs allow
    # only tp 1, 8 allow 1, 2, 4, 8); every count in turn, up to the same limit
    co_peak = lambda n: colocated_peak(args, n, budget)[0]
    n_co = None if co_peak(4096) > budget else next(n for n in range(1, 4097) if co_peak(n) <= budget)
    n_tr = smallest_gpus(lambda n: trainer_peak(args, n), budget)
    pool = rollout_pool(args, budget)
    n_dis = None if n_tr is None or pool is None else n_tr + pool["gpus"]
    if n_co is None and n_dis is None:
        pick, why = "neither fits within 4096 GPUs", ""
    elif n_dis is None or (n_co is not None and n_co <= n_dis):
        pick = f"co-located on {n_co} GPUs"
        why = ("disaggregated does not fit" if n_dis is None else
               f"a tie with disaggregated's {n_tr} + {pool['gpus']} = {n_dis}: on equal GPU counts co-located wins, "
               "since no weights cross between processes" if n_co == n_dis else
               f"disaggregated needs {n_tr} + {pool['gpus']} = {n_dis}")
    else:
        pick = f"disaggregated: {n_tr} trainer + {pool['gpus']} rollout GPUs = {n_dis}"
        why = "co-located does not fit" if n_co is None else f"co-located needs {n_co}"
    # the best co-located try below n_co (lowest peak over the smaller counts): why fewer GPUs do not fit
    below = min(((*colocated_peak(args, n, budget), n) for n in range(1, n_co)), default=None) if n_co else None
    # every count from that try up to n_co: the engine TP each allows and its peak (the table under the line)
    near = [] if below is None else [
        {"GPUs": k, "engine TP": tp, "peak GiB": peak / GIB, "fits": "yes" if peak <= budget else "no"}
        for k in range(below[2], n_co + 1) for peak, tp in [colocated_peak(args, k, budget)]]
    tp_co = colocated_peak(args, n_co, budget)[1] if n_co else None
    # the TPs below the chosen one that divide n_co: each overflows (the chosen TP is the smallest that fits)
    tried = [tp_overflow(args, n_co, t, budget) for t in (1, 2, 4, 8) if n_co and t < tp_co and n_co % t == 0]
    return {"budget_bytes": budget, "colocated_gpus": n_co, "colocated_engine_tp": tp_co,
            "colocated_smaller_tps": tried,
            "colocated_best_below": None if below is None else
            {"gpus": below[2], "engine_tp": below[1], "peak_gib": below[0] / GIB,
             "reason": below_reason(n_co, below[2], below[1])},
            "colocated_near": near,
            "trainer_gpus": n_tr, "rollout": pool,
            "disaggregated_gpus": n_dis, "pick": pick, "pick_reason": why}


def model_rows(args: Settings) -> list[dict]:
    """Each model's full (unsharded) footprint, in GiB, for the table."""
    rows, seq = [], args.prompt_len + args.response_len
    for role, (shape, n) in models_of(args).items():
        s = state_bytes(n, TRAINED[role], 1)
        rows.append({"model": role, "shape": shape.name, "params (billions)": n / 1e9, "weights": s["weights"] / GIB,
                     "grads": s["grads"] / GIB, "optimizer": s["optimizer"] / GIB,
                     "train act.": train_activation_bytes(shape, args.micro_batch, seq, args.recompute,
                                                          role == "actor") / GIB if TRAINED[role] else 0.0})
    return rows


def role_bytes(args: Settings) -> dict[str, dict]:
    """What roles.png draws: each model's own memory, unsharded, in bytes, with its parameter count and shape."""
    seq = args.prompt_len + args.response_len
    out = {}
    for role, (shape, n) in models_of(args).items():
        out[role] = {"shape": shape.name, "params": n, **state_bytes(n, TRAINED[role], 1),
                     "activations": train_activation_bytes(shape, args.micro_batch, seq, args.recompute,
                                                           role == "actor") if TRAINED[role] else 0.0}
    return out


def draw_roles(roles: dict[str, dict], args: Settings) -> None:
    """One stacked bar per model: bf16 weights, bf16 gradients, fp32 master weights and Adam's two moments, and the
    activations one training micro-batch keeps for backward, each with its total."""
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.4))
    names = [f"{r}\n{v['shape']}, {v['params'] / 1e9:.2f}B params" for r, v in roles.items()]
    left = [0.0] * len(roles)
    labels = {"weights": "weights (bf16, 2 B/param)", "grads": "gradients (bf16, 2 B/param)",
              "optimizer": "fp32 master + Adam m, v (12 B/param)",
              "activations": f"training activations (micro-batch {args.micro_batch}, recompute {args.recompute})"}
    for i, (part, label) in enumerate(labels.items()):
        vals = [v[part] / GIB for v in roles.values()]
        ax.barh(names, vals, left=left, color=f"C{[0, 1, 2, 5][i]}", label=label)
        left = [a + b for a, b in zip(left, vals)]
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:.0f} GiB", va="center", fontsize=8)
    usable = kvm.GPU_MEMORY_GIB[args.gpu] * (1 - args.reserve_fraction)
    ax.axvline(usable, color="black", ls="--", lw=1, label=f"usable memory of one {args.gpu}")
    ax.invert_yaxis()
    ax.set(xlabel="GiB (one copy of the model, not sharded)", xlim=(0, max(*left, usable) * 1.15))
    ax.set_title("What each of the four models costs: trained ones carry gradients and optimizer state",
                 fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    print(f"figure: {plot.save(fig, args, 'roles')}")


PARTS = ["weights", "grads", "optimizer", "engine weights", "KV cache", "activations"]


def stacked(ax, bars: dict[str, dict[str, float]], budget: float, args: Settings) -> None:
    """One stacked bar per entry of `bars` (label -> component -> bytes), with the usable memory as a line."""
    labels, bottom = list(bars), [0.0] * len(bars)
    for i, part in enumerate(PARTS):
        vals = [bars[k].get(part, 0.0) / GIB for k in labels]
        ax.bar(labels, vals, bottom=bottom, label=part, color=f"C{i}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(budget / GIB, color="black", ls="--", lw=1, label=f"{args.gpu} usable")


def draw(result: dict, args: Settings) -> None:
    """Left: co-located, per phase. Right: disaggregated, the trainer pool's two phases and a rollout GPU."""
    plt = plot.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    n, budget = result["colocated_gpus"], result["budget_bytes"]
    if n is not None:
        stacked(left, colocated_phases(args, n, result["colocated_engine_tp"]), budget, args)
        left.set_title(f"co-located, {n} GPUs", fontsize=10)
    pool, n_tr = result["rollout"], result["trainer_gpus"]
    if pool is not None and n_tr is not None:
        trainer = colocated_phases(args, n_tr)
        bars = {"trainer\nscoring": trainer["scoring"], "trainer\ntraining": trainer["training"],
                "rollout\ngeneration": {"engine weights": pool["weights"], "KV cache": pool["KV cache"]}}
        stacked(right, bars, budget, args)
        right.set_title(f"disaggregated, {n_tr} trainer + {pool['gpus']} rollout GPUs", fontsize=10)
    left.set_ylabel("GiB per GPU")
    handles, labels = (left if n is not None else right).get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=7, fontsize=8, bbox_to_anchor=(0.5, -0.13))
    fig.suptitle(f"actor/reference {args.actor}, critic/reward {args.critic}", fontsize=11)
    print(f"figure: {plot.save(fig, args, 'memory_phases')}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={})
    seq = args.prompt_len + args.response_len
    actor = kvm.MODEL_SHAPES[args.actor]
    print(f"RLHF memory plan: actor/reference {args.actor}, critic/reward {args.critic}, {args.rollout_batch} "
          f"sequences of {args.prompt_len} + {args.response_len} tokens, micro-batch {args.micro_batch}, "
          f"recompute {args.recompute}, {args.gpu}\n")
    print("Each model unsharded (GiB):")
    print(report.table(model_rows(args), floatfmt=".1f"))
    roles = role_bytes(args)
    draw_roles(roles, args)
    kv_total = kv_cache_bytes(actor, args.rollout_batch, seq)
    print(f"\nKV cache of the whole rollout batch: {kvm.shape_kv_bytes_per_token(actor) / 1024:.0f} KiB/token "
          f"({actor.num_kv_heads} KV heads x {actor.head_dim} dims, for {actor.num_heads} query heads) "
          f"x {args.rollout_batch} x {seq} = {kv_total / GIB:.1f} GiB")
    result = plan(args)
    n = result["colocated_gpus"]
    if n is not None:
        phases = colocated_phases(args, n, result["colocated_engine_tp"])
        rows = [{"phase": p, **{k: v / GIB for k, v in phases[p].items()}, "total": sum(phases[p].values()) / GIB}
                for p in PHASES]
        print(f"\nCo-located, ZeRO-3 over {n} GPUs, engine TP {result['colocated_engine_tp']}, per GPU (GiB):")
        print(report.table([{k: r.get(k, 0.0) for k in ["phase", "weights", "grads", "optimizer", "engine weights",
                                                         "KV cache", "activations", "total"]} for r in rows],
                           floatfmt=".1f"))
        if result["colocated_smaller_tps"]:
            print(tp_overflow_text(n, result["colocated_smaller_tps"], result["budget_bytes"]))
        if result["colocated_best_below"] is not None:
            b = result["colocated_best_below"]
            print(f"Fewer GPUs do not fit: the lowest co-located peak below {n} GPUs is {b['peak_gib']:.1f} GiB per "
                  f"GPU, on {b['gpus']} GPUs with engine TP {b['engine_tp']} ({b['reason']}).")
            between = ", the count between with the lowest peak," if len(result["colocated_near"]) > 2 else ""
            print(f"That try{between} and the chosen count, each at its best engine TP:")
            print(report.table(near_shown(result["colocated_near"]), floatfmt=".1f"))
    pool = result["rollout"]
    if pool is not None and result["trainer_gpus"] is not None:
        print(f"\nDisaggregated: trainer pool {result['trainer_gpus']} GPUs (peak "
              f"{trainer_peak(args, result['trainer_gpus']) / GIB:.1f} GiB per GPU); rollout pool {pool['replicas']} "
              f"engine(s) x TP {pool['tp']} = {pool['gpus']} GPUs ({pool['weights'] / GIB:.1f} GiB weights + "
              f"{pool['KV cache'] / GIB:.1f} GiB KV per GPU)")
    reason = f" ({result['pick_reason']})" if result["pick_reason"] else ""
    print(f"\nUsable per GPU: {result['budget_bytes'] / GIB:.1f} GiB. Recommendation: {result['pick']}{reason}.")
    draw(result, args)
    if args.json:
        # GiB copies of the rollout sizing, for the lesson's arithmetic (each engine GPU: weights, the room left
        # beside them, and the KV cache each engine holds)
        pool_gib = None if pool is None else {
            "weights": pool["weights"] / GIB, "free": (result["budget_bytes"] - pool["weights"]) / GIB,
            "kv": pool["KV cache"] / GIB}
        # the actor's scoring working set, in its two terms (the lesson's formula): one layer and the fp32 logits
        logits = logits_bytes(args.micro_batch, seq, actor.vocab_size)
        score = forward_bytes(actor, args.micro_batch, seq, lm_head=True)
        scoring = {"layer": (score - logits) / GIB, "logits": logits / GIB, "total": score / GIB}
        report.write_json(args.json, {**result, "models": model_rows(args), "roles": roles, "kv_total_bytes": kv_total,
                                      "scoring_gib": scoring,
                                      "budget_gib": result["budget_bytes"] / GIB, "kv_total_gib": kv_total / GIB,
                                      "rollout_gib": pool_gib},
                          args)
    return 0


if __name__ == "__main__":
    cli.run(main)
