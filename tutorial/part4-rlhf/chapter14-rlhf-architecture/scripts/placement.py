"""Placement: the chapter-13 RLHF loop run co-located, disaggregated (synchronous) and disaggregated (asynchronous).

What it shows
    The same task (mlsys/rlhf.py: actor, critic, reward model, reference on the `draft` GPT; rollouts from the
    inference engine; PPO) run three ways on real processes started by the launcher:
      co-located     every rank holds all four models and an engine; the phases take turns on every rank:
                     generate a shard of the batch, all-gather, score it, all-gather, train, reload
                     the engine from the local actor (no weight transfer between processes)
      disaggregated  rank 0 trains (actor, critic, reward, reference); ranks 1.. hold only an engine; each
                     iteration the rollout ranks generate, send the batch, wait; the trainer scores and trains
                     and broadcasts the new weights (mlsys.weight_sync, bucketed) to the rollout ranks
      async          the same two roles, but the rollout ranks generate batch k with the weights they already
                     have (from step k-1) before receiving step k's, while the trainer trains on batch k-1: the
                     trainer learns from a batch sampled by a policy one update older (one step off-policy), and
                     generation overlaps training
    Every placement generates and scores the batch in the same seeded shards, so
    co-located and disaggregated (sync) compute the same numbers: the script checks that their per-iteration
    rewards and their final actor weights are bitwise equal. It measures time per phase and idle time per rank,
    rollouts per second, and for async the off-policy gap (how far the policy that sampled has drifted from the one
    being trained). Figures: placement/placement.png (which rank held which model and ran which shards, as the
    ranks reported it), placement/timeline.png (who does what when), placement/learning.png,
    placement/versions.png (which weights version sampled which batch, sync and async).

How to run
    python tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/placement.py                # 2 ranks
    python tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/placement.py -w 3
    torchrun --nproc-per-node 2 tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/placement.py

The first run trains and caches the draft GPT and the reward model (a few minutes, once; see mlsys/reward_model.py).
Prints one table per placement (seconds per phase and idle per rank), the equality check and the async effect.
Runtime on 2 cores: about 10-15 s at a load average of 5 (other jobs on the cores multiply it: about 40 s at 10);
--smoke almost as long (13 s at load 5), since starting the processes and loading the models take most of it.

Try next
    python tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/placement.py -w 3 --iterations 8
        -> one trainer and two rollout ranks (co-located: the table shows which phases each of the three ranks got;
           the default two shards leave rank 2 with training only): the same equality checks; on 2 cores three processes
           share the CPUs, so read the idle % column before the throughput; a load beyond the cores slows it roughly by
           the load average over the core count (both on the Machine: line)
    python tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/placement.py --iterations 12
        -> a longer run: the async off-policy gap per iteration, and whether the reward curves separate
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import _placement_figures as figures  # this script's three figures (_placement_figures.py)
import torch
import torch.distributed as dist

from mlsys import cli, report, reward_model
from mlsys.launch import RankContext, launch
from mlsys.rlhf_shards import (
    COMPUTE,
    PLACEMENTS,
    PlacementSettings,
    generate_shard,
    holdings,
    merge,
    score_micro_batch,
    setup,
    train_on,
)
from mlsys.weight_sync import broadcast_bucketed, named_meta, plan_buckets, unique_parameters


@dataclass
class Settings(PlacementSettings, cli.PlotArgs):
    """placement.py takes exactly the shared flags (mlsys/rlhf_shards.py)."""


class Timeline:
    """(phase, start, end) of one rank, in seconds since a start all ranks share (after a barrier). t0 is that start
    on time.perf_counter's clock, which on Linux is one clock for every process of the machine."""

    def __init__(self) -> None:
        dist.barrier()
        self.t0, self.events = time.perf_counter(), []

    def span(self, phase: str):
        timeline = self

        class _Span:
            def __enter__(self):
                self.start = time.perf_counter() - timeline.t0

            def __exit__(self, *exc):
                timeline.events.append((phase, self.start, time.perf_counter() - timeline.t0))

        return _Span()


