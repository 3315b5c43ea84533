"""Sequence parallelism: LayerNorm and dropout on sequence shards, the activation memory it saves, measured.

What it shows
    For every tensor-parallel size t in --tp-sizes (W/t groups of t consecutive ranks):
    1. the tiny GPT with tensor + sequence parallelism (all-gather before each column layer, reduce-scatter after
       each row layer) gives the same logits, loss and parameter gradients as plain tensor parallelism and as the
       dense model;
    2. the bytes autograd saves for backward in ONE block, per rank, measured with saved_tensors_hooks for the
       dense block, TP and TP+SP, against the formula of mlsys.tensor_parallel.block_activation_bytes;
    3. the collectives of one block under SP against layer_comm_volume: the forward pass sends exactly as many
       bytes per rank as TP's two all-reduces.
    Figures one_block_tensor_parallel.png and one_block_tensor_plus_sequence_parallel.png (largest t): one block walked
    in the order it ran, from hooks on its four linear layers and the collectives comm_log recorded inside each, forward
    and backward, with the real shapes of the tensors between them: where f and g sit (TP), where the all-gathers and
    reduce-scatters sit (TP+SP).

How to run
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/sequence_parallel.py -w 4 --tp-sizes 1 2 4
    torchrun --nproc-per-node 4 tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/sequence_parallel.py

Prints the equality checks, a table of saved activation bytes per rank (measured and formula) with the saving of
SP over TP, and the per-rank bytes sent per block. Runtime on 2 cores: about 6 s; --smoke about 3 s.

Try next
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/sequence_parallel.py -w 4 --tp-sizes 4 --seq 256
        -> a longer sequence: every saved-bytes figure grows with it, and measured still equals the formula
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/sequence_parallel.py -w 2 --tp-sizes 2 --seq 127
        -> 127 tokens cannot be split over 2 ranks for sequence parallelism: a one-line usage error, exit 2
    torchrun --nproc-per-node 4 tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/sequence_parallel.py
        -> the same checks under torchrun, at t = 1 (dense), 2 and 4
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.launch import RankContext, launch
from mlsys.model import GPT, GPTConfig
from mlsys.tensor_parallel import (
    TPBlock,
    block_activation_bytes,
    check_tp_run,
    comm_log,
    grads_as_model,
    layer_comm_volume,
    saved_activation_bytes,
    shard_gpt,
    tp_groups,
)


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 4
    """Number of ranks; every tensor-parallel size must divide it. Under torchrun it is taken from WORLD_SIZE."""
    tp_sizes: list[int] = field(default_factory=lambda: [1, 2, 4])
    """Tensor-parallel sizes to check, each dividing the world size."""
    n_layer: int = 2
    """Blocks in the GPT."""
    n_head: int = 4
    """Attention heads; must be divisible by every tensor-parallel size."""
    n_embd: int = 128
    """Model width C (hidden size h)."""
    batch: int = 4
    """Sequences per group (b)."""
    seq: int = 128
    """Tokens per sequence (s); must be divisible by every tensor-parallel size."""

    def validate(self) -> None:
        try:
            config = GPTConfig(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd, block_size=256)
            check_tp_run(config, self.world_size, self.tp_sizes, self.batch, self.seq, sequence_parallel=True)
        except ValueError as err:
            raise cli.UsageError(str(err)) from None


def max_err(a: torch.Tensor, b: torch.Tensor, name: str) -> float:
    report.expect_close(name, a.detach(), b.detach(), rtol=1e-4, atol=2e-5)
    return float((a.detach() - b.detach()).abs().max())


def sp_equals_tp(model: GPT, group, idx: torch.Tensor, targets: torch.Tensor) -> dict:
    """Train-step outputs of TP+SP against TP without SP and against the dense model."""
    outs = {}
    for sp in (False, True):
        tp_model = shard_gpt(model, group, sequence_parallel=sp)
        logits, loss = tp_model(idx, targets)
        loss.backward()
        outs[sp] = (logits, loss, {n: p.grad for n, p in tp_model.named_parameters()})
    ref_logits, ref_loss = model(idx, targets)
    ref_loss.backward()
    dense_grads = dict(shard_gpt(grads_as_model(model), group).named_parameters())  # dense grads, sharded
    model.zero_grad()
    (lt, tl, gt), (ls, sl, gs) = outs[False], outs[True]
    return {"logits_sp_vs_tp": max_err(ls, lt, "SP vs TP logits"), "loss_sp_vs_tp": max_err(sl, tl, "SP vs TP loss"),
            "logits_sp_vs_dense": max_err(ls, ref_logits, "SP vs dense logits"),
            "grads_sp_vs_tp": max(max_err(gs[n], gt[n], f"SP vs TP grad {n}") for n in gt),
            "grads_sp_vs_dense": max(max_err(gs[n], dense_grads[n], f"SP vs dense grad {n}") for n in gt)}


# --8<-- [start:measure]
def block_memory(model: GPT, group, x: torch.Tensor, t: int) -> dict:
    """Bytes autograd saves in one block on THIS rank: dense, TP, TP+SP (input: the full x, or its sequence shard)."""
    dense = model.h[0]
    _, dense_bytes = saved_activation_bytes(lambda: dense(x.clone().requires_grad_(True)), list(dense.parameters()))
    measured, events = {}, {}
    for sp in (False, True):
        block = TPBlock(dense, group, sequence_parallel=sp)
        x_in = x.chunk(t, dim=1)[dist.get_rank(group)] if sp else x  # (B, T/t, C) or (B, T, C)
        x_in = x_in.clone().requires_grad_(True)
        with comm_log() as log:
            y, measured[sp] = saved_activation_bytes(lambda: block(x_in), list(block.parameters()))  # noqa: B023
            y.square().mean().backward()
        events[sp] = [(e.phase, e.op, e.nbytes) for e in log if e.tag == "activation"]
    return {"dense": dense_bytes, "tp": measured[False], "tp_sp": measured[True], "events_tp": events[False],
            "events_sp": events[True]}
# --8<-- [end:measure]


# ----------------------------------------------------------------------------------------------- the block, drawn
LINEARS = (("attn.c_attn", "column"), ("attn.c_proj", "row"), ("mlp.c_fc", "column"), ("mlp.c_proj", "row"))
BETWEEN = ("LayerNorm 1", "attention\n(own heads)", "+ residual\nLayerNorm 2", "GELU\n(own units)",
           "+ residual")  # what runs before, between and after the four linear layers


def walk_block(dense_block, group, x: torch.Tensor, t: int, sequence_parallel: bool) -> dict:
    """Run one sharded block forward and backward with hooks on its four linear layers; return, in the order they
    ran, each layer's input and output shape and the collectives comm_log recorded inside it in each direction."""
    block = TPBlock(dense_block, group, sequence_parallel=sequence_parallel)
    x_in = x.chunk(t, dim=1)[dist.get_rank(group)] if sequence_parallel else x  # (B, T/t, C) or (B, T, C)
    x_in = x_in.clone().requires_grad_(True)
    layers, handles = {}, []
    with comm_log() as log:
        def ops(start: int) -> list[str]:
            return [e.op for e in log[start:] if e.tag == "activation"]

        for name, kind in LINEARS:
            rec = layers[name] = {"name": name, "kind": kind,  # out features: this rank's and the dense layer's
                                  "features": [block.get_submodule(name).weight.shape[0],
                                               dense_block.get_submodule(name).weight.shape[0]],
                                  "in_features": [block.get_submodule(name).weight.shape[1],
                                                  dense_block.get_submodule(name).weight.shape[1]]}
            mod = block.get_submodule(name)
            handles += [
                mod.register_forward_pre_hook(lambda m, a, rec=rec: rec.update(fwd_start=len(log))),
                mod.register_forward_hook(lambda m, a, y, rec=rec: rec.update(
                    input=list(a[0].shape), output=list(y.shape), forward=ops(rec["fwd_start"]))),
                mod.register_full_backward_pre_hook(lambda m, g, rec=rec: rec.update(bwd_start=len(log))),
                mod.register_full_backward_hook(lambda m, gi, go, rec=rec: rec.update(backward=ops(rec["bwd_start"]))),
            ]
        y = block(x_in)
        y.square().mean().backward()
    for handle in handles:
        handle.remove()
    return {"input": list(x_in.shape), "output": list(y.shape),
            "linears": [{k: v for k, v in layers[name].items() if not k.endswith("_start")} for name, _ in LINEARS]}


