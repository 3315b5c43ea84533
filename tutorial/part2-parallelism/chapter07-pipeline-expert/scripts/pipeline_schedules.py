"""GPipe and 1F1B, run for real: the tiny GPT cut into W stages, micro-batches over send/recv, one AdamW step.

What it shows
    ORACLE    every rank builds the same GPT from the seed and keeps one stage (mlsys.pipeline.split_gpt). The
              batch of B = m x b sequences is cut into m micro-batches; each schedule runs forward and backward
              over them, activations forward with isend/recv and their gradients backward the same way, then
              every stage takes one AdamW step. Each rank also trains the whole model in one process on the
              whole batch, and checks that its stage's gradients match (rtol 1e-4, atol 1e-6 in float32;
              with --double, float64, rtol 1e-10, atol 1e-12), and its updated parameters within what those gradient
              differences can move a weight through the AdamW step (step_tolerance: a gradient near 0 may flip).
    ORDER     the order of operations of every stage, e.g. F0 F1 B0 F2 B1 ... for 1F1B.
    MEMORY    how many micro-batches each stage holds between their forward and their backward (their saved
              activations), counted while the schedule runs, and the bytes autograd kept for them (saved-tensor
              hooks, parameters excluded). GPipe holds all m; 1F1B holds at most p - s on stage s.
    FIGURES   ideal_schedules.png: the orders the stages just ran, replayed on an ideal clock (a forward takes 1
              tick, a backward 2, messages none), one row per stage, each box labelled with its micro-batch;
              fill_drain.gif (+ fill_drain_strip.png): the same two timelines growing tick by tick, the pipeline
              filling and draining. Both into --plot-dir; the boxes drawn are in the JSON under "ideal".

How to run (world size 1..8, at most --layers)
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/pipeline_schedules.py -w 4 --micro-batches 8
    torchrun --nproc-per-node 4 \\
        tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/pipeline_schedules.py --micro-batches 8

Runtime on 2 cores: about 8 s with the defaults (-w 4 --micro-batches 8, 3 s of it drawing) on a quiet machine
(7.5 s in a book build), about 19 s at load 5 to 6 (other programs sharing the cores) and more under heavier
load; 6 s with --smoke.

Try next
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/pipeline_schedules.py --micro-batches 2
        -> fewer micro-batches than stages: 1F1B's warm-up is capped at m, both schedules still match one process
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/pipeline_schedules.py --double
        -> float64: the differences from the one-process reference shrink to float64 rounding (the tests ask < 1e-12)
    torchrun --nproc-per-node 2 \\
        tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/pipeline_schedules.py --micro-batches 4
        -> two stages under torchrun; stage 0 holds at most 2 micro-batches under 1F1B, 4 under GPipe
"""

from __future__ import annotations

from dataclasses import dataclass

import _schedules as zs
import torch
import torch.distributed as dist

from mlsys import cli, plot, report
from mlsys.data import Tokenizer, get_batch, make_corpus
from mlsys.launch import RankContext, launch
from mlsys.model import GPT, GPTConfig
from mlsys.pipeline import max_in_flight, run_pipeline_step, split_gpt
from mlsys.train import configure_optimizer

ADAM_EPS = 1e-8  # torch.optim.AdamW's default eps, which configure_optimizer keeps


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    world_size: int = 4
    """Number of ranks = pipeline stages p. Under torchrun it is taken from WORLD_SIZE."""
    micro_batches: int = 8
    """m, micro-batches per step."""
    micro_batch_size: int = 2
    """b, sequences per micro-batch."""
    layers: int = 4
    """Transformer blocks in the GPT (spread as evenly as possible over the stages)."""
    seq_len: int = 32
    """Tokens per sequence."""
    lr: float = 1e-3
    """AdamW learning rate for the one optimizer step."""
    double: bool = False
    """Run in float64, where pipeline and one process agree to ~1e-12."""

    def validate(self) -> None:
        if self.world_size > self.layers:
            raise cli.UsageError(f"-w {self.world_size} stages need at least as many --layers, got {self.layers}")
        if min(self.micro_batches, self.micro_batch_size, self.seq_len) < 1:
            raise cli.UsageError("--micro-batches, --micro-batch-size and --seq-len must be at least 1")
        if self.seq_len > 64:
            raise cli.UsageError(f"--seq-len must be <= 64 (the tiny GPT's block size), got {self.seq_len}")
        if not self.lr >= 0:
            raise cli.UsageError(f"--lr must be >= 0, got {self.lr}")


