"""Ray placement: placement.py's three RLHF placements again, with the roles as Ray actors, the way verl and
OpenRLHF run them.

What it shows
    The driver is the single controller: it runs the RLHF loop and calls methods on worker groups (lists of Ray
    actors, mlsys/ray_rlhf.py). Each worker group lives in a resource pool, a Ray placement group whose bundles
    reserve {CPU, GPU} together, PACKed onto as few nodes as possible or SPREAD over as many.
      co-located     one pool of W bundles; one group of W actors, each holding the four models and an engine
                     (the fused worker of verl's co-located mode); each generates and scores its shards, every
                     actor trains (replicated) and reloads its engine from its own actor model
      disaggregated  two pools: a trainer pool (1 bundle, one actor with the four models) and a rollout pool (W-1
                     bundles, one engine-only actor each); after each step the trainer broadcasts the new weights to
                     the rollout actors over a torch.distributed group formed among the actors (gloo here),
                     bucketed with mlsys.weight_sync, exactly as placement.py's ranks do
      async          the same pools and actors (their models rebuilt); the driver submits batch k+1's generation
                     before step k's weight sync, so the rollout actors generate with weights one step old while
                     the trainer trains
    It computes what placement.py computes: the same seeded shards and thread count give the same
    rewards, KL and final actor weights, bit for bit (tests/test_ch14_ray.py compares the two scripts' runs).
    On a machine without GPUs the "GPU" of a bundle is a logical Ray resource (ray.init(num_gpus=W)): it reserves
    a slot, the models still run on the CPU.
    Measured: ray.init's start-up, an empty actor's start-up, each group's start-up (with its models), an object
    store put/get of the final weights, time per iteration and idle time per actor.
    Figures: ray_placement/pools.png (driver, pools, bundles and actors on their nodes, from the placement groups'
    table and what each actor reported) and ray_placement/timeline.png (who did what when).

How to run
    python tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/ray_placement.py
    python tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/ray_placement.py -w 3 --strategy SPREAD
    python tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/ray_placement.py --address HEAD_IP:6379 \\
        --trainer-on trainer_node --rollout-on rollout_node
        -> join a running cluster (ray start --head / ray start --address=...), roles on the nodes that advertise
           those custom resources (ray start --resources '{"trainer_node": 1}')

Runtime on 2 cores: about 14-55 s (14 s on an idle machine, 55 s at a load average of 9: Ray's start-up and four
actor processes starting take most of it); --smoke about 25 s. The first run trains and caches the draft GPT and
the reward model (see placement.py).

Try next
    python tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/ray_placement.py --fault generate
        -> the first generating actor is killed mid-iteration: all-0, since the co-located placement runs
           first (rollout-1 with --placements disaggregated async); on stderr one line names its role, pid and
           node and says the fault was planted; exit 1; nothing left. Before it, Ray's own "(raylet)" paragraph
           on stdout lists likely causes of any unexpected worker death (an OOM kill first): a guess, not a
           diagnosis
    python tutorial/part4-rlhf/chapter14-rlhf-architecture/scripts/ray_placement.py \\
        --placements disaggregated async --iterations 8
        -> only the disaggregated pools: compare the s / iteration column with placement.py's (same settings:
           python .../placement.py --placements disaggregated async --iterations 8)
"""

from __future__ import annotations

import os
import shutil
import time
import typing
from dataclasses import dataclass

import _placement_figures as figures  # placement.py's figure helpers: the phase colours
import torch

from mlsys import cli, plot, ray_rlhf, report
from mlsys.launch import threads_per_rank
from mlsys.rlhf_shards import COMPUTE, PlacementSettings


