"""Prefill vs decode: time, FLOPs, bytes moved and arithmetic intensity of each kind of engine step.

What it shows
    1. Prefill: one request's prompt of L tokens in one step. Measured forward time for several L, and the
       FLOPs and bytes that step needs: FLOPs grow with L, the weights are read once whatever L is.
    2. Decode: B requests generating one token each per step. Measured step time for several B (only steps in
       which all B sequences decode: their prefills run first, in one step): the weights are read once per step
       and shared by the B tokens, and every sequence reads its whole KV cache (the kv_mib column).
    3. Arithmetic intensity (FLOPs per byte moved) of every step next to this machine's measured ridge point
       (peak matmul FLOP/s divided by copy bandwidth): above it a step is compute-bound, below memory-bound;
       roofline.png draws the two limits, each step's counted intensity on the x-axis and its timed FLOP/s.
    Every time is the forward pass of a step as the engine records it, best and median of --reps after a
    warm-up, with the garbage collector held off; the load average is printed beside them.
    The FLOP formula (2 per weight per token, plus the causal attention pairs, L(L+1)/2 for a prefill of L,
    and the logits rows) is checked against torch.utils.flop_counter on the model's own forward before
    anything is printed (the counter also sees the masked scores that the math backend of torch's
    scaled_dot_product_attention, SDPA, computes and discards),
    and the tests check the byte formula against the sizes of the real weight and KV tensors.

How to run
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/prefill_vs_decode.py
    python .../prefill_vs_decode.py --prompt-lens 16 64 240 --batch-sizes 1 8 64

Runtime on 2 idle cores: about 5 s, 5 s with --smoke (two to four times that on a busy machine).

Try next
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/prefill_vs_decode.py --context 200
        -> longer contexts: each sequence's KV cache is about 3x bigger, so the kv_mib column and the
           per-sequence cost grow; watch whether tokens/s now peak at a smaller batch, and what the
           `decode times` line says about the memory side
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/prefill_vs_decode.py --batch-sizes 1 4 16 64 128
        -> past the batch sizes of the default run: see whether tokens/s keep falling once the KV cache and
           the activations outgrow the CPU's caches
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/prefill_vs_decode.py --threads 2
        -> two threads for matrices this small: expect little gain, often a loss, from the extra thread
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mlsys import bench, cli, plot, report
from mlsys.data import Tokenizer, make_corpus
from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.model import GPT, GPTConfig
from mlsys.weights import load_pretrained


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    prompt_lens: list[int] = field(default_factory=lambda: [8, 16, 32, 64, 128, 192, 240])
    """Prompt lengths (tokens, <bos> included) for the prefill sweep."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    """Concurrent sequences for the decode sweep."""
    context: int = 64
    """Prompt length of every decoding sequence (its KV cache length when the timed steps start)."""
    reps: int = 7
    """Timed repetitions per point, after one warm-up; the fastest is reported (the least disturbed by other
    processes), the median beside it."""
    threads: int = 1
    """torch intra-op threads. 1: the tiny model's matrices are too small to split, extra threads only wait."""

    def validate(self) -> None:
        if not self.prompt_lens or not self.batch_sizes or min(self.prompt_lens + self.batch_sizes) < 1:
            raise cli.UsageError("--prompt-lens and --batch-sizes need positive values")
        if max(self.prompt_lens) > 255 or not 1 <= self.context <= 255 - self.reps - 2:
            raise cli.UsageError("prompt lengths and --context must leave room in the model's 256 positions")
        if self.reps < 1 or self.threads < 1:
            raise cli.UsageError("--reps and --threads must be at least 1")


# --8<-- [start:flops]
def attention_pairs(q: int, k: int) -> int:
    """(query, key) pairs the causal mask keeps when q new tokens are the last q of k positions: new token i
    (0-based) sees the k - q cached keys and itself plus the i new tokens before it. A prefill (q = k = L) has
    L(L+1)/2 of them, a decode step (q = 1) has k."""
    return q * (k - q) + q * (q + 1) // 2