def build(args: Settings) -> tuple[GPT, list[torch.Tensor], list[torch.Tensor]]:
    """The seeded model and the m micro-batches (b, T) of inputs and targets, identical on every rank."""
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig.preset("tiny", n_layer=args.layers))
    if args.double:
        model = model.double()
    tokens = Tokenizer().encode_corpus(make_corpus(200, args.seed))
    gen = torch.Generator().manual_seed(args.seed)
    x, y = get_batch(tokens, args.micro_batches * args.micro_batch_size, args.seq_len, gen)  # (B, T) each
    return model, list(x.chunk(args.micro_batches)), list(y.chunk(args.micro_batches))


def reference_step(model: GPT, xs: list, ys: list, lr: float) -> tuple[GPT, float]:
    """The oracle: the whole model, the whole batch, one process, one backward, one AdamW step."""
    opt = configure_optimizer(model, lr=lr, weight_decay=0.1)
    _, loss = model(torch.cat(xs), torch.cat(ys))  # mean over all B*T tokens
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    grads["lm_head.weight"] = grads["wte.weight"]  # tied: one matrix, one gradient
    opt.step()
    model.grads = grads  # kept for the comparison below
    return model, float(loss.detach())


def pipeline_step(model: GPT, xs: list, ys: list, schedule: str, lr: float) -> tuple[torch.nn.Module, dict]:
    """This rank's stage after one pipelined step; its gradients are kept in stage.grads."""
    stages = split_gpt(model, dist.get_world_size())
    stage = stages[dist.get_rank()]
    opt = configure_optimizer(stage, lr=lr, weight_decay=0.1)
    ranks = list(range(dist.get_world_size()))  # stage s on global rank s
    out = run_pipeline_step(stage, ranks, xs, ys, schedule=schedule)
    stage.grads = {name: p.grad.clone() for name, p in stage.named_parameters()}
    opt.step()
    return stage, out


def compare(stage, ref: GPT) -> tuple[float, float]:
    """Largest |difference| of gradients and of updated parameters between a stage and the same layers of ref."""
    dgrad = dparam = 0.0
    for name, p in stage.named_parameters():
        full = stage.global_name(name)
        dgrad = max(dgrad, float((stage.grads[name] - ref.grads[full]).abs().max()))
        dparam = max(dparam, float((p.detach() - ref.get_parameter(full).detach()).abs().max()))
    return dgrad, dparam


def step_tolerance(grad: torch.Tensor, rtol: float, atol: float, lr: float) -> torch.Tensor:
    """Per weight: how far ONE AdamW step from the same weights may move it apart, when the gradients may differ by
    d = atol + rtol |g| (what the gradient check allows). The first step moves a weight by lr g / (|g| + eps), so a
    gradient off by d moves it at most lr d / (|g| - d + eps) apart, and never more than 2 lr: a gradient within d
    of 0 may change sign. Far from 0 this is about lr rtol; for a gradient that rounding alone sets, up to 2 lr."""
    d = atol + rtol * grad.abs()
    return (lr * d / ((grad.abs() - d).clamp(min=0) + ADAM_EPS)).clamp(max=2 * lr)


def check(stage, ref: GPT, tol: tuple[float, float], lr: float, what: str) -> None:
    rtol, atol = tol
    for name, p in stage.named_parameters():
        full = stage.global_name(name)
        want_grad, want = ref.grads[full], ref.get_parameter(full).detach()
        report.expect_close(f"{what}: grad of {full}", stage.grads[name], want_grad, rtol, atol)
        excess = (p.detach() - want).abs() - (atol + rtol * want.abs() + step_tolerance(want_grad, rtol, atol, lr))
        if excess.max() > 0:
            raise cli.SelfCheckFailed(f"{what}: {full} after the step: max abs error "
                                      f"{float((p.detach() - want).abs().max()):.3g} exceeds what the gradients' "
                                      f"rounding allows through AdamW's step by {float(excess.max()):.3g}")


def worker(ctx: RankContext, args: Settings) -> dict:
    model, xs, ys = build(args)
    ref, ref_loss = reference_step(build(args)[0], xs, ys, args.lr)
    tol = (1e-10, 1e-12) if args.double else (1e-4, 1e-6)
    rows, results = [], {"reference_loss": ref_loss, "schedules": {}}
    for schedule in ("gpipe", "1f1b"):
        stage, out = pipeline_step(model, xs, ys, schedule, args.lr)
        check(stage, ref, tol, args.lr, f"{schedule} stage {out['stage']}")
        if out["peak_in_flight"] != max_in_flight(out["actions"]):
            raise cli.SelfCheckFailed(f"{schedule}: counted {out['peak_in_flight']} in flight, "
                                      f"the order of operations allows {max_in_flight(out['actions'])}")
        dgrad, dparam = compare(stage, ref)
        mine = {"stage": out["stage"], "layers": list(stage.layer_range), "loss": out["loss"],
                "order": " ".join(f"{k}{i}" for k, i in out["actions"]),
                "peak_in_flight": out["peak_in_flight"], "peak_activation_bytes": out["peak_activation_bytes"],
                "max_grad_diff": dgrad, "max_param_diff": dparam}
        gathered: list = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine)
        results["schedules"][schedule] = gathered
        last_loss = gathered[-1]["loss"]
        report.expect_close(f"{schedule}: loss", last_loss, ref_loss, *tol)
        for row in gathered:
            first, end = row["layers"]
            blocks = f"{first}-{end - 1}" if end - first > 1 else f"{first}"  # "0", not "0-0", for one block
            rows.append({"schedule": schedule, "stage": row["stage"], "layers": blocks,
                         "in flight": row["peak_in_flight"], "act KiB": round(row["peak_activation_bytes"] / 1024, 1),
                         "max|dgrad|": row["max_grad_diff"], "max|dparam|": row["max_param_diff"]})
    if ctx.is_main:
        print_report(args, rows, results)
    return results


