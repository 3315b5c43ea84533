"""What each rank of a tensor-parallel GPT holds and sends, read from the shards and the collectives' log.

What it shows
    The tiny GPT is sharded over the W ranks (t = W). Every rank locates its shards in the dense weights (each row
    must match exactly one row of the dense matrix), looks up a real batch of token ids with its slice of the
    vocabulary, and runs one training step with every collective logged and tagged with the layer that ran it.
    Rank 0 prints and draws what the ranks reported:
    heads.png   which heads each rank computes: the rows of the fused c_attn (q, k, v) and the columns of c_proj
                it holds, located in the dense weights; below, for contrast, a plain contiguous cut of c_attn;
    vocab_parallel_embedding_lookup.png
                which rows of the (padded) token table each rank holds, the batch's token ids each rank looked up
                (a zero vector for all others), and their sum, the all-reduce g, equal to the dense lookup;
    collectives_per_layer_one_step.png
                the bytes of every collective of the training step, per layer and direction, from comm_log.
    Self-checks: each shard is a slice of the dense weight; the summed lookup equals the dense embedding; the
    step's loss equals the dense GPT's.

How to run
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_shards.py
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_shards.py -w 4 --batch 1 --seq 8

Prints three tables (heads, vocabulary rows, collectives per layer) and the token ids of the first sequence with
the rank that looked each up. Runtime on 2 cores: about 6 s; --smoke about 5 s.

Try next
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_shards.py -w 4
        -> one head per rank; the collectives per layer are the same, and so are their bytes
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_shards.py -w 5 --n-head 5 --n-embd 40
        -> five ranks, one head each; 47 token ids padded to 50: the last rank's 10 rows end in 3 zero rows
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_shards.py --seq 64
        -> twice the tokens: every all-reduce doubles; the logits' all-gather too
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.launch import RankContext, launch
from mlsys.model import GPT, GPTConfig
from mlsys.tensor_parallel import check_tp_run, comm_log, reduce_from_tp, shard_gpt


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    n_layer: int = 2
    """Blocks in the GPT."""
    n_head: int = 4
    """Attention heads; must be divisible by the world size (the tensor-parallel size)."""
    n_embd: int = 64
    """Model width C; must be divisible by n_head and by the world size."""
    batch: int = 2
    """Sequences in the batch."""
    seq: int = 32
    """Tokens per sequence."""

    def validate(self) -> None:
        try:
            check_tp_run(self.config(), self.world_size, [self.world_size], self.batch, self.seq)
        except ValueError as err:
            raise cli.UsageError(str(err)) from None

    def config(self) -> GPTConfig:
        return GPTConfig(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd, block_size=256)


def max_err(a: torch.Tensor, b: torch.Tensor, name: str) -> float:
    report.expect_close(name, a.detach(), b.detach(), rtol=1e-4, atol=2e-5)
    return float((a.detach() - b.detach()).abs().max())


# ----------------------------------------------------------------------------------------------- what the ranks hold
def match_rows(shard: torch.Tensor, dense: torch.Tensor) -> list[int]:
    """For each row of `shard`, the index of the row of `dense` equal to it; each must equal exactly one."""
    equal = (shard.detach()[:, None, :] == dense.detach()[None, :, :]).all(-1)  # (shard rows, dense rows)
    if not bool((equal.sum(1) == 1).all()):
        raise cli.SelfCheckFailed(f"a row of the {tuple(shard.shape)} shard is not exactly one row of the dense weight")
    return equal.int().argmax(1).tolist()


def as_runs(ids: list[int]) -> list[list[int]]:
    """Sorted indices as [lo, hi) runs: [0, 1, 2, 8, 9] -> [[0, 3], [8, 10]]."""
    out: list[list[int]] = []
    for i in sorted(ids):
        if out and out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([i, i + 1])
    return out


def held_by_this_rank(model: GPT, group, idx: torch.Tensor) -> dict:
    """The heads and vocabulary rows this rank holds, located in the dense weights, and its masked lookup of idx."""
    tp = shard_gpt(model, group)
    attn, dense_attn = tp.h[0].attn, model.h[0].attn
    heads = {"c_attn_rows": as_runs(match_rows(attn.c_attn.weight, dense_attn.c_attn.weight)),  # (3C/t, C) in (3C, C)
             "c_proj_cols": as_runs(match_rows(attn.c_proj.weight.T, dense_attn.c_proj.weight.T))}  # columns of (C, C)
    shard, dense = tp.wte.weight.detach(), model.wte.weight.detach()  # (V_pad/t, C) and (V, C)
    n, t = shard.shape[0], dist.get_world_size(group)
    padded = torch.cat([dense, dense.new_zeros(n * t - dense.shape[0], dense.shape[1])])  # zero rows up to n*t
    lo = next((lo for lo in range(0, n * t, n) if torch.equal(padded[lo:lo + n], shard)), None)
    if lo is None:
        raise cli.SelfCheckFailed("this rank's embedding shard is none of the row blocks of the padded table")
    with torch.no_grad():
        partial = tp.wte(idx)  # (B, T, C): this rank's rows, zeros for every token another rank owns
        summed = reduce_from_tp(partial, group)  # g: the sum over the ranks of the group
    return {"heads": heads, "vocab_rows": [lo, lo + n], "padding_rows": max(0, lo + n - dense.shape[0]),
            "looked_up": (partial != 0).any(-1).int().tolist(),
            "sum_vs_dense": max_err(summed, model.wte(idx), "sum of the partial embeddings vs the dense lookup")}


@contextlib.contextmanager
def layer_marks(tp_model, log: list):
    """Mark in `log` where each layer begins: forward, when the module is called; backward, when the gradient of
    its output arrives (a hook on that tensor). A collective belongs to the last layer marked before it in its
    direction; backward reaches the head first and the embedding last."""
    marks: dict[str, list] = {"forward": [], "backward": []}
    layers = [("embedding", tp_model.wte)]  # its g runs in TPGPT.embed, after the lookup: still marked embedding
    layers += [(f"block {i} {part}", getattr(b, part)) for i, b in enumerate(tp_model.h) for part in ("attn", "mlp")]
    layers.append(("head", tp_model.lm_head))  # the tied, vocab-parallel output layer and its all-gather

    def on_output(name):
        def hook(module, inputs, out):
            out.register_hook(lambda grad: marks["backward"].append((len(log), name)))
        return hook

    handles = []
    for name, module in layers:
        handles.append(module.register_forward_pre_hook(
            lambda m, a, name=name: marks["forward"].append((len(log), name))))
        handles.append(module.register_forward_hook(on_output(name)))
    try:
        yield marks
    finally:
        for h in handles:
            h.remove()


def comm_by_layer(model: GPT, group, idx: torch.Tensor, targets: torch.Tensor) -> list[dict]:
    """One training step of the sharded GPT; every collective comm_log recorded, with the layer that ran it."""
    tp_model = shard_gpt(model, group)
    with comm_log() as log, layer_marks(tp_model, log) as marks:
        _, loss = tp_model(idx, targets)
        loss.backward()
    max_err(loss, model(idx, targets)[1], "loss of the sharded GPT vs the dense GPT")
    rows = []
    for i, e in enumerate(log):
        layer = "(before the first layer)"
        for start, name in marks[e.phase]:
            if start <= i:
                layer = name
        rows.append({"phase": e.phase, "layer": layer, "op": e.op, "bytes": e.nbytes})
    return rows


def worker(ctx: RankContext, args: Settings) -> dict:
    cfg = args.config()
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(ctx.device)  # identical on every rank: same seed
    gen = torch.Generator().manual_seed(args.seed)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen).to(ctx.device)
    group = dist.group.WORLD
    mine = held_by_this_rank(model, group, idx[:, :-1])
    every = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    drawn = {"t": ctx.world_size, "n_head": cfg.n_head, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
             "vocab_size": cfg.vocab_size, "batch": args.batch, "seq": args.seq, "idx": idx[:, :-1].tolist(),
             "ranks": every, "comm_by_layer": comm_by_layer(model, group, idx[:, :-1], idx[:, 1:])}
    ctx.print(f"tiny GPT: {cfg.n_layer} layers, {cfg.n_head} heads, C={cfg.n_embd}, V={cfg.vocab_size}, sharded over "
              f"t={ctx.world_size} ranks; batch {args.batch} x {args.seq} tokens")
    if ctx.is_main:
        print_held(ctx, drawn)
        for draw in (draw_heads, draw_vocab, draw_comm):
            ctx.print(f"figure: {draw(args, drawn)}")
    return drawn


def print_held(ctx: RankContext, d: dict) -> None:
    """The three tables the figures draw: heads per rank, vocabulary rows per rank, collectives per layer."""
    C, H, V = d["n_embd"], d["n_head"], d["vocab_size"]
    D = C // H
    ctx.print(f"\nHeads: rows of the dense c_attn (q 0:{C}, k {C}:{2 * C}, v {2 * C}:{3 * C}) and columns of "
              f"c_proj each rank holds (D={D} rows or columns per head):")
    rows = []
    for r, rk in enumerate(d["ranks"]):
        heads = sorted({row % C // D for lo, hi in rk["heads"]["c_attn_rows"] for row in range(lo, hi)})
        rows.append({"rank": r, "heads": ", ".join(map(str, heads)),
                     "c_attn rows": ", ".join(f"{lo}:{hi}" for lo, hi in rk["heads"]["c_attn_rows"]),
                     "c_proj columns": ", ".join(f"{lo}:{hi}" for lo, hi in rk["heads"]["c_proj_cols"])})
    ctx.print(report.table(rows))
    n_tokens = sum(map(len, d["idx"]))
    pad = d["ranks"][-1]["vocab_rows"][1]
    ctx.print(f"\nVocabulary: V={V} padded to {pad}; rows of the padded table each rank holds, and how many of "
              f"the batch's {n_tokens} token ids it looked up:")
    ctx.print(report.table([{"rank": r, "rows": f"{rk['vocab_rows'][0]}:{rk['vocab_rows'][1]}",
                             "zero padding rows": rk["padding_rows"],
                             "looked up": sum(map(sum, rk["looked_up"]))} for r, rk in enumerate(d["ranks"])]))
    ids = d["idx"][0][:16]
    owner = [next(r for r, rk in enumerate(d["ranks"]) if rk["looked_up"][0][i]) for i in range(len(ids))]
    ctx.print("sequence 0" + (", first 16 tokens" if len(d["idx"][0]) > 16 else "") + ":\n  token id  "
              + " ".join(f"{i:>2}" for i in ids) + "\n  rank      " + " ".join(f"{r:>2}" for r in owner))
    ctx.print(f"sum over the ranks (the all-reduce g) vs the dense embedding: max abs error "
              f"{max(rk['sum_vs_dense'] for rk in d['ranks']):.1e}")
    ctx.print("\nCollectives of one training step on rank 0, per layer (from comm_log; bytes of the full buffer):")
    table = {}
    for e in d["comm_by_layer"]:
        row = table.setdefault(e["layer"], {"layer": e["layer"], "forward": "-", "backward": "-"})
        row[e["phase"]] = f"{e['op']} {e['bytes']:,} B"
    ctx.print(report.table(list(table.values())) if table else "  (none: t=1)")


# ----------------------------------------------------------------------------------------------- the figures
def rank_colours(t: int) -> list:
    return list(plot.colours(f"rank {r}" for r in range(t)).values())


def draw_heads(args: Settings, d: dict):
    """A grid, heads left to right: the q, k and v rows of c_attn and the c_proj columns, each cell in the colour
    of the rank whose shard holds it (read from the located rows); below, a plain chunk of c_attn for contrast."""
    from matplotlib.patches import Patch, Rectangle

    plt = plot.pyplot()
    t, C, H = d["t"], d["n_embd"], d["n_head"]
    D, colours = C // H, rank_colours(t)
    owner = {}
    for r, rk in enumerate(d["ranks"]):
        for lo, hi in rk["heads"]["c_attn_rows"]:
            owner.update({(row // C, row % C // D): r for row in range(lo, hi)})  # (q|k|v, head)
        for lo, hi in rk["heads"]["c_proj_cols"]:
            owner.update({(3, col // D): r for col in range(lo, hi)})
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * H + 3), 4.2))
    names = ["q rows of c_attn", "k rows of c_attn", "v rows of c_attn", "c_proj columns (head output)"]
    for part, name in enumerate(names):
        y = 5 - part
        ax.text(-0.1, y + 0.4, name, ha="right", va="center", fontsize=9)
        for h in range(H):
            lo = part * C + h * D if part < 3 else h * D
            ax.add_patch(Rectangle((h, y), 0.95, 0.8, color=colours[owner[(part, h)]], alpha=0.75))
            ax.text(h + 0.475, y + 0.4, f"head {h}\n{lo}:{lo + D}", ha="center", va="center", fontsize=8)
    per = 3 * C // t  # a plain contiguous cut of the 3C rows, the layout chunks=3 avoids
    ax.text(-0.1, 0.4, f"not used: c_attn's {3 * C} rows\ncut into {t} plain chunks", ha="right", va="center",
            fontsize=9, color="0.3")
    for part in range(3):
        for h in range(H):
            x = (part * H + h) / 3
            ax.add_patch(Rectangle((x, 0), 1 / 3 - 0.03, 0.8, facecolor=colours[(part * C + h * D) // per],
                                   alpha=0.35, hatch="//", edgecolor="white"))
            ax.text(x + 1 / 6, 0.4, "qkv"[part] + str(h), ha="center", va="center", fontsize=7)
    ax.legend(handles=[Patch(color=c, alpha=0.75, label=f"rank {r}") for r, c in enumerate(colours)],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)
    ax.set(xlim=(-0.05, H + 0.05), ylim=(-0.3, 6), title=f"Which heads each rank computes, t={t}, H={H} "
           f"(D={D} rows per head), read from its shards")
    ax.axis("off")
    return plot.save(fig, args, "heads")


def draw_vocab(args: Settings, d: dict):
    """Top: the padded vocabulary, each row in its owner's colour. Then one grid of the batch's token ids per rank,
    coloured where that rank looked the id up (zeros elsewhere), and their sum, the all-reduce g."""
    from matplotlib.patches import Rectangle

    plt = plot.pyplot()
    t, V, idx, ranks = d["t"], d["vocab_size"], d["idx"], d["ranks"]
    B, T, colours = len(idx), len(idx[0]), rank_colours(t)
    v_pad = ranks[-1]["vocab_rows"][1]
    fig, axes = plt.subplots(t + 2, 1, figsize=(max(8, 0.3 * T + 2), 1.2 + (t + 1) * (0.3 * B + 0.7)),
                             gridspec_kw={"height_ratios": [1.2] + [0.3 * B + 0.4] * (t + 1)})
    ax = axes[0]
    used = {i for row in idx for i in row}
    for r, rk in enumerate(ranks):
        lo, hi = rk["vocab_rows"]
        for i in range(lo, hi):
            ax.add_patch(Rectangle((i, 0), 1, 1, facecolor=colours[r] if i < V else "0.85", alpha=0.75,
                                   hatch="" if i < V else "xx", edgecolor="white"))
        ax.text((lo + hi) / 2, 1.15, f"rank {r}: rows {lo}:{hi}", ha="center", va="bottom", fontsize=8)
    ax.plot([i + 0.5 for i in sorted(used)], [-0.25] * len(used), "k^", markersize=4)
    ax.set(xlim=(0, v_pad), ylim=(-0.6, 1.9), title=f"Vocabulary rows of the token table, V={V} padded to "
           f"{v_pad} (hatched: zero rows); triangles: the ids in this batch")
    ax.axis("off")
    panels = [(f"rank {r}: looks up the ids in rows {rk['vocab_rows'][0]}:{rk['vocab_rows'][1]}, writes a zero "
               f"vector (blank) for the others ({sum(map(sum, rk['looked_up']))} of {B * T})", [rk["looked_up"]], [r])
              for r, rk in enumerate(ranks)]
    panels.append((f"after the all-reduce g: the sum of the {t} partial embeddings, equal to the dense lookup "
                   f"(max abs error {max(rk['sum_vs_dense'] for rk in ranks):.0e})",
                   [rk["looked_up"] for rk in ranks], list(range(t))))
    for ax, (title, masks, who) in zip(axes[1:], panels):
        for b in range(B):
            for i in range(T):
                hit = [r for m, r in zip(masks, who) if m[b][i]]
                ax.add_patch(Rectangle((i, B - 1 - b), 0.95, 0.9, color=colours[hit[0]] if hit else "white",
                                       alpha=0.75, ec="0.7", lw=0.5))
                if hit:
                    ax.text(i + 0.475, B - 1 - b + 0.45, idx[b][i], ha="center", va="center", fontsize=7)
        ax.set(xlim=(0, T), ylim=(0, B), title=title)
        ax.title.set_fontsize(9)
        ax.axis("off")
    fig.tight_layout()
    return plot.save(fig, args, "vocab_parallel_embedding_lookup")  # the name is its caption on the script page


def draw_comm(args: Settings, d: dict):
    """Bars: the bytes of each collective comm_log recorded in one training step, per layer, forward and backward."""
    plt = plot.pyplot()
    layers = list(dict.fromkeys(e["layer"] for e in d["comm_by_layer"]))
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(layers) + 2), 3.6))
    palette = plot.colours(["forward", "backward"])
    for k, phase in enumerate(("forward", "backward")):
        for x, layer in enumerate(layers):
            bottom, xk = 0, x + (k - 0.5) * 0.38
            for e in (e for e in d["comm_by_layer"] if e["layer"] == layer and e["phase"] == phase):
                ax.bar(xk, e["bytes"] / 1024, 0.36, bottom=bottom, color=palette[phase], edgecolor="black", lw=0.5,
                       label=phase)
                ax.text(xk, bottom + e["bytes"] / 2048, e["op"].replace("_", "-"), rotation=90, ha="center",
                        va="center", fontsize=7)
                bottom += e["bytes"] / 1024
            if not bottom:
                ax.text(xk, 0.2, "none", rotation=90, ha="center", va="bottom", fontsize=7, color="0.4")
    n = d["batch"] * d["seq"] * d["n_embd"] * 4 / 1024
    ax.axhline(n, color="black", ls=":", lw=1)
    ax.text(0.5, n * 1.02, f"N = B·T·C·4 bytes = {n:g} KiB", va="bottom", ha="center", fontsize=8)
    ax.set_ylim(0, n * 1.2)
    ax.set_xticks(range(len(layers)), layers, fontsize=8)
    ax.set(ylabel="KiB per collective", xlabel="layer, in forward order (backward visits them right to left)",
           title=f"Collectives of one training step on rank 0, t={d['t']}, from comm_log")
    if not layers:
        ax.text(0.5, 0.5, "no collectives at t=1", ha="center", va="center", transform=ax.transAxes)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        by_label = dict(zip(labels, handles))
        ax.legend(by_label.values(), by_label.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  frameon=False)
    fig.tight_layout()
    return plot.save(fig, args, "collectives_per_layer_one_step")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"n_layer": 1, "seq": 8},
                     world_sizes=range(1, 9), world_sizes_text="1..8 (dividing --n-head and --n-embd)")
    result = launch(worker, args)
    if result is None:
        return 0
    print("OK: every shard is a slice of the dense weights, the summed lookup is the dense embedding, and the "
          "step's loss is the dense GPT's")
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