def block_sequence(walk: dict) -> list[dict]:
    """The walk as the picture's left-to-right sequence: regions (what runs, on which shape) and the collective
    boundaries at the input of each column layer and the output of each row layer."""
    seq, linears = [], walk["linears"]
    # the tensor each region produces: in front of a column layer, the previous layer's output (the block's input
    # first), which under SP is still a sequence shard (the all-gather comes after it); in front of a row layer, that
    # layer's input (attention's output: this rank's heads side by side, C/t features). `features` says whether the
    # last dim is a slice of the dense layer's features (local < dense)
    shapes = [(walk["input"], None)] + [(lin["output"], lin["features"]) for lin in linears]
    for i, lin in enumerate(linears):
        shape, feats = shapes[i] if lin["kind"] == "column" else (lin["input"], lin["in_features"])
        seq.append({"type": "region", "label": BETWEEN[i], "shape": shape, "features": feats})
        comm = {"type": "comm", "at": lin["name"], "forward": lin["forward"], "backward": lin["backward"]}
        # under SP the row layer's reduce-scatter runs inside its forward, so its output (the box) is already a
        # sequence shard: say so in the label; the RS diamond after it marks the collective that made it
        inside = " + RS" if lin["kind"] == "row" and lin["forward"] == ["reduce_scatter"] else ""
        layer = {"type": "layer", "label": f"{lin['name']}\n({lin['kind']}{inside})", "shape": lin["output"],
                 "features": lin["features"]}
        seq += [comm, layer] if lin["kind"] == "column" else [layer, comm]
    seq.append({"type": "region", "label": BETWEEN[-1], "shape": walk["output"], "features": None})
    return seq


