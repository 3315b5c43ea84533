"""Memory and communication arithmetic for training layouts (chapters 5 and 7).

`zero_bytes_per_rank` is the per-parameter accounting of "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (Rajbhandari et al., https://arxiv.org/abs/1910.02054): with mixed precision and Adam each
parameter costs 2 B (bf16 weights) + 2 B (bf16 gradients) + 12 B (fp32 master copy, Adam m and v) = 16 B; stage 1
shards the optimizer state over the data-parallel ranks, stage 2 the gradients too, stage 3 the weights too.
"""

from __future__ import annotations

import math

# bytes per parameter: (params, grads, optimizer state)
PRECISIONS: dict[str, tuple[float, float, float]] = {
    "mixed": (2.0, 2.0, 12.0),  # bf16 weights + bf16 grads + fp32 master, Adam m, Adam v
    "fp32": (4.0, 4.0, 8.0),  # fp32 weights + fp32 grads + Adam m, Adam v (the weights are the master copy)
}


def zero_bytes_per_rank(num_params: int, world_size: int, stage: int, precision: str = "mixed") -> dict[str, float]:
    """Bytes one data-parallel rank holds for weights, gradients and optimizer state under ZeRO stage 0..3.

    Stage 0 replicates everything; stage >= 1 divides the optimizer state by `world_size`, stage >= 2 also the
    gradients, stage 3 also the weights. Returns {"params", "grads", "optimizer", "total"} in bytes.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params!r}")
    p_b, g_b, o_b = PRECISIONS[precision]
    params = num_params * p_b / (world_size if stage >= 3 else 1)
    grads = num_params * g_b / (world_size if stage >= 2 else 1)
    optimizer = num_params * o_b / (world_size if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


# ----------------------------------------------------------------------------------------------- the planner's formulas
# Chapter 7's parallel-strategy calculator (scripts/parallel_planner.py) is built from the functions below. Sizes are
# in bytes, 16-bit activations and gradients unless `dtype_bytes` says otherwise; "per GPU" means one rank of a
# (dp, tp, pp, ep) layout with world size dp * tp * pp and ep dividing dp.

RECOMPUTE = ("none", "selective", "full")


def _pos_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _pos(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def transformer_params(num_layers: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                       intermediate: int, vocab: int, num_experts: int = 1, gated_mlp: bool = True,
                       tied_embeddings: bool = False) -> dict[str, int]:
    """Parameter count of a Llama-style decoder (no biases, RMSNorm), split into dense and expert parameters.

    per layer: q and o (hidden x heads*head_dim each), k and v (hidden x kv_heads*head_dim each), an MLP of
    3 (gated: gate, up, down) or 2 matrices hidden x intermediate per expert, a router hidden x E when E > 1, and
    two norms of `hidden`. Plus the embedding, the output head (unless tied) and the final norm.
    Returns {"dense", "expert", "total"}; "expert" holds the MLPs when num_experts > 1 (else 0).
    """
    for name, v in (("num_layers", num_layers), ("hidden", hidden), ("num_heads", num_heads),
                    ("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("intermediate", intermediate),
                    ("vocab", vocab), ("num_experts", num_experts)):
        _pos_int(name, v)
    attn = 2 * hidden * num_heads * head_dim + 2 * hidden * num_kv_heads * head_dim
    mlp = (3 if gated_mlp else 2) * hidden * intermediate
    router = hidden * num_experts if num_experts > 1 else 0
    dense_layer = attn + router + 2 * hidden + (mlp if num_experts == 1 else 0)
    expert_layer = mlp * num_experts if num_experts > 1 else 0
    dense = num_layers * dense_layer + vocab * hidden * (1 if tied_embeddings else 2) + hidden
    expert = num_layers * expert_layer
    return {"dense": dense, "expert": expert, "total": dense + expert}


def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, num_heads: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none", dtype_bytes: float = 2,
                               dropout: bool = True, mlp_copies: float = 1.0) -> float:
    """Activation bytes one transformer layer keeps for backward, for one micro-batch.

    From "Reducing Activation Recomputation in Large Transformer Models" (Korthikanti et al.,
    https://arxiv.org/abs/2205.05198), Table 2, with s = seq, b = micro_batch, h = hidden, a = heads, t = tp, at
    the paper's defaults (16-bit activations, 1-byte dropout masks):
        none:       s*b*h * (10 + 24/t + 5*a*s/(h*t))     (sequence parallel: s*b*h/t * (34 + 5*a*s/h))
        selective:  s*b*h * (10 + 24/t)                   (sequence parallel: s*b*h/t * 34)  attention scores
                                                           are recomputed (or never stored, as with FlashAttention)
        full:       2*s*b*h                                only the layer's input is kept; everything is recomputed
    The same count, item by item, for other widths d = dtype_bytes and without dropout: kept whole on every rank,
    the two LayerNorm inputs and the inputs of the QKV and first MLP projections (4 sbh values) and the two dropout
    masks after attention and MLP (2 sbh bytes); split by t, q, k, v, the output projection's input, the MLP's
    hidden before and after GELU (12 sbh values); per head, the (s x s) softmax output (a s^2 b values), plus its
    dropout mask and dropped-out copy. The paper derives it for a GPT-3-shaped layer (MLP 4h, multi-head
    attention); for other shapes it is an estimate. chapter 5's recompute.py measures it on the book's GPT.
    Under sequence parallelism the kept layer input of full recomputation is sequence-sharded too: 2*s*b*h/t.
    `mlp_copies` scales the MLP's input and hidden activations (1 + 8 of the sbh values): an MoE layer with top-k
    routing and capacity factor c keeps k*c copies of each token there (the copies padded up to capacity).
    """
    s, b, h, a, t = (_pos_int(n, v) for n, v in (("seq", seq), ("micro_batch", micro_batch), ("hidden", hidden),
                                                  ("num_heads", num_heads), ("tp", tp)))
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    d, mask, copies = _pos("dtype_bytes", dtype_bytes), (1.0 if dropout else 0.0), _pos("mlp_copies", mlp_copies)
    sbh = s * b * h
    if recompute == "full":
        return d * sbh / (t if sequence_parallel else 1)
    # per s*b*h: 10 and 24 at the paper's d = 2 with dropout; the MLP's input (d, whole) and hidden (8d, split)
    whole, split = 3 * d + 2 * mask + d * copies, 4 * d + 8 * d * copies
    scores = (d + (mask + d) * dropout) * a * s / h if recompute == "none" else 0.0  # 5as/h at the paper's
    if sequence_parallel:
        return sbh / t * (whole + split + scores)
    return sbh * (whole + split / t + scores / t)


def in_flight_micro_batches(pp: int, num_micro: int, schedule: str = "1f1b") -> int:
    """Micro-batches whose activations the FIRST pipeline stage (the worst one) holds at once.

    GPipe runs all m forwards before any backward: m. 1F1B starts backwards after p forwards: min(p, m).
    """
    _pos_int("pp", pp)
    _pos_int("num_micro", num_micro)
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")
    return num_micro if schedule == "gpipe" else min(pp, num_micro)


def activation_bytes_per_gpu(per_layer: float, num_layers: int, pp: int, num_micro: int,
                             schedule: str = "1f1b") -> float:
    """Layers on a stage (ceil(L/p)) times in-flight micro-batches times bytes per layer per micro-batch.

    With 1F1B and m >= p the first stage holds p micro-batches of L/p layers: L layers' worth, whatever p is
    (Korthikanti et al., section 4.2.3).
    """
    _pos_int("num_layers", num_layers)
    return per_layer * math.ceil(num_layers / pp) * in_flight_micro_batches(pp, num_micro, schedule)


def logits_bytes(micro_batch: int, seq: int, vocab: int, tp: int = 1, dtype_bytes: float = 4) -> float:
    """Bytes the output layer keeps for the cross-entropy backward, for one micro-batch: the (b, s, V) logits
    turned into fp32 log-probabilities (the softmax's output is what its backward needs), split over the vocabulary
    by tensor parallelism (vocab-parallel cross-entropy). Korthikanti et al.'s per-layer count leaves it out; at a
    128k vocabulary it is 4 * s * V = 2 GiB per 4096-token sequence, more than a few layers' worth.
    """
    for name, v in (("micro_batch", micro_batch), ("seq", seq), ("vocab", vocab), ("tp", tp)):
        _pos_int(name, v)
    return micro_batch * seq * vocab / tp * _pos("dtype_bytes", dtype_bytes)


def pipeline_activation_peak(per_layer: float, num_layers: int, pp: int, num_micro: int, logits: float = 0.0,
                             schedule: str = "1f1b") -> float:
    """Activation bytes on the most loaded pipeline stage, the output layer's logits included.

    The first stage holds the most micro-batches (min(p, m) with 1F1B); the last holds one (it runs each backward
    as soon as its forward ends) but also keeps that micro-batch's logits. With p = 1 both are the same stage.
    GPipe keeps all m micro-batches everywhere.
    """
    layers = math.ceil(_pos_int("num_layers", num_layers) / _pos_int("pp", pp))
    first = per_layer * layers * in_flight_micro_batches(pp, num_micro, schedule)
    last_in_flight = num_micro if schedule == "gpipe" else 1
    last = (per_layer * layers + logits) * last_in_flight
    return first + logits * last_in_flight if pp == 1 else max(first, last)


def kv_cache_bytes_per_gpu(bytes_per_token: float, batch: int, seq: int, tp: int, pp: int, num_kv_heads: int) -> float:
    """K and V of `batch` sequences of `seq` tokens when serving with this layout.

    Layers are split over pp; KV heads over tp, but only as far as there are heads: with tp > num_kv_heads the
    heads are replicated, so the divisor is min(tp, num_kv_heads).
    """
    _pos("bytes_per_token", bytes_per_token)
    for name, v in (("batch", batch), ("seq", seq), ("tp", tp), ("pp", pp), ("num_kv_heads", num_kv_heads)):
        _pos_int(name, v)
    return bytes_per_token * batch * seq / (min(tp, num_kv_heads) * pp)


def worst_stage_dense_params(dense_params: float, num_layers: int, pp: int, vocab: int, hidden: int,
                             tied_embeddings: bool = False) -> float:
    """Dense parameters on the heaviest pipeline stage. Layers are spread as evenly as possible (the first L % p
    stages take one more, as mlsys.pipeline.split_gpt does); the first stage adds the embedding, the last the
    output head and the final norm. A tied head still needs its own copy on the last stage when p > 1, so either
    end holds V*h besides its layers. With p = 1 the one stage holds everything.
    """
    layers, p = _pos_int("num_layers", num_layers), _pos_int("pp", pp)
    if p == 1:
        return dense_params
    outside = vocab * hidden * (1 if tied_embeddings else 2) + hidden  # embedding, head unless tied, final norm
    per_layer = (dense_params - outside) / layers
    sizes = [layers // p + (s < layers % p) for s in range(p)]  # the first L % p stages take one more layer
    stages = [n * per_layer for n in sizes]
    stages[0] += vocab * hidden  # the embedding
    stages[-1] += vocab * hidden + hidden  # the output head (a tied one needs its own copy here) and the final norm
    return max(stages)


def model_state_bytes_per_gpu(dense_params: int, expert_params: int, dp: int, tp: int, pp: int, ep: int,
                              zero_stage: int, precision: str = "mixed",
                              dense_on_stage: float | None = None) -> dict[str, float]:
    """Weights, gradients and optimizer state on one GPU.

    Dense parameters are split over tp * pp and ZeRO-sharded over the dp data-parallel replicas. Expert
    parameters are split over tp * pp * ep (each ep rank owns E/ep experts) and ZeRO-sharded over the dp/ep
    replicas of each expert. The dense parameters are assumed to spread evenly over the pipeline stages unless
    `dense_on_stage` gives the count on the stage of interest (see worst_stage_dense_params).
    """
    for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("ep", ep)):
        _pos_int(name, v)
    if dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp} (expert-parallel groups are carved out of data parallelism)")
    if dense_params < 0 or expert_params < 0:
        raise ValueError("parameter counts must be >= 0")
    stage = dense_params / pp if dense_on_stage is None else dense_on_stage
    dense = zero_bytes_per_rank(stage / tp, dp, zero_stage, precision)  # type: ignore[arg-type]
    expert = zero_bytes_per_rank(expert_params / (tp * pp * ep), dp // ep, zero_stage, precision)  # type: ignore[arg-type]
    return {k: dense[k] + expert[k] for k in dense}


def ring_factor(n: int) -> float:
    """(n - 1) / n: the fraction of a buffer each rank sends per ring pass (reduce-scatter or all-gather)."""
    return (_pos_int("group size", n) - 1) / n


def dp_comm_bytes(param_bytes_per_gpu: float, dp: int, zero_stage: int, num_micro: int = 1) -> float:
    """Bytes one GPU sends per step for data parallelism (ring algorithms), with `num_micro` (m) micro-batches
    accumulated per step. G = bytes of this GPU's gradient before sharding, r = (d-1)/d.

    Stages 0-1: the full gradient accumulates over the m micro-batches, then one all-reduce (stage 1: reduce-scatter
    + all-gather of the updated weights, the same bytes): 2 r G per step, whatever m.
    Stage 2: a rank keeps only its gradient shard, so each micro-batch's gradient is reduce-scattered as it is
    produced (m r G), and the updated weights are all-gathered once (r G): (m + 1) r G.
    Stage 3: each micro-batch all-gathers the weights for its forward and again for its backward, and
    reduce-scatters its gradient: 3 m r G. (ZeRO paper, https://arxiv.org/abs/1910.02054, section 7, for m = 1;
    with m micro-batches, as in a pipeline, the per-micro-batch terms repeat, which is why DeepSpeed refuses
    ZeRO-2/3 with pipeline parallelism.)
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0..3, got {zero_stage!r}")
    m = _pos_int("num_micro", num_micro)
    passes = {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[zero_stage]
    return passes * ring_factor(dp) * param_bytes_per_gpu


def tp_comm_bytes(micro_batch: int, seq: int, hidden: int, tp: int, layers_per_stage: int, num_micro: int,
                  dtype_bytes: float = 2, sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Bytes one GPU sends per step for tensor parallelism (Megatron, ring collectives).

    Each layer all-reduces a (b, s, h) activation twice in the forward (after attention and after the MLP) and
    twice in the backward: 4 all-reduces of b*s*h*bytes, each sending 2(t-1)/t of it. Sequence parallelism
    splits each all-reduce into an all-gather + reduce-scatter of the same volume, but the backward also
    re-gathers the sequence-sharded layer inputs it did not keep: 3 all-reduce volumes in the backward instead of
    2, 1.25x per step (what chapter 6's sequence_parallel.py measures). Full recomputation re-runs the forward
    inside the backward, with its 2 all-reduces per layer: 6 instead of 4.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    volumes = 2 + (3 if sequence_parallel else 2) + (2 if recompute == "full" else 0)
    return (volumes * 2 * ring_factor(tp) * micro_batch * seq * hidden * dtype_bytes
            * _pos_int("layers_per_stage", layers_per_stage) * _pos_int("num_micro", num_micro))


def pp_comm_bytes(micro_batch: int, seq: int, hidden: int, pp: int, num_micro: int, dtype_bytes: float = 2,
                  tp: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes an interior pipeline stage sends per step: one activation forward and one gradient backward per
    micro-batch, b*s*h*bytes each (0 without pipelining). Without sequence parallelism every tensor-parallel rank
    holds and sends the full copy; with it each holds a 1/t slice of the sequence and sends only that (Megatron's
    scatter-gather: the receiving stage all-gathers over its fast TP links when it needs the whole)."""
    share = _pos_int("tp", tp) if sequence_parallel else 1
    return 0.0 if _pos_int("pp", pp) == 1 else 2.0 * micro_batch * seq * hidden * dtype_bytes * num_micro / share


def ep_comm_bytes(micro_batch: int, seq: int, hidden: int, top_k: int, ep: int, moe_layers_per_stage: int,
                  num_micro: int, capacity_factor: float = 1.0, dtype_bytes: float = 2) -> float:
    """Bytes one GPU sends per step for expert parallelism: per MoE layer and micro-batch, dispatch and combine
    in the forward and both again in the backward: 4 all-to-alls of the b*s*k*capacity_factor routed token
    copies, of which the fraction (ep-1)/ep leaves the GPU under uniform routing."""
    _pos("capacity_factor", capacity_factor)
    return (4 * ring_factor(ep) * micro_batch * seq * _pos_int("top_k", top_k) * capacity_factor * hidden
            * dtype_bytes * moe_layers_per_stage * num_micro)


def train_flops(active_params: float, tokens: float, recompute: str = "none") -> float:
    """6 * N * D: forward (2 N D) plus backward (4 N D) multiply-adds counted as 2 flops ("Scaling Laws for Neural
    Language Models", https://arxiv.org/abs/2001.08361). Attention's own s^2 term is left out. Full recomputation
    runs the forward twice: 8 N D, a third more. (Selective recomputation redoes only the attention scores, which
    this count leaves out anyway.)"""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    return (8.0 if recompute == "full" else 6.0) * _pos("active_params", active_params) * _pos("tokens", tokens)


def stage_flops(layer_flops: float, num_layers: int, pp: int, head_flops: float = 0.0,
                embed_flops: float = 0.0) -> list[float]:
    """Flops of each pipeline stage: layers spread as evenly as possible (the first L % p stages take one more, as
    mlsys.pipeline.split_gpt and worst_stage_dense_params split them), the embedding's on the first stage, the
    output head's (and final norm's) on the last. With p = 1 the one stage does everything."""
    layers, p = _pos_int("num_layers", num_layers), _pos_int("pp", pp)
    if p > layers:
        raise ValueError(f"pp={p} stages need at least as many layers, got {layers}")
    out = [layer_flops * (layers // p + (i < layers % p)) for i in range(p)]
    out[0] += embed_flops
    out[-1] += head_flops
    return out


def step_time_estimate(flops: float, num_gpus: int, peak_flops: float, mfu: float, pp: int, num_micro: int,
                       comm: dict[str, tuple[float, float]],
                       stage_shares: list[float] | None = None) -> dict[str, float]:
    """A rough step time: compute at `mfu` of peak, paced by the pipeline's slowest stage, plus communication.

    `stage_shares` are the stages' shares of the flops (default: equal). With m micro-batches, a stage that does
    the share f_i takes t_i = compute * p * f_i / m per micro-batch, and 1F1B with its slowest stage last (or every
    stage equal) ends after
        sum_i t_i + (m - 1) * max_i t_i
    (the first micro-batch crosses every stage, the other m - 1 follow one slowest-stage time apart; with equal
    stages this is (m + p - 1) t). Written as three terms:
        compute   = flops / (num_gpus * peak_flops * mfu)          m * mean t: all stages busy, none waiting
        bubble    = (p - 1) * mean t                               fill and drain
        imbalance = (m - 1) * (max t - mean t)                     the other stages wait for the slowest
    For other stage orders the sum is an upper bound. comm = sum of bytes / bandwidth over the parallel dimensions,
    with no overlap (a pessimistic bound); `comm` maps a dimension name to (bytes sent per GPU, bytes per second of
    the link it uses).
    """
    _pos_int("num_gpus", num_gpus)
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
    p, m = _pos_int("pp", pp), _pos_int("num_micro", num_micro)
    shares = [1.0 / p] * p if stage_shares is None else [_pos("stage share", f) for f in stage_shares]
    if len(shares) != p or abs(sum(shares) - 1) > 1e-9:
        raise ValueError(f"stage_shares must be {p} positive numbers adding up to 1, got {stage_shares!r}")
    # --8<-- [start:step_time]
    compute = flops / (num_gpus * _pos("peak_flops", peak_flops) * mfu)
    mean, slowest = compute / m, compute * p * max(shares) / m  # per micro-batch
    out = {"compute": compute, "bubble": (p - 1) * mean, "imbalance": (m - 1) * max(0.0, slowest - mean)}
    for name, (nbytes, bandwidth) in comm.items():
        out[name] = 0.0 if nbytes == 0 else nbytes / _pos(f"{name} bandwidth", bandwidth)
    out["total"] = sum(out.values())
    # --8<-- [end:step_time]
    return out