@dataclass
class Settings(PlacementSettings, cli.PlotArgs):
    strategy: typing.Literal["PACK", "SPREAD"] = "PACK"
    """Placement-group strategy of the co-located pool and the rollout pool."""
    address: str = ""
    """Join a running Ray cluster at this address (ray start --head prints it) instead of starting one here."""
    trainer_on: str = ""
    """A custom resource the trainer pool's bundles ask for: the trainer lands on a node that advertises it."""
    rollout_on: str = ""
    """The same for the rollout pool."""
    fault: typing.Literal["none", "generate", "train"] = "none"
    """Planted fault: kill the first generating actor by rank (generate) or the trainer (train) mid-iteration."""
    fault_iteration: int = 1
    """The iteration in which --fault strikes."""

    def validate(self) -> None:
        super().validate()
        if self.backend == "nccl":
            raise cli.UsageError("the draft models run on the CPU here, so the sync group is gloo: use --backend gloo")
        if (self.trainer_on or self.rollout_on) and not self.address:
            raise cli.UsageError("--trainer-on/--rollout-on name a resource that a node of a running cluster "
                                 "advertises (ray start --resources): give that cluster's --address")
        if self.fault != "none" and not 0 <= self.fault_iteration < self.iterations:
            raise cli.UsageError(f"--fault-iteration must be in 0..{self.iterations - 1} (--iterations "
                                 f"{self.iterations}), got {self.fault_iteration}: the fault would never strike")


def actor_settings(args: Settings, fault_rank: int) -> dict:
    keep = ("seed", "num_rollouts", "shards", "max_tokens", "bucket_mb", "fault", "fault_iteration")
    return {**{k: getattr(args, k) for k in keep}, "fault_rank": fault_rank}


# --8<-- [start:colocated]
def colocated(args: Settings, threads: int) -> dict:
    """One pool, one group: every actor holds everything. The driver passes the shards' refs from generate to
    score to train; Ray moves the objects between actors."""
    W, t = args.world_size, time.perf_counter()
    pool = ray_rlhf.ResourcePool("colocated", W, args.strategy)
    pool.ready(args.timeout)
    group = ray_rlhf.WorkerGroup("all", pool, actor_settings(args, 0), threads)
    where, start_s = group.started(args.timeout), time.perf_counter() - t
    mine = [list(range(r, args.shards, W)) for r in range(W)]  # shard s on actor s mod W, as placement.py
    t0, stats = time.time(), []
    for it in range(args.iterations):
        gen = group.call_each("generate", [(it, m) for m in mine])
        group.gather(gen, "generate", it, args.timeout)
        scored = group.call_each("score", [(m, *gen) for m in mine])  # refs as arguments: resolved in the actor
        group.gather(scored, "score", it, args.timeout)
        stats.append(group.gather(group.call("train", *scored), "train", it, args.timeout)[0])
    result = collect(args, [group], [pool], where, stats, t0, start_s)
    release([group], [pool])
    return result
# --8<-- [end:colocated]


# --8<-- [start:disaggregated]
def disaggregated_groups(args: Settings, threads: int) -> dict:
    """Two pools, two groups, and a torch.distributed group formed among their actors for the weights."""
    W, t = args.world_size, time.perf_counter()
    fault_rank = 1 if args.fault == "generate" else 0
    tpool = ray_rlhf.ResourcePool("trainer", 1, "PACK", on=args.trainer_on)
    rpool = ray_rlhf.ResourcePool("rollout", W - 1, args.strategy, on=args.rollout_on)
    tpool.ready(args.timeout)
    rpool.ready(args.timeout)
    trainer = ray_rlhf.WorkerGroup("trainer", tpool, actor_settings(args, fault_rank), threads)
    rollout = ray_rlhf.WorkerGroup("rollout", rpool, actor_settings(args, fault_rank), threads, first_rank=1)
    where = trainer.started(args.timeout) + rollout.started(args.timeout)
    # the driver picks the rendezvous: the trainer's node, a port free there; every actor joins the group
    host = where[0]["ip"]
    port = ray_rlhf.gather([(trainer.actors[0].free_port.remote(), trainer, 0)], "setup", -1)[0]
    joins = trainer.call("join_sync_group", host, port, 0, W, args.backend, args.timeout)
    joins += rollout.call_each("join_sync_group", [(host, port, r, W, args.backend, args.timeout) for r in range(1, W)])
    ray_rlhf.gather([(j, trainer if i == 0 else rollout, max(0, i - 1)) for i, j in enumerate(joins)], "setup", -1)
    return {"groups": [trainer, rollout], "pools": [tpool, rpool], "where": where,
            "start_s": time.perf_counter() - t}