def _symbol(item: dict, b: int, s: int, h: int) -> str:
    """A real shape written against (B, T, C) and the TP size t: (2, 8, 64) with T = 32, t = 4 -> (B, T/t, C); a
    slice of a dense layer's 3C output features over the t ranks -> 3C/t (the real shape is printed above it)."""
    shape, feats = item["shape"], item["features"]
    tokens = "T" if shape[1] == s else "T/t"
    if feats and feats[0] < feats[1]:  # this rank's slice of the dense layer's features
        width = f"{feats[1] // h}C/t".replace("1C/", "C/")
    else:
        width = "C" if shape[2] == h else str(shape[2])
    return f"({'B' if shape[0] == b else shape[0]}, {tokens}, {width})"


def _comm_label(comm: dict) -> tuple[str, str]:
    fwd, bwd = comm["forward"], comm["backward"]
    name = {(): "f", ("all_reduce",): "g", ("all_gather",): "AG", ("reduce_scatter",): "RS"}.get(tuple(fwd), "")
    text = (f"fwd: {' + '.join(fwd) if fwd else 'identity'}\nbwd: {' + '.join(bwd) if bwd else 'identity'}")
    return name, text.replace("_", "-")


def draw_block(args: Settings, seq: list[dict], t: int, sequence_parallel: bool) -> str:
    """Draw the sequence left to right: grey = the full (B, T, C) on every rank, blue = a sequence shard,
    orange = split over features (heads, hidden units) but the whole sequence; diamonds = collectives."""
    plt = plot.pyplot()
    from matplotlib.patches import FancyBboxPatch, Polygon

    b, s, h = args.batch, args.seq, args.n_embd
    fig, ax = plt.subplots(figsize=(15, 3))
    colour = {"full": "#cccccc", "seq": "#8fb8de", "feat": "#f2b880"}
    x, kinds = 0.0, set()
    for item in seq:
        if item["type"] == "comm":
            name, text = _comm_label(item)
            ax.add_patch(Polygon([(x + 0.45, 1.6), (x + 0.9, 1.0), (x + 0.45, 0.4), (x, 1.0)], closed=True,
                                 color="#c0392b" if (item["forward"] or item["backward"]) else "white", ec="black"))
            ax.text(x + 0.45, 1.0, name, ha="center", va="center", fontsize=11, color="white", weight="bold")
            ax.text(x + 0.45, 0.3, text, ha="center", va="top", fontsize=7.5)
            x += 1.1
            continue
        shape = item["shape"]
        split = item["features"] and item["features"][0] < item["features"][1]
        kind = "feat" if split else ("seq" if shape[1] != s else "full")
        kinds.add(kind)
        width = 1.75
        ax.add_patch(FancyBboxPatch((x, 0.55), width, 0.9, boxstyle="round,pad=0.02", fc=colour[kind], ec="black",
                                    lw=1.5 if item["type"] == "layer" else 0.8))
        ax.text(x + width / 2, 1.12, item["label"], ha="center", va="center", fontsize=7.5)
        ax.text(x + width / 2, 0.72, _symbol(item, b, s, h), ha="center", va="center", fontsize=8, family="monospace")
        ax.text(x + width / 2, 1.55, str(tuple(shape)), ha="center", va="bottom", fontsize=7, color="#555555")
        x += width + 0.2
    used = [k for k in ("full", "seq", "feat") if k in kinds]  # only the colours the picture uses
    names = {"full": "(B, T, C): full size (the same on every rank, but a partial sum between a row layer and g)",
             "seq": f"(B, T/t, C): this rank's tokens, t={t}", "feat": f"whole sequence, this rank's features, t={t}"}
    handles = [plt.Rectangle((0, 0), 1, 1, fc=colour[k], ec="black") for k in used]
    ax.legend(handles, [names[k] for k in used], loc="upper center", ncol=3, fontsize=8,
              bbox_to_anchor=(0.5, 0.0), frameon=False)
    ax.set(xlim=(-0.1, x), ylim=(-0.2, 1.85),
           title=(f"one block under TP+SP, t={t}: all-gather before each column layer, reduce-scatter after each "
                  "row layer" if sequence_parallel else
                  f"one block under TP, t={t}: f before each column layer, g after each row layer"))
    ax.axis("off")
    name = "one_block_tensor_plus_sequence_parallel" if sequence_parallel else "one_block_tensor_parallel"
    return str(plot.save(fig, args, name))  # the name is its caption on the script page


