"""Chapter 14's RLHF roles as Ray actors: resource pools, worker groups, and the actor that does a role's work.

The driver is the single controller: it owns the loop, and calls methods on worker groups; each call returns
object refs at once, and the work runs in the actors. Three pieces:

    pool = ResourcePool("rollout", bundles=2, strategy="PACK")     # a placement group: 2 x {CPU, GPU}
    group = WorkerGroup("rollout", pool, settings, threads=1)      # one RoleWorker actor per bundle
    refs = group.call("generate", it, shards_of)                   # ObjectRefs, one per actor; nothing waits
    results = group.gather(refs, "generate", it)                   # wait; a dead actor -> JobFailed naming it

A ResourcePool is a Ray placement group: bundles of resources reserved together, PACK (on as few nodes as
possible) or SPREAD (over as many nodes as possible). Roles whose groups use the same pool share its bundles
(co-located); roles on separate pools are disaggregated. `on` adds a custom resource to every bundle, so the pool
can only be placed on nodes that advertise it (`ray start --resources '{"trainer_node": 1}'`): roles on named nodes.

On a machine without GPUs, the "GPU" in a bundle is a logical Ray resource (ray.init(num_gpus=N) declares N of
them): it reserves a slot, it does not make the models run on a GPU.

Weight sync between the trainer actor and the rollout actors goes over a torch.distributed group formed among the
actors themselves (`join_sync_group`, with a TCP address the driver picked), with chapter 14's bucketed broadcast
(mlsys.weight_sync), exactly as the launcher version does between ranks.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from types import SimpleNamespace

from mlsys.cli import JobFailed

ROLE_NAMES = {"all": "co-located (all four models + engine)", "trainer": "trainer", "rollout": "generation"}


def start(address: str = "", num_cpus: int = 2, num_gpus: int | None = None, temp_dir: str = "/tmp/ray") -> float:
    """ray.init: start a one-machine Ray (head node, raylet, GCS, object store) or join a running cluster at
    `address`. num_gpus None: the GPUs Ray finds; a number: that many GPU slots, logical ones on a CPU machine.
    Returns the seconds it took. No dashboard, a small object store, workers' output not echoed. What Ray still
    prints on the driver (a "(raylet)" paragraph when a worker dies) comes without terminal colour codes, so a
    captured log reads as plain text."""
    import ray

    os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # read by the driver each time it prints a Ray message
    t = time.perf_counter()
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    else:
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR", object_store_memory=200 * 2**20, _temp_dir=temp_dir)
    return time.perf_counter() - t


def free_port() -> int:
    """A free TCP port on this machine, for the actors' torch.distributed rendezvous."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def cluster_resources() -> dict:
    """The resources the cluster's nodes advertise together (CPU, GPU, and any custom ones given to ray start)."""
    import ray

    return ray.cluster_resources()


def ping_seconds() -> float:
    """What Ray itself costs to start one actor: a new worker process, registered, answering one call."""
    import ray

    @ray.remote(num_cpus=0)
    class Empty:
        def ping(self) -> int:
            return os.getpid()

    t = time.perf_counter()
    actor = Empty.remote()
    ray.get(actor.ping.remote())
    seconds = time.perf_counter() - t
    ray.kill(actor)
    return seconds


# --8<-- [start:pool]
class ResourcePool:
    """`bundles` bundles of {CPU: cpus, GPU: 1 (+ the custom resource `on`)}, reserved together."""

    def __init__(self, name: str, bundles: int, strategy: str = "PACK", cpus: float = 1.0, on: str = ""):
        from ray.util.placement_group import placement_group

        bundle = {"CPU": cpus, "GPU": 1.0, **({on: 0.001} if on else {})}
        self.name, self.strategy, self.size = name, strategy, bundles
        self.pg = placement_group([dict(bundle) for _ in range(bundles)], strategy=strategy)

    def ready(self, timeout: float) -> None:
        import ray

        ready, _ = ray.wait([self.pg.ready()], timeout=timeout)
        if not ready:
            raise JobFailed(0, f"the {self.name} pool ({self.size} bundles, {self.strategy}) could not be placed "
                               f"within {timeout:g} s: the cluster lacks the resources its bundles ask for")

    def describe(self) -> dict:
        """What Ray reserved: each bundle's resources and the node it landed on (from the GCS's table)."""
        from ray.util.placement_group import placement_group_table

        table = placement_group_table(self.pg)
        return {"name": self.name, "strategy": self.strategy,
                "bundles": [{"index": i, "resources": table["bundles"][i], "node_id": table["bundles_to_node_id"][i]}
                            for i in range(self.size)]}