def step_flops(cfg: GPTConfig, q_lens: list[int], kv_lens: list[int], num_logits: int) -> int:
    """Matmul FLOPs of the useful work of one forward over S sequences: sequence s computes q_lens[s] new tokens
    that attend to kv_lens[s] keys (its cache plus themselves); num_logits rows go through the (C, V) head.

    Per token, every Linear weight is used in one multiply and one add: 2 * 12 * n_layer * C^2 FLOPs
    (qkv 3C^2, attention output C^2, MLP 8C^2), i.e. ~2 FLOPs per parameter. Attention adds q.k and p.v:
    4 * C FLOPs per (query, key) pair per layer, for the pairs the causal mask keeps (a kernel that skips
    masked tiles, as FlashAttention does, computes about these; a dense one computes all q * k).
    """
    L, C = cfg.n_layer, cfg.n_embd
    linear = 2 * 12 * L * C * C * sum(q_lens)
    attention = 4 * L * C * sum(attention_pairs(q, k) for q, k in zip(q_lens, kv_lens))
    head = 2 * C * cfg.vocab_size * num_logits
    return linear + attention + head


def step_bytes(num_params: int, cfg: GPTConfig, q_lens: list[int], kv_lens: list[int], dtype_bytes: int = 4) -> int:
    """Bytes a step must move at least: every weight read once (shared by all tokens of the step), each
    sequence's K and V read for all its kv_lens positions, and K, V written for the new tokens.
    Activations are left out: they are small next to the weights and the cache in decode steps and short
    prefills, but grow with the tokens of the step (about 18 * n_embd values per token and layer), so a
    prefill of more than about a hundred tokens moves more activation bytes than weight bytes on this model."""
    per_position = 2 * cfg.n_layer * cfg.n_embd * dtype_bytes  # K and V, every layer
    return num_params * dtype_bytes + per_position * (sum(kv_lens) + sum(q_lens))
# --8<-- [end:flops]


def counted_flops(model: GPT, batch: int, prompt_len: int, decode: bool) -> int:
    """FLOPs torch's flop counter sees in GPT.forward: a prefill of (batch, prompt_len), or one decode step.
    Attention runs on SDPA's math backend, whose matmuls the counter sees (it skips the fused CPU kernel)."""
    cache = model.new_kv_cache(batch, prompt_len + 1)
    idx = torch.randint(0, model.config.vocab_size, (batch, prompt_len))
    with torch.no_grad():
        if decode:
            model(idx, kv_cache=cache)
        with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
            if decode:
                model(idx[:, :1], kv_cache=cache, start_pos=prompt_len)
            else:
                model(idx, kv_cache=cache)
    return counter.get_total_flops()


def check_flop_formula(model: GPT) -> None:
    """step_flops + the masked pairs a dense kernel computes anyway == what torch's flop counter sees."""
    cfg = model.config
    for batch, length, decode in [(1, 37, False), (3, 20, False), (4, 50, True)]:
        q = [1 if decode else length] * batch
        kv = [length + 1 if decode else length] * batch
        logits = batch * (1 if decode else length)  # GPT.forward computes the head for every position
        masked = sum(qi * ki - attention_pairs(qi, ki) for qi, ki in zip(q, kv))  # scored, then masked away
        report.expect_equal(f"FLOPs of {'decode' if decode else 'prefill'} B={batch} T={length}",
                            step_flops(cfg, q, kv, logits) + 4 * cfg.n_layer * cfg.n_embd * masked,
                            counted_flops(model, batch, length, decode))