# ------------------------------------------------------------------------------------------- co-located
# --8<-- [start:colocated]
def colocated(ctx: RankContext, args: Settings) -> tuple[list, list, dict]:
    """Every rank: all four models + an engine. Phases take turns; training is replicated on every rank (so all
    ranks keep identical weights without a gradient all-reduce; a real system shards it, chapter 5)."""
    models, opts, kl_ctl, engine, cfg = setup("all", args.seed)
    held = holdings(actor=models.actor, critic=models.critic, reward_model=models.reward_model,
                    reference=models.reference, engine=engine.model)
    tl, stats = Timeline(), []
    mine = range(ctx.rank, args.shards, ctx.world_size)  # shards this rank generates and scores
    for it in range(args.iterations):
        with tl.span("generate"):
            shards = [(s, generate_shard(engine, args, it, s)) for s in mine]
        with tl.span("comm"):
            everyone = [None] * ctx.world_size
            dist.all_gather_object(everyone, shards)  # every rank gets every shard
            batch = merge([b for _, b in sorted((x for part in everyone for x in part), key=lambda x: x[0])])
        with tl.span("score"):
            scored = [(m, score_micro_batch(models, batch, args, m)) for m in mine]
        with tl.span("comm"):
            dist.all_gather_object(everyone, scored)
            extras = [e for _, e in sorted((x for part in everyone for x in part), key=lambda x: x[0])]
        with tl.span("train"):
            stats.append(train_on(models, opts, kl_ctl, cfg, batch, extras))
            engine.load_weights(models.actor.state_dict())  # same process: a memory copy, no network
    held.update(generated=[s for s, _ in shards], scored=[m for m, _ in scored])  # what this rank ran
    return tl, stats, {n: t.detach().clone() for n, t in models.actor.state_dict().items()}, held
# --8<-- [end:colocated]


# ------------------------------------------------------------------------------------------- disaggregated
# --8<-- [start:disaggregated]
def send_weights(tl: Timeline, params: dict, plan: list) -> None:
    """Trainer and rollout ranks both call it: a barrier (the wait) then the bucketed broadcast (the transfer)."""
    with tl.span("comm"):
        dist.barrier()
    with tl.span("weight sync"):
        broadcast_bucketed(params, plan, src=0)  # rollout ranks: straight into the engine's model, in place


def trainer(ctx: RankContext, args: Settings) -> tuple[list, list, dict]:
    """Rank 0: receive batch k, score it, train, broadcast the new weights. The same code for sync and async."""
    models, opts, kl_ctl, _, cfg = setup("trainer", args.seed)
    held = holdings(actor=models.actor, critic=models.critic, reward_model=models.reward_model,
                    reference=models.reference)
    params = unique_parameters(models.actor)
    plan = plan_buckets(named_meta(params), int(args.bucket_mb * 2**20))
    tl, stats = Timeline(), []
    for it in range(args.iterations):
        with tl.span("comm"):  # mostly waiting for the rollout ranks
            everyone = [None] * ctx.world_size
            dist.all_gather_object(everyone, [])
            batch = merge([b for _, b in sorted((x for part in everyone for x in part), key=lambda x: x[0])])
        with tl.span("score"):
            extras = [score_micro_batch(models, batch, args, m) for m in range(args.shards)]
        with tl.span("train"):
            stats.append(train_on(models, opts, kl_ctl, cfg, batch, extras))
        if it < args.iterations - 1:
            send_weights(tl, params, plan)
    held.update(generated=[], scored=list(range(args.shards)))  # no engine: it scores every shard
    return tl, stats, {n: t.detach().clone() for n, t in models.actor.state_dict().items()}, held


def rollout(ctx: RankContext, args: Settings, off_policy: bool) -> list:
    """Ranks 1..: generate their shards, hand them over, receive weights. Synchronous: receive the weights of
    step k before generating batch k. Asynchronous: generate batch k with the weights of step k-1 first, then
    receive step k's weights (so generation overlaps the trainer's step)."""
    _, _, _, engine, _ = setup("rollout", args.seed)
    held = holdings(engine=engine.model)
    params = unique_parameters(engine.model)
    plan = plan_buckets(named_meta(params), int(args.bucket_mb * 2**20))
    mine = range(ctx.rank - 1, args.shards, ctx.world_size - 1)
    tl, sampled_with, received = Timeline(), [], [0]  # per batch: the weights version (updates received) it saw

    def receive_weights() -> None:
        send_weights(tl, params, plan)
        received[0] += 1
        engine.reset_prefix_cache()  # what Engine.load_weights does after loading

    for it in range(args.iterations):
        if it > 0 and not off_policy:
            receive_weights()
        sampled_with.append(received[0])
        with tl.span("generate"):
            shards = [(s, generate_shard(engine, args, it, s)) for s in mine]
        if it > 0 and off_policy:
            receive_weights()
        with tl.span("comm"):
            dist.all_gather_object([None] * ctx.world_size, shards)
    held.update(generated=[s for s, _ in shards], scored=[])
    return tl, held, sampled_with