# --8<-- [end:pool]


# --8<-- [start:group]
class WorkerGroup:
    """One RoleWorker actor per bundle of `pool` (bundles first .. first + n - 1), all with the same role.
    `share` is the fraction of each bundle an actor takes: 1 when it has the bundle alone; several groups on the
    same pool with share 1/k would be k roles co-located on each bundle."""

    def __init__(self, role: str, pool: ResourcePool, settings: dict, threads: int, n: int | None = None,
                 first: int = 0, first_rank: int = 0, share: float = 1.0):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_cls = ray.remote(RoleWorker)
        self.role, self.pool, self.first_rank = role, pool, first_rank
        self.indices = list(range(first, first + (n if n is not None else pool.size - first)))
        self.actors = [actor_cls.options(num_cpus=pool_cpus(pool) * share, num_gpus=share, max_restarts=0,
                                         scheduling_strategy=PlacementGroupSchedulingStrategy(pool.pg, i))
                       .remote(role, first_rank + k, settings, threads) for k, i in enumerate(self.indices)]
        self.where = [{} for _ in self.actors]

    def call(self, method: str, *args, **kwargs) -> list:
        """The same call on every actor of the group: a list of ObjectRefs, returned at once."""
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def call_each(self, method: str, per_actor: list[tuple]) -> list:
        return [getattr(a, method).remote(*args) for a, args in zip(self.actors, per_actor)]

    def started(self, timeout: float) -> list[dict]:
        """Wait until every actor has built its models; each says where it runs (node, pid, resources)."""
        self.where = self.gather(self.call("whereabouts"), "start-up", -1, timeout)
        for w, i in zip(self.where, self.indices):
            w.update(pool=self.pool.name, bundle=i)
        return self.where

    def gather(self, refs: list, phase: str, it: int, timeout: float | None = None) -> list:
        return gather([(r, self, k) for k, r in enumerate(refs)], phase, it, timeout)

    def kill(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
# --8<-- [end:group]


def pool_cpus(pool: ResourcePool) -> float:
    from ray.util.placement_group import placement_group_table

    return placement_group_table(pool.pg)["bundles"][0].get("CPU", 0.0)


# --8<-- [start:gather]
def gather(items: list[tuple], phase: str, it: int, timeout: float | None = None) -> list:
    """ray.get of (ref, group, k) items, in order. The first actor that died is reported by its role, rank, pid
    and node (as it told us at start-up): JobFailed, one line; the driver's `finally` then shuts Ray down."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    out = []
    for ref, group, k in items:
        try:
            out.append(ray.get(ref, timeout=timeout))
        except RayActorError as err:
            w, name = group.where[k] or {}, f"{group.role}-{group.first_rank + k}"
            cause = str(err).strip().splitlines()[0][:120] if str(err).strip() else type(err).__name__
            raise JobFailed(k, f"{ROLE_NAMES[group.role]} actor {name} (pid {w.get('pid', '?')}, node "
                               f"{w.get('node_id', '?')}) died in {phase} of iteration {it}: {cause}") from None
        except GetTimeoutError:
            raise JobFailed(k, f"{group.role}-{group.first_rank + k} did not finish {phase} of iteration {it} "
                               f"within {timeout:g} s (--timeout)") from None
    return out
# --8<-- [end:gather]


# --8<-- [start:worker]
class RoleWorker:
    """The process of one role: 'all' (co-located: four models and an engine), 'trainer' (four models) or
    'rollout' (an engine). Its methods are chapter 14's shared work (mlsys.rlhf_shards), timed."""

    def __init__(self, role: str, rank: int, settings: dict, threads: int):
        import torch

        from mlsys import rlhf_shards as work

        torch.set_num_threads(threads)  # as many threads as a launcher rank gets: the same kernels, the same bits
        self.role, self.rank, self.args, self.work = role, rank, SimpleNamespace(**settings), work
        self.params = None
        self.reset()

    def reset(self) -> None:
        """Fresh models (seeded as at start-up), an empty timeline: the same process and sync group, reused for
        the next placement as if newly started."""
        self.models, self.opts, self.kl_ctl, self.engine, self.cfg = self.work.setup(self.role, self.args.seed)
        self.events: list[tuple[str, float, float]] = []  # (phase, start, end) on time.time()
        self.batch = None
        if self.params is not None:
            self._plan()

    def _span(self, phase: str, start: float) -> None:
        self.events.append((phase, start, time.time()))

    def _fault(self, phase: str, it: int) -> None:
        """The planted fault (--fault): this process is killed mid-iteration, as an out-of-memory kill would."""
        if self.args.fault == phase and self.args.fault_iteration == it and self.rank == self.args.fault_rank:
            os.kill(os.getpid(), signal.SIGKILL)

    def whereabouts(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        node_id = ctx.get_node_id()
        node = next((n for n in ray.nodes() if n["NodeID"] == node_id), {})
        custom = sorted(k for k in node.get("Resources", {}) if k not in ("CPU", "GPU", "memory",
                        "object_store_memory") and not k.startswith(("node:", "accelerator_type")))
        held = {}
        for name, m in (("actor", self.models and self.models.actor), ("critic", self.models and self.models.critic),
                        ("reward_model", self.models and self.models.reward_model),
                        ("reference", self.models and self.models.reference),
                        ("engine", self.engine and self.engine.model)):
            if m:
                held[name] = m
        return {"role": self.role, "rank": self.rank, "pid": os.getpid(), "node_id": node_id,
                "ip": ray.util.get_node_ip_address(),
                "node_resources": custom, "assigned": ctx.get_assigned_resources(),
                "held": self.work.holdings(**held)}

    def free_port(self) -> int:
        return free_port()

    def generate(self, it: int, shards: list[int]) -> list:
        t = time.time()
        out = []
        for s in shards:
            out.append((s, self.work.generate_shard(self.engine, self.args, it, s)))
            self._fault("generate", it)  # after the first shard: mid-iteration
        self._span("generate", t)
        return out

    def _merge(self, parts: tuple) -> object:
        return self.work.merge([b for _, b in sorted((x for p in parts for x in p), key=lambda x: x[0])])

    def score(self, micro: list[int], *parts) -> list:
        """Co-located: merge every actor's shards (the refs resolved by Ray), score this actor's micro-batches."""
        self.batch = self._merge(parts)
        t = time.time()
        out = [(m, self.work.score_micro_batch(self.models, self.batch, self.args, m)) for m in micro]
        self._span("score", t)
        return out

    def train(self, *scored) -> dict:
        """Co-located: every micro-batch's scores, then the PPO step and the engine reload (same process)."""
        extras = [e for _, e in sorted((x for p in scored for x in p), key=lambda x: x[0])]
        t = time.time()
        stats = self.work.train_on(self.models, self.opts, self.kl_ctl, self.cfg, self.batch, extras)
        self.engine.load_weights(self.models.actor.state_dict())  # a memory copy, no network
        self._span("train", t)
        return stats

    def score_and_train(self, it: int, *parts) -> dict:
        """The trainer: merge the rollout actors' shards, score every micro-batch, train."""
        batch = self._merge(parts)
        t = time.time()
        extras = [self.work.score_micro_batch(self.models, batch, self.args, m) for m in range(self.args.shards)]
        self._span("score", t)
        t = time.time()
        self._fault("train", it)
        stats = self.work.train_on(self.models, self.opts, self.kl_ctl, self.cfg, batch, extras)
        self._span("train", t)
        return stats

    def join_sync_group(self, address: str, port: int, rank: int, world: int, backend: str, timeout: float) -> int:
        """torch.distributed among the actors: rank 0 the trainer, 1.. the rollout actors."""
        import datetime

        import torch.distributed as dist

        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        return self._plan()

    def _plan(self) -> int:
        """The tensors this actor sends (trainer: its actor model) or receives into (rollout: its engine), and the
        bucket plan, the same on both sides."""
        from mlsys.weight_sync import named_meta, plan_buckets, unique_parameters

        self.params = unique_parameters(self.models.actor if self.role == "trainer" else self.engine.model)
        self.plan = plan_buckets(named_meta(self.params), int(self.args.bucket_mb * 2**20))
        return len(self.plan)

    def sync(self) -> None:
        """Both sides: a barrier (the wait), then the bucketed broadcast from the trainer (the transfer)."""
        import torch.distributed as dist

        from mlsys.weight_sync import broadcast_bucketed

        t = time.time()
        dist.barrier()
        self._span("comm", t)
        t = time.time()
        broadcast_bucketed(self.params, self.plan, src=0)  # rollout actors: into the engine's model, in place
        if self.engine is not None:
            self.engine.reset_prefix_cache()
        self._span("weight sync", t)

    def final_weights(self) -> dict:
        return {n: t.detach().clone() for n, t in self.models.actor.state_dict().items()}

    def timeline(self) -> list:
        return self.events

    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
# --8<-- [end:worker]
