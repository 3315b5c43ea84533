"""Attention with its heads split across ranks, a full transformer block, and the tiny GPT under tensor parallelism.

What it shows
    For every tensor-parallel size t in --tp-sizes, the W ranks form W/t groups of t consecutive ranks (TP inside a
    group, different data per group, as in a DP x TP job); inside each group:
    1. attention: rank r computes heads [r*H/t, (r+1)*H/t) and c_proj sums them: equals mlsys.model's attention;
    2. one block (LayerNorm, attention, LayerNorm, MLP): output and input gradient equal the dense block's, and the
       collectives counted in it match layer_comm_volume: 2 all-reduces of B*T*C*4 bytes forward, 2 backward;
    3. the tiny GPT (vocab-parallel tied embedding/head, padded to a multiple of t): logits, loss and EVERY
       parameter gradient equal the dense GPT's (each rank's shard against the same slice of the dense gradient).
    Sizes that do not divide (e.g. --n-head 3 with t=2) stop with a one-line error and exit code 2.

How to run
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_transformer.py -w 4 --tp-sizes 1 2 4
    torchrun --nproc-per-node 4 tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_transformer.py

Prints, per t, the worst error of each check, the collectives of one block and of the whole GPT step, and the
ring bytes one rank sends per block, forward and backward together. Runtime on 2 cores: about 5 s with 4 ranks;
--smoke (2 ranks) about 3 s.

Try next
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_transformer.py -w 4 --tp-sizes 2
        -> two groups, ranks {0, 1} and {2, 3}, each on its own batch: a 2-way data x 2-way tensor parallel job
    python tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_transformer.py -w 4 --tp-sizes 4 --n-head 2
        -> 2 heads cannot be split over 4 ranks: a one-line usage error, exit 2
    torchrun --nproc-per-node 4 tutorial/part2-parallelism/chapter06-tensor-parallel/scripts/tp_transformer.py --seq 64
        -> twice the tokens: the per-block bytes double, the number of collectives does not change
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from mlsys import cli, report
from mlsys.launch import RankContext, launch
from mlsys.model import GPT, GPTConfig
from mlsys.tensor_parallel import (
    TPAttention,
    TPBlock,
    check_tp_run,
    comm_log,
    grads_as_model,
    layer_comm_volume,
    shard_gpt,
    tp_groups,
)


@dataclass
class Settings(cli.DistArgs):
    world_size: int = 4
    """Number of ranks; every tensor-parallel size must divide it. Under torchrun it is taken from WORLD_SIZE."""
    tp_sizes: list[int] = field(default_factory=lambda: [1, 2, 4])
    """Tensor-parallel sizes to check, each dividing the world size."""
    n_layer: int = 2
    """Blocks in the GPT."""
    n_head: int = 4
    """Attention heads; must be divisible by every tensor-parallel size."""
    n_embd: int = 64
    """Model width C; must be divisible by n_head and by every tensor-parallel size."""
    batch: int = 2
    """Sequences per group."""
    seq: int = 32
    """Tokens per sequence."""

    def validate(self) -> None:
        try:
            check_tp_run(self.config(), self.world_size, self.tp_sizes, self.batch, self.seq)
        except ValueError as err:
            raise cli.UsageError(str(err)) from None

    def config(self) -> GPTConfig:
        return GPTConfig(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd, block_size=256)


def max_err(a: torch.Tensor, b: torch.Tensor, name: str) -> float:
    report.expect_close(name, a.detach(), b.detach(), rtol=1e-4, atol=2e-5)
    return float((a.detach() - b.detach()).abs().max())


def check_attention_and_block(model: GPT, group, x: torch.Tensor) -> dict:
    """x (B, T, C): the first block's attention and the whole block, TP against dense, outputs and input grads."""
    dense_block = model.h[0]
    tp_attn = TPAttention(dense_block.attn, group)
    out = {"attention": max_err(tp_attn(x), dense_block.attn(x), "attention output")}

    tp_block = TPBlock(dense_block, group)
    x_tp, x_ref = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    with comm_log() as log:
        y = tp_block(x_tp)  # (B, T, C), the same on every rank of the group
        y.square().mean().backward()
    y_ref = dense_block(x_ref)
    y_ref.square().mean().backward()
    out["block_output"] = max_err(y, y_ref, "block output")
    out["block_input_grad"] = max_err(x_tp.grad, x_ref.grad, "block input grad")
    model.zero_grad()
    out["block_events"] = [(e.phase, e.op, e.nbytes) for e in log]
    return out


