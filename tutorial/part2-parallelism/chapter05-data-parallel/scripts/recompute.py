"""Activation recomputation (checkpointing): keep less for the backward pass, compute part of the forward again.

What it shows
    1. What one transformer layer of the book's GPT keeps for its backward pass, measured, not estimated: every
       tensor autograd saves passes through torch.autograd.graph.saved_tensors_hooks, and the script adds up the
       distinct storages (the weights left out: they are kept anyway). Four settings:
         none       keep everything autograd wants (attention computed the textbook way: the (s x s) matrix
                    of attention probabilities is materialised and kept)
         fused      keep everything, with PyTorch's fused attention kernel, which never stores the (s x s) matrix
         selective  recompute only the attention core, softmax(q k^T) v, in the backward pass
                    (torch.utils.checkpoint around that one function, as Megatron-LM's selective recomputation)
         full       recompute the whole layer: torch.utils.checkpoint around each block keeps only its input
       Each is shown in units of s*b*h bytes next to mlsys.memory.activation_bytes_per_layer, the count of
       Korthikanti et al. taken item by item for this run's 4-byte values and no dropout. (At --batch 1 the math
       attention's q, k, v stay views of the fused qkv output, whose whole storage is then counted: about 8 sbh
       over the count.)
    2. What it costs: one training step (forward + backward) of the whole model for each setting, the fastest of
       --repeats after a warm-up round (the least disturbed; the median is printed beside it), against the flop
       count's prediction for full recomputation (8ND instead of 6ND: one more forward). On a shared CPU these
       steps last a fraction of a second and the ratio is noise-dominated: it has come out anywhere from below 1
       to several times the prediction; the load average is printed with it. Gradients are checked equal to the plain
       run's for every setting.
    Figure recompute.png: per setting, the bytes one layer kept for its backward (measured, in bytes per s*b*h),
    one bar each, with the count's value marked on it; written to --plot-dir (default .cache/figures/recompute).

How to run
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/recompute.py
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/recompute.py --seq 256

Runtime on 2 cores: about 4-10 s at the defaults (4 s at a load average of 4), most of it importing torch and the 6
timed rounds of 4 settings; about 3 s with --smoke; longer under load (13 s in a book build at a load average of
5). The script sets OMP_WAIT_POLICY=PASSIVE (unless you set it): without it, torch's two OpenMP threads spin
between ops, and with other work on the 2 cores the steps took about ten times as long (a whole run 33 s instead of
7 s at the same load; book builds under heavy load took over a minute).

Try next
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/recompute.py --seq 128
    python tutorial/part2-parallelism/chapter05-data-parallel/scripts/recompute.py --seq 256
        -> (one at a time; 256 is the model's longest) the attention matrix grows with s^2: "none" grows faster
           than the others
"""

from __future__ import annotations

import os

# Before `import torch` loads OpenMP, which reads this once: OpenMP's idle threads spin between ops by default,
# and on 2 shared cores the spinning takes the core that the thread with work needs. A user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import statistics
import time
from dataclasses import dataclass
from functools import partial

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from mlsys import bench, cli, memory, plot, report
from mlsys.model import GPT, GPTConfig, causal_attention


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    batch: int = 2
    """Sequences per step (b)."""
    seq: int = 256
    """Tokens per sequence (s), at most 256 (the model's positions)."""
    layers: int = 4
    """Transformer layers of the model timed in part 2."""
    repeats: int = 5
    """Timed training steps per setting; the median is reported (after one warm-up step)."""

    def validate(self) -> None:
        if not 1 <= self.seq <= 256 or self.batch < 1 or self.layers < 1 or self.repeats < 1:
            raise cli.UsageError("--seq must lie in 1..256, --batch, --layers and --repeats must be >= 1")


SETTINGS = ("none", "fused", "selective", "full")


# --8<-- [start:settings]
def configure(model: GPT, setting: str) -> None:
    """Put one recomputation setting into the model's layers (the weights are untouched)."""
    for block in model.h:
        block.attn.core = causal_attention
        block.recompute = setting == "full"
        if setting == "selective":  # only the attention core is recomputed in the backward pass
            block.attn.core = partial(checkpoint, causal_attention, use_reentrant=False)