# --8<-- [end:disaggregated]


def worker(ctx: RankContext, args: Settings) -> dict:
    out, final = {}, {}
    for placement in args.placements:
        if placement == "colocated":
            (tl, stats, weights, held), versions = colocated(ctx, args), None
        elif ctx.rank == 0:
            (tl, stats, weights, held), versions = trainer(ctx, args), None
        else:
            (tl, held, versions), stats, weights = rollout(ctx, args, placement == "async"), [], None
        per_rank = [None] * ctx.world_size
        dist.all_gather_object(per_rank, (tl.events, tl.t0, held, versions))
        timelines, t0s, helds, versions = (list(x) for x in zip(*per_rank))
        out[placement] = {"timelines": timelines, "t0": t0s, "params_held": [h["params"] for h in helds],
                          "placed": helds, "stats": stats, "sampled_with": versions}
        if weights is not None:
            final[placement] = weights
            if args.save_weights and ctx.rank == 0:
                os.makedirs(args.save_weights, exist_ok=True)
                torch.save(weights, os.path.join(args.save_weights, f"{placement}.pt"))
    if ctx.rank == 0 and "colocated" in final and "disaggregated" in final:  # tensors stay in this process
        a, b = final["colocated"], final["disaggregated"]
        out["weight_diff"] = max((a[k] - b[k]).abs().max().item() for k in a)
        out["weights_equal"] = all(torch.equal(a[k], b[k]) for k in a)
    return out


# ------------------------------------------------------------------------------------------- reporting
def summarize(name: str, res: dict, args: Settings) -> tuple[list[dict], float]:
    """Per rank: seconds in each phase, idle (comm + waiting), and the wall time of the run."""
    wall = max(end for events in res["timelines"] for _, _, end in events)
    table = []
    for rank, events in enumerate(res["timelines"]):
        row = {"placement": name, "rank": rank, "params held": res["params_held"][rank]}
        for phase in (*COMPUTE, "weight sync", "comm"):
            row[phase] = sum(e - s for p, s, e in events if p == phase)
        busy = sum(row[p] for p in COMPUTE)
        row["idle"] = wall - busy
        row["idle %"] = 100 * row["idle"] / wall
        table.append(row)
    return table, wall


def shown_gap(gap: float) -> float:
    """A mean off-policy gap as the tables print it, to 3 decimals: float noise of either sign (a synchronous run's
    -1e-9) becomes 0.0, never -0.0, so it prints 0.000 and not -0.000."""
    return round(gap, 3) + 0.0  # -0.0 + 0.0 is +0.0


def train_vs_trainer(summary: dict) -> list[float]:
    """Each co-located rank's `train` seconds over the disaggregated trainer's: the same replicated PPO update, so
    any ratio away from 1 is the machine (the co-located ranks train at the same moment on shared cores)."""
    trainer = summary["disaggregated"]["ranks"][0]["train"]
    return [row["train"] / trainer for row in summary["colocated"]["ranks"]]