# --8<-- [start:measure]
def prefill_time(engine: Engine, ids: list[int], reps: int) -> dict:
    """Forward seconds of a prefill of `ids`: a fresh one-token request, whose first step is the whole prompt."""

    def one() -> float:
        engine.add_request(ids, SamplingParams(max_tokens=1))
        engine.step()
        assert engine.last_step_timing["num_batched_tokens"] == len(ids)  # the whole prompt, in one step
        return engine.last_step_timing["forward"]

    return bench.best_of(one, reps, warmup=1)


def decode_time(engine: Engine, prompts: list[list[int]], reps: int) -> dict:
    """Forward seconds of a decode step of len(prompts) sequences, one new token each."""
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=reps + 3, ignore_eos=True))
    engine.step()  # everybody's prefill in one step (the token budget holds them all), first tokens sampled

    def one() -> float:
        engine.step()
        t = engine.last_step_timing
        if not t["num_seqs"] == t["num_batched_tokens"] == len(prompts):  # a pure decode step of all of them
            raise cli.SelfCheckFailed(f"timed step ran {t['num_seqs']} sequences, {t['num_batched_tokens']} tokens")
        return t["forward"]

    result = bench.best_of(one, reps, warmup=1)
    while engine.has_unfinished():
        engine.step()
    return result
# --8<-- [end:measure]


def doubling_verdict(prev: dict, last: dict) -> str:
    """The step from batch prev to batch last in words: how much step time it took (best and median ratio) and
    whether tokens per second rose, which they do when the step time grew by less than the batch (k times the
    sequences). When the best and the median ratio fall on different sides of k, the run cannot tell whether the
    larger batch paid off, and the sentence says so instead."""
    k = last["batch"] / prev["batch"]
    best, median = last["ms"] / prev["ms"], last["median_ms"] / prev["median_ms"]
    if (best < k) != (median < k):
        return (f"took {best:.2f}x the step time of B={prev['batch']} by the fastest repetitions but {median:.2f}x by "
                f"the medians, one below and one above {k:g}x: at this load the run cannot tell whether the larger "
                "batch paid off in tokens per second")
    return (f"took {best:.2f}x the step time of B={prev['batch']} (medians: {median:.2f}x), so tokens per second "
            f"{'rose' if best < k else 'fell'} at the largest batch")


AGREE = 1.25  # the fastest and the median ratio tell one story only within this factor of each other


def memory_side(decode: list[dict], load: float | None = None, cores: int | None = None) -> str:
    """Do the decode times show the memory side? A step's FLOPs grow exactly with B and its counted bytes more
    slowly, so a step time that grew faster than the number of sequences, by the fastest repetitions and by the
    medians alike, is what neither count explains. Load from other programs can do the same, so the memory side
    is claimed only when the two ratios agree within AGREE and the 1-minute load average was at most the core
    count; otherwise the sentence names what casts the doubt. The largest batch is compared with the batch before
    it and with the batch of the most tokens per second. -> the rest of "the decode times ...", from the rows."""
    last = decode[-1]
    peak = max(decode, key=lambda r: r["tokens_per_s"])
    froms = decode[-2:-1] + ([peak] if peak is not last and peak not in decode[-2:-1] else [])
    doubtful = []
    for prev in froms:
        k, best, median = last["batch"] / prev["batch"], last["ms"] / prev["ms"], last["median_ms"] / prev["median_ms"]
        if best > k and median > k:
            took = (f"from B={prev['batch']} to B={last['batch']}, {k:g}x the sequences took {best:.2f}x the step "
                    f"time by the fastest repetitions and {median:.2f}x by the medians")
            doubts = ([f"the load average, {load:.2f}, exceeded the {cores} cores"] if load and cores and load > cores
                      else []) + ([f"the two ratios differ by more than {AGREE - 1:.0%}"]
                                  if max(best, median) > AGREE * min(best, median) else [])
            if not doubts:
                return f"show the memory side: {took}"
            doubtful.append(f"{took}, but {' and '.join(doubts)}, and load alone can cause that")
    if doubtful:
        return f"may show the memory side, or only the machine's load: {doubtful[0]}"
    if not froms:
        return "do not show the memory side: only one batch size was measured"
    named = [f"B={r['batch']}" + (" (the most tokens per second)" if r is peak else "") for r in froms]
    return (f"do not show the memory side: from {', and from '.join(named)} to "
            f"B={last['batch']}, the step time never grew faster than the number of sequences by the fastest "
            "repetitions and the medians alike")