def print_report(args: Settings, rows: list, results: dict) -> None:
    p, m = args.world_size, args.micro_batches
    dtype = "float64" if args.double else "float32"
    print(f"p={p} stages, m={m} micro-batches of {args.micro_batch_size} x {args.seq_len} tokens, "
          f"tiny GPT with {args.layers} blocks, {dtype}")
    print(f"one process on the whole batch: loss {results['reference_loss']:.6f}")
    for schedule, gathered in results["schedules"].items():
        print(f"\n{schedule}: loss on the last stage {gathered[-1]['loss']:.6f}; order of operations per stage:")
        for row in gathered:
            print(f"  stage {row['stage']}: {row['order']}")
    print()
    print(report.table(rows))
    print("\ngradients and parameters after one AdamW step match one process on every stage: OK")


def draw_ideal(args: Settings, results: dict) -> dict:
    """The orders every stage ran, replayed on an ideal clock (F = 1 tick, B = 2, messages free) and drawn: a
    still of both schedules and an animation of them filling and draining. Returns the boxes it drew."""
    plt = plot.pyplot()
    drawn = {}
    for name, stages in results["schedules"].items():  # the order each stage logged while it ran
        orders = {row["stage"]: [(a[0], row["stage"], int(a[1:])) for a in row["order"].split()] for row in stages}
        boxes = zs.ideal_boxes(orders, list(range(len(stages))), chunks=1)
        drawn[name] = {"boxes": boxes, "idle_ticks": zs.idle_ticks(boxes)}
        span = max(b["end"] for b in boxes)
        idle = [round(i) for i in drawn[name]["idle_ticks"]]
        print(f"ideal clock, {name}: {span:g} ticks; idle ticks per stage {idle}"
              f" = share {drawn[name]['idle_ticks'][0] / span:.3f}")
    titles = {name: f"{name}: idle {d['idle_ticks'][0]:g} of {max(b['end'] for b in d['boxes']):g} ticks per stage"
              for name, d in drawn.items()}
    fig, axes = plt.subplots(len(drawn), 1, figsize=(10, 1.2 + 0.45 * len(results["schedules"]["gpipe"]) * 2),
                             sharex=True)
    for i, (ax, name) in enumerate(zip(axes, drawn)):
        zs.draw_ideal(ax, drawn[name]["boxes"], titles[name], legend=i == 0, lane="stage")
    axes[-1].set_xlabel("ticks (a forward = 1, a backward = 2, messages free)")
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'ideal_schedules')}")
    end = max(b["end"] for d in drawn.values() for b in d["boxes"])
    every = -(-int(end) // 6)  # at most 6 frames, the last one the finished step
    ticks = [min(t, end) for t in range(every, int(end) + every, every)]
    fig, axes = plt.subplots(len(drawn), 1, figsize=(7, 0.8 + 0.3 * len(results["schedules"]["gpipe"]) * 2),
                             sharex=True)
    fig.subplots_adjust(left=0.1, right=0.98, top=0.92, bottom=0.2, hspace=0.6)

    def frame(i: int) -> None:
        for ax, name in zip(axes, drawn):
            ax.clear()
            zs.draw_ideal(ax, drawn[name]["boxes"], f"{name} at tick {ticks[i]:g} (blue forward, orange backward)",
                          until=ticks[i], legend=False, labels=False, lane="stage")
        axes[-1].set_xlabel("ticks")

    gif, strip = plot.animate(fig, frame, len(ticks), args, "fill_drain", fps=1.5, strip_columns=3)
    print(f"figure: {gif}\nfigure: {strip}")
    return drawn


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"world_size": 2, "micro_batches": 3},
                     world_sizes=range(1, 9), world_sizes_text="1..8")
    results = launch(worker, args)
    if results is None:  # torchrun: only rank 0 reports
        return 0
    results["ideal"] = draw_ideal(args, results)
    if args.json:
        report.write_json(args.json, results, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