# --8<-- [start:gpt_check]
def check_gpt(model: GPT, group, idx: torch.Tensor, targets: torch.Tensor) -> dict:
    """Logits, loss and every parameter gradient of the TP GPT against the dense GPT."""
    tp_model = shard_gpt(model, group)
    with comm_log() as log:
        logits, loss = tp_model(idx, targets)  # logits (B, T, V) on every rank of the group
        loss.backward()
    ref_logits, ref_loss = model(idx, targets)
    ref_loss.backward()
    out = {"logits": max_err(logits, ref_logits, "GPT logits"), "loss": max_err(loss, ref_loss, "GPT loss")}
    # the dense gradients, sharded exactly like the weights were: what each rank's .grad must equal
    expected = dict(shard_gpt(grads_as_model(model), group).named_parameters())
    worst, where = 0.0, ""
    for name, p in tp_model.named_parameters():
        err = max_err(p.grad, expected[name], f"grad of {name}")
        worst, where = max(worst, err), where if err < worst else name
    out.update(param_grads=worst, worst_param=where, n_params_checked=len(expected),
               gpt_events=Counter(f"{e.phase} {e.op}" + (" (param grad)" if e.tag == "param_grad" else "")
                                  for e in log))
    # what the TP model produced, for a test to hold against its own dense run: logits, loss, and the gradients of
    # the LayerNorms (kept whole on every rank; they depend on the whole TP backward above them)
    out["observed"] = {"logits": logits.tolist(), "loss": loss.item(), "layer_norm_grads": {
        name: p.grad.tolist() for name, p in tp_model.named_parameters() if "ln_" in name}}
    return out
# --8<-- [end:gpt_check]


def worker(ctx: RankContext, args: Settings) -> dict:
    cfg = args.config()
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(ctx.device)  # identical on every rank: same seed
    results, lines = {}, []
    for t in args.tp_sizes:
        group, g = tp_groups(t)
        gen = torch.Generator().manual_seed(args.seed * 1000 + g)  # one batch per group
        idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen).to(ctx.device)
        x = torch.randn(args.batch, args.seq, cfg.n_embd, generator=gen).to(ctx.device)
        res = {**check_attention_and_block(model, group, x), **check_gpt(model, group, idx[:, :-1], idx[:, 1:])}
        model.zero_grad()
        formula = layer_comm_volume(args.batch, args.seq, cfg.n_embd, t)
        measured = {ph: [(op, n) for p, op, n in res["block_events"] if p == ph] for ph in ("forward", "backward")}
        report.expect_equal(f"t={t} block forward collectives", str(measured["forward"]), str(formula["forward"]))
        report.expect_equal(f"t={t} block backward collectives", str(measured["backward"]), str(formula["backward"]))
        res.update(block_forward=measured["forward"], block_backward=measured["backward"],
                   forward_sent_per_rank=formula["forward_sent_per_rank"],
                   backward_sent_per_rank=formula["backward_sent_per_rank"], groups=ctx.world_size // t)
        res["gpt_events"] = dict(res["gpt_events"])
        res.pop("block_events")
        results[str(t)] = res
        lines.append({"t": t, "groups": ctx.world_size // t, "attention": res["attention"],
                      "block_out": res["block_output"], "block_dx": res["block_input_grad"],
                      "logits": res["logits"], "loss": res["loss"], "param_grads": res["param_grads"],
                      "block_fwd": f"{len(measured['forward'])} all-reduce",
                      "block_bwd": f"{len(measured['backward'])} all-reduce",
                      "ring_B_sent/rank/block (fwd+bwd)": int(res["forward_sent_per_rank"]
                                                        + res["backward_sent_per_rank"])})
    ctx.print(f"tiny GPT: {cfg.n_layer} layers, {cfg.n_head} heads, C={cfg.n_embd}, V={cfg.vocab_size}; "
              f"batch {args.batch} x {args.seq} tokens per group; max abs error against the dense model:")
    ctx.print(report.table(lines, floatfmt=".1e"))
    for t in args.tp_sizes:
        events = ", ".join(f"{n} {k}" for k, n in sorted(results[str(t)]["gpt_events"].items()))
        ctx.print(f"t={t}: one GPT training step ran {events or 'no collectives'}")
    return {"tp": results, "activation_bytes": args.batch * args.seq * cfg.n_embd * 4}


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "tp_sizes": [1, 2], "n_layer": 1, "seq": 8},
                     world_sizes=range(1, 9), world_sizes_text="1..8 (divisible by every --tp-sizes value)")
    result = launch(worker, args)
    if result is None:
        return 0
    print(f"OK: attention, block and GPT under TP equal the dense model (outputs and gradients) for t in "
          f"{args.tp_sizes}")
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