def disaggregated(args: Settings, setup: dict, off_policy: bool) -> dict:
    """The driver's loop. Each call only queues work on an actor (Ray runs an actor's calls in the order they
    were made), so where a call is submitted decides which weights a batch is generated with."""
    (trainer, rollout), W = setup["groups"], args.world_size
    mine = [(list(range(r, args.shards, W - 1)),) for r in range(W - 1)]  # shard s on rollout actor 1 + s mod (W-1)
    t0, stats = time.time(), []
    gen = rollout.call_each("generate", [(0, *m) for m in mine])
    for it in range(args.iterations):
        last = it + 1 == args.iterations
        if off_policy and not last:  # queued before this step's sync: batch it+1 comes from the old weights
            nxt = rollout.call_each("generate", [(it + 1, *m) for m in mine])
        step = trainer.call("score_and_train", it, *gen)  # the shards' refs: Ray hands the batch to the trainer
        syncs = ([], []) if last else (trainer.call("sync"), rollout.call("sync"))
        if not off_policy and not last:  # queued after the sync: batch it+1 comes from the new weights
            nxt = rollout.call_each("generate", [(it + 1, *m) for m in mine])
        rollout.gather(gen, "generate", it, args.timeout)
        stats.append(trainer.gather(step, "train", it, args.timeout)[0])
        trainer.gather(syncs[0], "weight sync", it, args.timeout)
        rollout.gather(syncs[1], "weight sync", it, args.timeout)
        gen = None if last else nxt
    return collect(args, setup["groups"], setup["pools"], setup["where"], stats, t0, setup["start_s"])
# --8<-- [end:disaggregated]