def warm_cache() -> None:
    """Train-and-cache the draft GPT and the reward model here, once, before any rank starts: otherwise every
    rank would find the cache empty and train its own copy at the same time."""
    from mlsys.weights import load_pretrained

    load_pretrained("draft")
    reward_model.load_reward_model("draft")


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"iterations": 2, "num_rollouts": 8, "max_tokens": 12},
                     world_sizes=lambda w: w >= 2, world_sizes_text="of 2 or more (1 trainer + rollouts)")
    print(f"RLHF placements on {args.world_size} ranks ({args.backend}): {args.iterations} iterations of "
          f"{args.num_rollouts} rollouts x {args.max_tokens} tokens, draft GPT actor/critic/reward/reference")
    warm_cache()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    results = launch(worker, args)
    tables, summary = [], {}
    placements = {n: r for n, r in results.items() if n in PLACEMENTS}
    for name, res in placements.items():
        table, wall = summarize(name, res, args)
        tables += table
        rollouts_per_s = args.iterations * args.num_rollouts / wall
        summary[name] = {"wall_s": wall, "s_per_iteration": wall / args.iterations, "rollouts_per_s": rollouts_per_s,
                         "stats": res["stats"],
                         "ranks": table, "timelines": res["timelines"], "t0": res["t0"],
                         "idle_pct": [row["idle %"] for row in table], "weight_sync_s": table[0]["weight sync"],
                         "generate_s": [row["generate"] for row in table], "params_held": res["params_held"],
                         "placed": res["placed"], "sampled_with": res["sampled_with"],
                         "mean_off_policy_gap": sum(x["off_policy_gap"] for x in res["stats"]) / args.iterations,
                         # the same, as the table prints it (no -0.000)
                         "mean_off_policy_gap_shown": shown_gap(sum(x["off_policy_gap"] for x in res["stats"])
                                                                / args.iterations),
                         # per rank: wall time after the rank's last event (the disaggregated rollout rank's tail,
                         # while the trainer scores and trains the last batch)
                         "tail_s": [wall - max((end for _, _, end in events), default=0.0)
                                    for events in res["timelines"]],
                         # iterations after the first whose gap (a sampled k1 estimate) came out above 0
                         "gap_positive_after_first": sum(x["off_policy_gap"] > 0 for x in res["stats"][1:]),
                         "iterations_after_first": len(res["stats"]) - 1}
    print(f"\nMachine: {os.cpu_count()} cores, load average {load:.1f} before the run (other jobs share the cores)")
    print("Parameters each rank holds (all its models, the engine's copy included), seconds per phase and idle time "
          "per rank (idle = wall - generate - score - train):")
    print(report.table(tables, floatfmt=".2f"))
    print("\nfinal reward, final KL: the last iteration's mean reward-model score and its KL to the reference "
          "(nats per response, summed over its tokens); well-formed: the share of responses that are well-formed "
          "records (chapter 13's valid), averaged over the iterations")
    print(report.table([{"placement": n, "wall s": s["wall_s"], "s / iteration": s["wall_s"] / args.iterations,
                         "rollouts/s": s["rollouts_per_s"], "final reward": s["stats"][-1]["reward"],
                         "final KL": s["stats"][-1]["kl"],
                         "well-formed": sum(x["valid"] for x in s["stats"]) / args.iterations,
                         "mean off-policy gap": s["mean_off_policy_gap_shown"]}
                        for n, s in summary.items()], floatfmt=".3f"))
    if "colocated" in results and "disaggregated" in results:
        a, b = results["colocated"], results["disaggregated"]
        report.expect_equal("per-iteration rewards, co-located vs disaggregated",
                            [s["reward"] for s in a["stats"]], [s["reward"] for s in b["stats"]])
        report.expect_equal("final actor weights, co-located vs disaggregated (max abs difference)",
                            results["weight_diff"], 0.0)
        summary["weights_equal"] = results["weights_equal"]
        print("\nco-located and disaggregated (sync): identical rewards every iteration, final actor weights "
              "bitwise equal  OK")
    summary["machine"] = {"cores": os.cpu_count(), "load_avg": load}
    if "colocated" in summary and "disaggregated" in summary:
        summary["colocated"]["train_vs_trainer"] = train_vs_trainer(summary)
    if "async" in results and "disaggregated" in results:
        s, a = summary["disaggregated"], summary["async"]
        summary["async_vs_sync"] = a["rollouts_per_s"] / s["rollouts_per_s"]
        print(f"async vs disaggregated sync: {a['rollouts_per_s'] / s['rollouts_per_s']:.2f}x the rollouts per second; "
              f"final reward {a['stats'][-1]['reward']:.3f} vs {s['stats'][-1]['reward']:.3f}")
    if not args.smoke and not any(x["valid"] > 0 for s in summary.values() if isinstance(s, dict) and "stats" in s
                                  for x in s["stats"]):
        raise cli.SelfCheckFailed(f"no well-formed response in any iteration: is --max-tokens {args.max_tokens} too "
                                  "short for a record? the placements would be compared on a broken task")
    figures.draw_placement(placements, args)
    figures.draw_timeline(placements, args)
    figures.draw_learning(placements, args)
    summary["versions_drawn"] = figures.draw_versions(placements, args)
    if args.json:
        report.write_json(args.json, summary, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