def prefill_peak_sentence(prefill: list[dict]) -> str:
    """Where the prefill's tokens per second peaked, by the fastest repetitions, to follow "the most at": "a middle
    length" only when the peak lies strictly between the shortest and the longest length measured, and the
    longest length compared with the peak only when it is not the peak itself."""
    i = max(range(len(prefill)), key=lambda j: prefill[j]["tokens_per_s"])
    peak, last, n = prefill[i], prefill[-1], len(prefill)
    where = ("the only length measured" if n == 1 else "the longest length measured" if i == n - 1 else
             "the shortest length measured" if i == 0 else "a middle length")
    text = f"{where}, L = {peak['prompt_len']} ({peak['tokens_per_s']:,.0f} tokens per second)"
    if i < n - 1:
        ratio = last["tokens_per_s"] / peak["tokens_per_s"]
        text += f", and the longest, L = {last['prompt_len']}, got {ratio:.2f}x that"
    return text


def intensity_growth(decode: list[dict], weights_mib: float) -> dict:
    """What the formula says about the decode rows' intensity, B f / (W + B k) for B sequences of f FLOPs and k KV
    bytes each over W bytes of weights: B times one sequence's only while B k is small next to W. -> the
    growth from the first row to the last, the batch ratio, one sequence's KV bytes as a share of the weights,
    and the batch whose KV cache weighs as much as the weights (W / k)."""
    first, last = decode[0], decode[-1]
    kv_share = first["kv_mib"] / first["batch"] / weights_mib
    return {"decode_intensity_growth": last["intensity"] / first["intensity"],
            "decode_batch_growth": last["batch"] / first["batch"],
            "kv_share_per_seq": kv_share, "kv_equals_weights_batch": 1 / kv_share}