def release(groups: list, pools: list) -> None:
    """Give everything back to Ray: the actors' sync group closed, the actors killed, the pools removed."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for g in groups:
        if g.role != "all":
            ray.get(g.call("leave"))
        g.kill()
    for p in pools:
        remove_placement_group(p.pg)


def collect(args: Settings, groups: list, pools: list, where: list, stats: list, t0: float, start_s: float) -> dict:
    """What the actors recorded (timelines, final actor weights), the pools as Ray placed them, and an object
    store round trip of the weights."""
    import ray

    weights = ray.get(groups[0].actors[0].final_weights.remote())
    timelines = [ev for g in groups for ev in ray.get(g.call("timeline"))]
    described = [p.describe() for p in pools]
    t = time.perf_counter()
    ref = ray.put(weights)
    put_s = time.perf_counter() - t
    t = time.perf_counter()
    ray.get(ref)
    get_s = time.perf_counter() - t
    spans = [[(ph, s - t0, e - t0) for ph, s, e in events if e >= t0] for events in timelines]
    wall = max(e for events in spans for _, _, e in events)
    table = []
    for w, events in zip(where, spans):
        row = {"actor": f"{w['role']}-{w['rank']}", "pool": w["pool"], "node": w["node_id"][:8], "pid": w["pid"],
               "params held": w["held"]["params"]}
        for ph in (*COMPUTE, "weight sync", "comm"):
            row[ph] = sum(e - s for p, s, e in events if p == ph)
        row["idle"] = wall - sum(row[p] for p in COMPUTE)
        row["idle %"] = 100 * row["idle"] / wall
        table.append(row)
    nbytes = sum(v.numel() * v.element_size() for v in weights.values())
    return {"stats": stats, "wall_s": wall, "s_per_iteration": wall / args.iterations, "start_s": start_s,
            "pools": described, "actors": where, "timelines": spans, "ranks": table,
            "idle_pct": [r["idle %"] for r in table], "weights": weights,
            "object_store": {"bytes": nbytes, "put_s": put_s, "get_s": get_s}}


# ------------------------------------------------------------------------------------------------ figures
def draw_pools(results: dict, args: Settings) -> None:
    """Per placement: the driver on top; each node a grey frame; in it the bundles Ray reserved there (coloured by
    pool), each with the actor that reported running in it (role-rank, pid) and the node it said it ran on."""
    plt = plot.pyplot()
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.6 * len(results)), squeeze=False)
    pool_colour = {"colocated": "C2", "trainer": "C0", "rollout": "C1"}
    for ax, (name, res) in zip(axes[:, 0], results.items()):
        nodes = list(dict.fromkeys(b["node_id"] for p in res["pools"] for b in p["bundles"]))
        slots = [(p, b) for p in res["pools"] for b in p["bundles"]]
        x = 0.0
        for n in nodes:
            here = [(p, b) for p, b in slots if b["node_id"] == n]
            ax.add_patch(plt.Rectangle((x, 0), 1.2 * len(here) + 0.2, 1.6, fc="0.93", ec="0.5"))
            ax.text(x + 0.1, 1.45, f"node {n[:8]}", fontsize=8, va="center")
            for i, (p, b) in enumerate(here):
                bx = x + 0.2 + 1.2 * i
                actor = next(a for a in res["actors"] if a["pool"] == p["name"] and a["bundle"] == b["index"])
                ax.add_patch(plt.Rectangle((bx, 0.15), 1.0, 1.1, fc=pool_colour[p["name"]], alpha=0.35, ec="k"))
                res_text = " ".join(f"{k} {v:g}" for k, v in b["resources"].items() if k in ("CPU", "GPU"))
                ax.text(bx + 0.5, 0.95, f"{p['name']} pool\nbundle {b['index']} ({p['strategy']})\n{res_text}",
                        ha="center", va="center", fontsize=6.5)
                ok = "" if actor["node_id"] == n else "\n(reports another node!)"
                ax.text(bx + 0.5, 0.4, f"{actor['role']}-{actor['rank']}\npid {actor['pid']}{ok}", ha="center",
                        va="center", fontsize=7, weight="bold")
                ax.plot([bx + 0.5, 0.2 + 0.6 * len(slots)], [1.25, 2.05], color="0.4", lw=0.7)
            x += 1.2 * len(here) + 0.5
        ax.add_patch(plt.Rectangle((0.2 + 0.6 * len(slots) - 1.2, 2.05), 2.4, 0.45, fc="w", ec="k"))
        ax.text(0.2 + 0.6 * len(slots), 2.27, f"driver (pid {os.getpid()})", ha="center", va="center", fontsize=8)
        ax.set(xlim=(-0.1, max(x, 0.4 + 1.2 * len(slots)) + 0.1), ylim=(-0.1, 2.6))
        ax.axis("off")
        ax.set_title(f"{name}: pools, bundles and the actor in each", fontsize=9, loc="left")
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'pools')}")


def draw_timeline(results: dict, args: Settings) -> None:
    plt = plot.pyplot()
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(results), 1, figsize=(8, 1.2 + 1.0 * len(results) * args.world_size / 2),
                             sharex=True, squeeze=False)
    palette = figures.PHASE_COLOURS  # the same colours as placement.py's timeline
    for ax, (name, res) in zip(axes[:, 0], results.items()):
        lanes = [f"{a['role']}-{a['rank']}" for a in res["actors"]]
        spans = [plot.Span(lane, s, e, kind=figures.PHASE_LABELS.get(ph, ph))
                 for lane, events in zip(lanes, res["timelines"]) for ph, s, e in events]
        plot.timeline(ax, spans, lanes, palette=palette, legend=False)
        # white: the actor recorded nothing, i.e. it sat between two calls (waiting for the driver's next call, or
        # for that call's arguments, such as the rollout actors' shards, to be ready)
        used = [k for k in palette if any(s.kind == k for s in spans)]
        ax.legend(handles=[Patch(facecolor=palette[k], edgecolor="black", label=k) for k in used]
                  + [Patch(facecolor="white", edgecolor="black", label="between calls")],
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
        ax.set_title(name, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds since the driver started the loop")
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'timeline')}")


# ------------------------------------------------------------------------------------------------ main
def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"iterations": 2, "num_rollouts": 8, "max_tokens": 12},
                     world_sizes=lambda w: w >= 2, world_sizes_text="of 2 or more (1 trainer + rollouts)")
    import ray

    from mlsys import reward_model
    from mlsys.weights import load_pretrained

    print(f"RLHF placements as Ray actors, {args.world_size} bundles ({args.backend} sync group): {args.iterations} "
          f"iterations of {args.num_rollouts} rollouts x {args.max_tokens} tokens")
    load_pretrained("draft"), reward_model.load_reward_model("draft")  # train-and-cache once, before any actor needs it
    load = os.getloadavg()[0]
    threads = threads_per_rank(args.world_size)  # what a launcher rank gets on this machine
    results: dict = {}
    temp_dir = os.environ.get("RAY_TMPDIR") or f"/tmp/ray-{os.getpid()}"  # Ray's sockets and logs
    try:
        gpus = None if torch.cuda.is_available() else args.world_size  # real GPUs, or W logical ones
        init_s = ray_rlhf.start(args.address, num_cpus=args.world_size, num_gpus=gpus, temp_dir=temp_dir)
        missing = [r for r in (args.trainer_on, args.rollout_on) if r and r not in ray_rlhf.cluster_resources()]
        if missing:  # its pools could never be placed: say so now rather than after --timeout
            raise cli.UsageError(f"no node of the cluster at {args.address} advertises {', '.join(missing)}")
        ping_s = ray_rlhf.ping_seconds()
        shared = None  # the disaggregated pools and groups, reused by async (models rebuilt, same processes)
        for name in args.placements:
            if name == "colocated":
                results[name] = colocated(args, threads)
                continue
            if shared is None:
                shared = disaggregated_groups(args, threads)
            else:
                t = time.perf_counter()
                for g in shared["groups"]:
                    g.gather(g.call("reset"), "reset", -1, args.timeout)
                shared["start_s"] = time.perf_counter() - t
            results[name] = disaggregated(args, shared, off_policy=name == "async")
        if shared is not None:
            release(shared["groups"], shared["pools"])
    except ray_rlhf.JobFailed as err:
        if args.fault == "none" or " died in " not in str(err):
            raise
        raise ray_rlhf.JobFailed(err.rank, f"{err} [planted: --fault {args.fault}]", err.exit_code) from None
    finally:
        ray.shutdown()  # stops every process this run started (also after an error or Ctrl-C)
        if not args.address and not os.environ.get("RAY_TMPDIR"):
            shutil.rmtree(temp_dir, ignore_errors=True)
    weights = {n: r.pop("weights") for n, r in results.items()}
    if args.save_weights:
        os.makedirs(args.save_weights, exist_ok=True)
        for n, w in weights.items():
            torch.save(w, os.path.join(args.save_weights, f"{n}.pt"))
    print(f"\nMachine: {os.cpu_count()} cores, load average {load:.1f} before the run. Ray: ray.init {init_s:.2f} s, "
          f"an empty actor {ping_s:.2f} s, {threads} torch thread(s) per actor")
    print(report.table([{"placement": n, **row} for n, r in results.items() for row in r["ranks"]], floatfmt=".2f"))
    print("\nput s, get s: the driver's ray.put of the final actor-model weights into the object store, and its "
          "ray.get of them back")
    print(report.table([{"placement": n, "groups start s": r["start_s"], "wall s": r["wall_s"],
                         "s / iteration": r["s_per_iteration"], "final reward": r["stats"][-1]["reward"],
                         "final KL": r["stats"][-1]["kl"], "weights MiB": r["object_store"]["bytes"] / 2**20,
                         "put s": r["object_store"]["put_s"], "get s": r["object_store"]["get_s"]}
                        for n, r in results.items()], floatfmt=".3f"))
    overhead, work = init_s + sum(r["start_s"] for r in results.values()), sum(r["wall_s"] for r in results.values())
    summary = {**results, "ray": {"init_s": init_s, "empty_actor_s": ping_s, "load_avg": load, "threads": threads,
                                  "version": ray.__version__, "overhead_s": overhead, "work_s": work,
                                  "overhead_vs_work": "more than" if overhead > work else "less than"}}
    if "colocated" in weights and "disaggregated" in weights:
        a, b = weights["colocated"], weights["disaggregated"]
        report.expect_equal("per-iteration rewards, co-located vs disaggregated",
                            [s["reward"] for s in results["colocated"]["stats"]],
                            [s["reward"] for s in results["disaggregated"]["stats"]])
        summary["weights_equal"] = all(torch.equal(a[k], b[k]) for k in a)
        if not summary["weights_equal"]:
            raise cli.SelfCheckFailed("co-located and disaggregated final actor weights differ")
        print("\nco-located and disaggregated (sync) on Ray: identical rewards, final actor weights bitwise equal  OK")
    draw_pools(results, args)
    draw_timeline(results, args)
    if args.json:
        report.write_json(args.json, summary, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