def worker(ctx: RankContext, args: Settings) -> dict:
    cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=256)
    b, s, h, a = args.batch, args.seq, args.n_embd, args.n_head
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(ctx.device)
    results, eq_rows, mem_rows, comm_rows = {}, [], [], []
    for t in args.tp_sizes:
        group, g = tp_groups(t)
        gen = torch.Generator().manual_seed(args.seed * 1000 + g)
        idx = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=gen).to(ctx.device)
        x = torch.randn(b, s, h, generator=gen).to(ctx.device)
        eq = sp_equals_tp(model, group, idx[:, :-1], idx[:, 1:])
        mem = block_memory(model, group, x, t)
        f_dense = block_activation_bytes(b, s, h, a, 1)["bytes"]
        f_tp, f_sp = (block_activation_bytes(b, s, h, a, t, sequence_parallel=sp)["bytes"] for sp in (False, True))
        exact = ctx.backend == "gloo"  # the count assumes CPU's fused attention kernel; CUDA kernels save other extras
        checks = (("dense", mem["dense"], f_dense), ("TP", mem["tp"], f_tp), ("TP+SP", mem["tp_sp"], f_sp))
        for name, got, want in checks:
            if exact:
                report.expect_equal(f"t={t} {name} saved activation bytes vs formula", got, int(want))
        vol_tp, vol_sp = (layer_comm_volume(b, s, h, t, sequence_parallel=sp) for sp in (False, True))
        for label, evs, vol in (("TP", mem["events_tp"], vol_tp), ("TP+SP", mem["events_sp"], vol_sp)):
            for phase in ("forward", "backward"):
                got = [(op, n) for p, op, n in evs if p == phase]
                report.expect_equal(f"t={t} {label} {phase} collectives", str(got), str(vol[phase]))
        report.expect_equal(f"t={t} SP forward bytes sent == TP", vol_sp["forward_sent_per_rank"],
                            vol_tp["forward_sent_per_rank"])
        saving = mem["tp"] / mem["tp_sp"]
        eq_rows.append({"t": t, **eq})
        mem_rows.append({"t": t, "dense_B": mem["dense"], "TP_B": mem["tp"], "TP_formula_B": int(f_tp),
                         "TP+SP_B": mem["tp_sp"], "TP+SP_formula_B": int(f_sp), "TP/TP+SP": round(saving, 3),
                         "dense/TP+SP": round(mem["dense"] / mem["tp_sp"], 3)})
        comm_rows.append({"t": t, "TP_fwd_sent_B": int(vol_tp["forward_sent_per_rank"]),
                          "SP_fwd_sent_B": int(vol_sp["forward_sent_per_rank"]),
                          "TP_bwd_sent_B": int(vol_tp["backward_sent_per_rank"]),
                          "SP_bwd_sent_B": int(vol_sp["backward_sent_per_rank"])})
        walks = {label: walk_block(model.h[0], group, x, t, sp) for label, sp in (("TP", False), ("TP+SP", True))}
        results[str(t)] = {**eq, "drawn": {label: block_sequence(w) for label, w in walks.items()},
                           "saved_bytes_dense": mem["dense"], "saved_bytes_tp": mem["tp"],
                           "saved_bytes_tp_sp": mem["tp_sp"], "formula_tp": f_tp, "formula_tp_sp": f_sp,
                           "formula_dense": f_dense, "saving_tp_over_sp": saving, **comm_rows[-1],
                           "counted": {label: {phase: [[op, n] for p, op, n in evs if p == phase]
                                               for phase in ("forward", "backward")}
                                       for label, evs in (("TP", mem["events_tp"]), ("TP+SP", mem["events_sp"]))}}
    ctx.print(f"GPT {cfg.n_layer} layers, H={a} heads, C={h}; one block's input (B, T, C) = ({b}, {s}, {h}), "
              f"float32 (in table 2's paper letters: a={a}, h={h}, b={b}, s={s})")
    ctx.print("1. TP+SP against TP and against the dense model (max abs error):")
    ctx.print(report.table(eq_rows, floatfmt=".1e"))
    ctx.print("2. bytes saved for backward by ONE block on one rank (measured with saved_tensors_hooks; formula: "
              "4*(sbh*(4+12/t) + 4sb + a*sb/t) for TP, 4*(sbh*16/t + 4sb/t + a*sb/t) for TP+SP):")
    ctx.print(report.table(mem_rows))
    ctx.print("3. ring bytes one rank sends per block (layer_comm_volume; counted collectives matched it):")
    ctx.print(report.table(comm_rows))
    drawn_t = max(args.tp_sizes)
    if ctx.rank == 0 and drawn_t > 1:
        for label, sp in (("TP", False), ("TP+SP", True)):
            ctx.print(f"figure: {draw_block(args, results[str(drawn_t)]['drawn'][label], drawn_t, sp)}")
    return {"tp": results, "exact_memory_check": ctx.backend == "gloo"}


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "tp_sizes": [1, 2], "n_layer": 1, "n_embd": 32,
                                               "batch": 2, "seq": 16},
                     world_sizes=range(1, 9), world_sizes_text="1..8 (divisible by every --tp-sizes value)")
    result = launch(worker, args)
    if result is None:
        return 0
    print("OK: TP+SP equals TP and the dense model; saved activations match the formula")
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