def machine_peaks(n: int = 1024, mib: int = 256) -> tuple[float, float]:
    """(matmul FLOP/s, copy bytes/s) of this CPU in float32, each the best of 3 after a warm-up: the two ends
    of its roofline."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    big = torch.empty(mib * 2**20 // 4)
    t_mm = bench.best_of(lambda: _timed(lambda: a @ b), 3)["best_s"]
    t_copy = bench.best_of(lambda: _timed(big.clone), 3)["best_s"]
    return 2 * n**3 / t_mm, 2 * big.numel() * 4 / t_copy  # a copy reads and writes every byte


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def draw(prefill: list[dict], decode: list[dict], ridge: float, args: Settings) -> None:
    plt = plot.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.6))
    lens = [r["prompt_len"] for r in prefill]  # per-token time: its lowest point is the tokens/s peak
    axes[0].plot(lens, [1e3 * r["ms"] / r["prompt_len"] for r in prefill], "o-", label="fastest")
    axes[0].set(xlabel="prompt length (tokens)", ylabel="forward time per token (µs)", title="prefill: one request",
                xscale="log")
    axes[0].plot(lens, [1e3 * r["median_ms"] / r["prompt_len"] for r in prefill], "s--", color="C0", alpha=0.4,
                 label="median")
    axes[0].legend(fontsize=8)
    axes[1].plot([r["batch"] for r in decode], [r["ms"] for r in decode], "o-", color="C1", label="fastest")
    axes[1].plot([r["batch"] for r in decode], [r["median_ms"] for r in decode], "s--", color="C1", alpha=0.4,
                 label="median")
    axes[1].legend(fontsize=8)
    axes[1].set(xlabel="sequences in the step", ylabel="forward time (ms)", title=f"decode: context {args.context}",
                xscale="log")
    axes[2].loglog([r["prompt_len"] for r in prefill], [r["intensity"] for r in prefill], "o-", label="prefill")
    axes[2].loglog([r["batch"] for r in decode], [r["intensity"] for r in decode], "o-", label="decode")
    axes[2].axhline(ridge, color="k", ls="--", lw=1, label=f"ridge of this CPU ({ridge:.1f})")
    axes[2].set(xlabel="tokens in the step", ylabel="FLOPs per byte moved", title="arithmetic intensity")
    axes[2].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)  # outside: the points stay visible
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'prefill_vs_decode')}")


def draw_roofline(prefill: list[dict], decode: list[dict], flops_peak: float, bw_peak: float, args: Settings) -> None:
    """This CPU's roofline: attainable FLOP/s = min(peak, bandwidth x intensity), bent at the ridge. Each step is a
    tick on the x-axis at its counted intensity, and a hollow marker above it at the FLOP/s it reached: its
    counted FLOPs over its fastest time (gflop / ms)."""
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(9.6, 3.6))
    roof = lambda i: min(flops_peak, bw_peak * i) / 1e9  # GFLOP/s
    ridge, xs = flops_peak / bw_peak, [r["intensity"] for r in prefill + decode]
    ends = [min(xs + [ridge]) / 2, ridge, max(xs + [ridge]) * 2]  # the roof is two straight lines on log axes
    ax.loglog(ends, [roof(i) for i in ends], "k-", lw=1.5, label="roof: min(peak, bandwidth × intensity)")
    ax.axvline(ridge, color="k", ls="--", lw=1, label=f"ridge point ({ridge:.1f} FLOPs/byte)")
    for x, text, ha in ((ridge / 1.2, "← memory-bound", "right"), (ridge * 1.2, "compute-bound →", "left")):
        ax.text(x, 0.1, text, ha=ha, fontsize=9, transform=ax.get_xaxis_transform())
    for rows, name, color in ((prefill, "prefill (growing L)", "C0"), (decode, "decode (growing B)", "C1")):
        ax.plot([r["intensity"] for r in rows], [0.0] * len(rows), "|", color=color, ms=14, mew=2, clip_on=False,
                transform=ax.get_xaxis_transform(), label=f"{name}: counted intensity")
    for rows, name, color in ((prefill, "prefill", "C0"), (decode, "decode", "C1")):
        ax.plot([r["intensity"] for r in rows], [r["gflop"] / r["ms"] * 1e3 for r in rows], "o", mfc="none",
                color=color, label=f"{name}: timed GFLOP/s (gflop / ms)")
    ax.set(xlabel="arithmetic intensity (FLOPs per byte moved)", ylabel="GFLOP/s",
           title="the roofline of this CPU, and what each step reached")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # outside: the markers stay visible
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'roofline')}")


def main() -> None:
    args = cli.parse(Settings, __doc__, smoke={"prompt_lens": [8, 64], "batch_sizes": [1, 8], "reps": 2})
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model = load_pretrained("small")
    cfg, n_params = model.config, sum(p.numel() for p in model.parameters())
    check_flop_formula(model)
    print(f"model: {n_params:,} parameters ({n_params * 4 / 2**20:.2f} MiB in float32), {cfg.n_layer} layers, "
          f"C={cfg.n_embd}; FLOP formula agrees with torch.utils.flop_counter\n")
    with bench.steady_timing():
        flops_peak, bw_peak = machine_peaks(*((256, 16) if args.smoke else (1024, 256)))
    ridge = flops_peak / bw_peak
    print(f"this CPU ({args.threads} thread): matmul {flops_peak / 1e9:.1f} GFLOP/s, copy {bw_peak / 1e9:.1f} GB/s "
          f"-> ridge point {ridge:.1f} FLOPs/byte\n")
    c = args.context  # a token budget that holds every decode batch's prefill, so one step prefills them all
    budget = max(512, max(args.batch_sizes) * c, max(args.prompt_lens))
    engine = Engine(model, config=EngineConfig(max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=budget))
    stream = Tokenizer().encode_corpus(make_corpus(60, seed=args.seed)).tolist()  # real records as prompts

    prefill, decode = [], []
    with bench.steady_timing():
        for n in args.prompt_lens:
            t = prefill_time(engine, stream[:n], args.reps)
            sec, fl, by = t["best_s"], step_flops(cfg, [n], [n], 1), step_bytes(n_params, cfg, [n], [0])
            prefill.append(dict(prompt_len=n, ms=sec * 1e3, median_ms=t["median_s"] * 1e3, tokens_per_s=n / sec,
                                gflop=fl / 1e9, mib=by / 2**20, intensity=fl / by))
        for b in args.batch_sizes:
            t = decode_time(engine, [stream[i * 7 : i * 7 + c] for i in range(b)], args.reps)
            kv = [c + 2] * b  # the cache of the first timed step: prompt, two tokens (one is the new one)
            sec, fl, by = t["best_s"], step_flops(cfg, [1] * b, kv, b), step_bytes(n_params, cfg, [1] * b, kv)
            kv_mib = (by - n_params * 4) / 2**20  # the K and V the step reads and writes
            decode.append(dict(batch=b, ms=sec * 1e3, median_ms=t["median_s"] * 1e3, tokens_per_s=b / sec,
                               gflop=fl / 1e9, mib=by / 2**20, kv_mib=kv_mib, intensity=fl / by))
    print(f"prefill: one request, the whole prompt in one step (forward time, best and median of {args.reps})")
    print(report.table(prefill, floatfmt=".3g") + "\n")
    print(f"decode: B sequences, one new token each, {c}-token context (forward time, best and median of {args.reps})")
    print(report.table(decode, floatfmt=".3g") + "\n")
    print(bench.load_average())
    try:  # the same 1-minute load average, for the `decode times` verdict
        load = os.getloadavg()[0]
    except OSError:
        load = None
    side = memory_side(decode, load, os.cpu_count())
    engine.check_invariants()

    p_last, d_first, d_last = prefill[-1], decode[0], decode[-1]
    peak = max(decode, key=lambda r: r["tokens_per_s"])
    p_peak = max(prefill, key=lambda r: r["tokens_per_s"])
    p_peak_med = max(prefill, key=lambda r: r["prompt_len"] / r["median_ms"])  # the same, read from the medians
    medians_agree = ("the medians peak at the same length" if p_peak_med is p_peak else
                     f"the medians peak at L = {p_peak_med['prompt_len']} instead: at this load the shape is "
                     "within noise")
    before_last = decode[-2] if len(decode) > 1 else d_last
    bound = lambda ai: "above the ridge: compute-bound" if ai > ridge else "below the ridge: memory-bound"
    above = [r["prompt_len"] for r in prefill if r["intensity"] > ridge]
    compute_bound_from = (f"from L = {above[0]} tokens on" if above else
                          f"at none of the lengths measured, up to L = {p_last['prompt_len']}")
    print(f"prefill of {p_last['prompt_len']} tokens: {p_last['intensity']:.0f} FLOPs/byte, "
          f"{bound(p_last['intensity'])}; prefills are compute-bound {compute_bound_from}")
    print(f"prefill tokens/s, by the fastest repetitions: the most at {prefill_peak_sentence(prefill)}; "
          f"{medians_agree}")
    print(f"decode at B=1: {d_first['intensity']:.2f} FLOPs/byte, {bound(d_first['intensity'])}; "
          f"B={d_last['batch']}: {d_last['intensity']:.1f}, {bound(d_last['intensity'])}")
    print(f"decode tokens/s: B=1 {d_first['tokens_per_s']:.0f}, B={d_last['batch']} {d_last['tokens_per_s']:.0f} "
          f"({d_last['tokens_per_s'] / d_first['tokens_per_s']:.1f}x from batching); the most at B={peak['batch']} "
          f"({peak['tokens_per_s']:.0f})")
    g = intensity_growth(decode, n_params * 4 / 2**20)
    print(f"decode intensity: {g['decode_intensity_growth']:.1f}x from B={d_first['batch']} to B={d_last['batch']} "
          f"({g['decode_batch_growth']:g}x the sequences): one sequence's KV cache is {g['kv_share_per_seq']:.0%} "
          f"of the weights' bytes, so about {g['kv_equals_weights_batch']:.0f} sequences' caches weigh as much as "
          "the weights")
    if len(decode) > 1:
        print(f"last step, B={before_last['batch']} to B={d_last['batch']}: {doubling_verdict(before_last, d_last)}")
    if peak is not d_last:
        print(f"from B={peak['batch']} to B={d_last['batch']}: {d_last['batch'] / peak['batch']:g}x the sequences, "
              f"{d_last['ms'] / peak['ms']:.2f}x the step time by the fastest repetitions "
              f"({d_last['median_ms'] / peak['median_ms']:.2f}x by the medians), "
              f"{d_last['kv_mib'] / peak['kv_mib']:.2f}x the KV cache "
              f"moved ({peak['kv_mib']:.1f} -> {d_last['kv_mib']:.1f} MiB; the weights stay "
              f"{n_params * 4 / 2**20:.1f} MiB)")
    print(f"decode times: they {side}")
    print("note: this model's weights (3 MiB) fit in the CPU's caches and each step is dozens of small kernel calls,"
          " so the measured times show per-step overhead more than DRAM traffic; the intensities are the"
          " arithmetic that decides the bound on a GPU-sized model")
    draw(prefill, decode, ridge, args)
    draw_roofline(prefill, decode, flops_peak, bw_peak, args)
    if args.json:
        report.write_json(args.json, {"num_params": n_params, "weights_mib": n_params * 4 / 2**20,
                                      "peak_gflop_per_s": flops_peak / 1e9, "copy_gb_per_s": bw_peak / 1e9,
                                      "ridge_flops_per_byte": ridge, "prefill": prefill, "decode": decode,
                                      "prefill_peak_len": p_peak["prompt_len"],
                                      "prefill_compute_bound_from": compute_bound_from,
                                      "decode_last_vs_ridge": bound(d_last["intensity"]),
                                      "prefill_peak_tokens_per_s": p_peak["tokens_per_s"],
                                      "prefill_peak_sentence": prefill_peak_sentence(prefill),
                                      "prefill_median_peak_len": p_peak_med["prompt_len"],
                                      "prefill_medians_agree": medians_agree,
                                      "prefill_last_vs_peak": p_last["tokens_per_s"] / p_peak["tokens_per_s"],
                                      "decode_peak_batch": peak["batch"],
                                      "decode_peak_tokens_per_s": peak["tokens_per_s"],
                                      "decode_speedup_last_vs_b1": d_last["tokens_per_s"] / d_first["tokens_per_s"],
                                      "step_time_growth_after_peak": d_last["ms"] / peak["ms"],
                                      "last_step_time_ratio": d_last["ms"] / before_last["ms"],
                                      "last_batch_ratio": d_last["batch"] / before_last["batch"],
                                      "last_doubling_tokens_per_s": "fell" if d_last["tokens_per_s"] < before_last[
                                          "tokens_per_s"] else "rose",
                                      "last_doubling": doubling_verdict(before_last, d_last),
                                      "memory_side": side,
                                      "decode_range_word": "cheaper" if d_last["tokens_per_s"] > d_first[
                                          "tokens_per_s"] else "no cheaper",
                                      **intensity_growth(decode, n_params * 4 / 2**20),
                                      "load_average": bench.load_average()}, args)


if __name__ == "__main__":
    cli.run(main)