def forward(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's forward, with every block under torch.utils.checkpoint where full recomputation is on."""
    x = model.drop(model.wte(idx) + model.wpe(torch.arange(idx.shape[1])))
    for block in model.h:
        x = checkpoint(block, x, use_reentrant=False) if block.recompute else block(x)
    logits = model.lm_head(model.ln_f(x))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def kernel(setting: str):
    """The textbook attention (the math backend materialises softmax(q k^T)) except for the fused setting."""
    if setting == "fused":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    return sdpa_kernel(SDPBackend.MATH)
# --8<-- [end:settings]


# --8<-- [start:measure]
def saved_bytes(fn, params: set[int]) -> int:
    """Bytes of the distinct storages autograd saves for backward while fn() runs its forward, leaving out the
    weights (`params`: their storages' addresses), which are kept anyway."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()  # views of one storage count once
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())
# --8<-- [end:measure]


def layer_bytes(model: GPT, setting: str, x: torch.Tensor) -> int:
    """What one block keeps for backward under `setting`."""
    block = model.h[0]
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    configure(model, setting)
    with kernel(setting):
        if block.recompute:
            return saved_bytes(lambda: checkpoint(block, x, use_reentrant=False), params)
        return saved_bytes(lambda: block(x), params)


def one_step(model: GPT, setting: str, idx, targets) -> tuple[float, dict]:
    """Seconds of one forward + backward under `setting`, and the gradients it produced."""
    configure(model, setting)
    model.zero_grad(set_to_none=True)
    with kernel(setting):
        t0 = time.perf_counter()
        forward(model, idx, targets).backward()
        seconds = time.perf_counter() - t0
    return seconds, {n: p.grad.clone() for n, p in model.named_parameters()}


def draw(args: Settings, rows: list[dict], label: str) -> None:
    """One bar per setting: the bytes per sbh one layer kept for backward, measured; a tick at the count."""
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    names = [r["setting"] for r in rows]
    kept = [r["kept / sbh"] for r in rows]
    bars = ax.bar(names, kept, color=plot.colours(["measured"])["measured"], label="measured (saved tensors)")
    ax.scatter(names, [r["formula / sbh"] for r in rows], marker="_", s=900, color="black", zorder=3,
               label="the count (Korthikanti et al., 4-byte values)")
    for bar, value in zip(bars, kept):
        ax.text(bar.get_x() + bar.get_width() / 2, value + 0.02 * max(kept), f"{value:.1f}", ha="center",
                va="bottom", fontsize=9)
    ax.set(ylabel="bytes kept per s*b*h, one layer", xlabel="setting", ylim=(0, 1.3 * max(kept)),
           title=f"What one layer keeps for backward ({label})")
    ax.legend(loc="upper right", fontsize=8)
    print(f"figure: {plot.save(fig, args, 'recompute')}")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"batch": 2, "seq": 64, "layers": 2, "repeats": 2})
    torch.manual_seed(args.seed)
    config = GPTConfig.preset("small", n_layer=args.layers)
    model = GPT(config).train()
    b, s, h, a = args.batch, args.seq, config.n_embd, config.n_head
    sbh = s * b * h
    x = torch.randn(b, s, h, requires_grad=True)
    idx = torch.randint(config.vocab_size, (b, s))
    targets = torch.randint(config.vocab_size, (b, s))

    def formula(recompute: str) -> float:  # the Korthikanti et al. count for this run: 4-byte values, no dropout
        return memory.activation_bytes_per_layer(s, b, h, a, recompute=recompute, dtype_bytes=4, dropout=False)

    # fused kernels never store the (s x s) matrix: the count without it is the selective one
    estimate = {"none": formula("none"), "fused": formula("selective"), "selective": formula("selective"),
                "full": formula("full")}
    times: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
    grads: dict[str, dict] = {}
    with bench.steady_timing():
        for rep in range(args.repeats + 1):  # round-robin over the settings, so drift hits all alike
            for setting in SETTINGS:
                seconds, grads[setting] = one_step(model, setting, idx, targets)
                if rep:  # the first round is a warm-up
                    times[setting].append(seconds)
    load = bench.load_average()  # read once, as the timing ends: the printed lines and the --json quote this one
    rows = []
    for setting in SETTINGS:
        for name, g in grads[setting].items():  # recomputation must not change the gradients
            report.expect_close(f"{setting}: grad of {name}", g, grads["none"][name], rtol=1e-4, atol=1e-6)
        kept = layer_bytes(model, setting, x)
        rows.append({"setting": setting, "kept per layer (MiB)": kept / 2**20, "kept / sbh": kept / sbh,
                     "formula / sbh": estimate[setting] / sbh,
                     "step (ms)": 1e3 * min(times[setting]),
                     "median (ms)": 1e3 * statistics.median(times[setting])})
    base = rows[0]["step (ms)"]
    for row in rows:
        row["step / none"] = row["step (ms)"] / base
    print(f"one layer of the book's GPT (h={h}, a={a}) at s={s}, b={b}, fp32, no dropout; steps of {args.layers} "
          f"layers, fastest of {args.repeats} after a warm-up round ({load})")
    print(report.table(rows, floatfmt=".3g"))
    flops_ratio = memory.train_flops(1, 1, "full") / memory.train_flops(1, 1)
    print(f"attention matrix, a*s*s*b*4 bytes = {a * s * s * b * 4 / sbh:.3g} sbh: kept by none, not by fused or "
          f"selective. full keeps the layer input only ({4 * sbh / sbh:.0f} sbh in fp32)")
    print(f"full recomputation: step {rows[3]['step / none']:.2f}x of none; the flop count predicts "
          f"{flops_ratio:.2f}x (one more forward: 8ND instead of 6ND); on a shared CPU this ratio is "
          f"noise-dominated ({load})")
    print("OK: gradients equal with every setting")
    draw(args, rows, f"s={s}, b={b}, h={h}")
    kept = {r["setting"]: r["kept / sbh"] for r in rows}
    kept_bytes = {r["setting"]: round(r["kept per layer (MiB)"] * 2**20) for r in rows}
    if args.json:
        report.write_json(args.json, {"rows": rows, "kept_sbh": kept, "kept_bytes": kept_bytes,
                                      "formula_sbh": {r["setting"]: r["formula / sbh"] for r in rows},
                                      "full_step_ratio": rows[3]["step / none"], "flops_ratio": flops_ratio,
                                      "attention_matrix_sbh": a * s * s * b * 4 / sbh,
                                      "excess_sbh_none": kept["none"] - estimate["none"] / sbh,
                                      "load_average": load}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
