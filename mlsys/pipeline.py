"""Pipeline parallelism: cut the GPT into stages and run GPipe or 1F1B over point-to-point messages.

Chapter 7 teaches it; the 3-D mesh of the same chapter reuses it inside a bigger job. The API:

    stages = split_gpt(model, num_stages)            # list of GPTStage; stage 0 embeds, the last has ln_f/head
    stage = stages[my_index]                         # every rank builds the same model from the seed, keeps one
    out = run_pipeline_step(stage, stage_ranks, micro_batches, targets, schedule="1f1b", group=None)
    optimizer.step()                                 # gradients are in stage.parameters(), as after loss.backward()

`run_pipeline_step(stage, stage_ranks, micro_batches, targets, schedule, group=None, sync_tied=True)`:

- `stage_ranks` is the ordered list of GLOBAL ranks that hold stages 0..p-1 (any ranks: [0, 1, 2, 3] alone, or
  [1, 3, 5, 7] inside a data x pipeline mesh). This rank must be in it; its position is its stage index.
- `group` is the process group those ranks communicate in (None: the default WORLD group). Every send and recv
  names its peer by global rank, which is what torch.distributed expects even with a subgroup.
- `schedule` is "gpipe", "1f1b", or a function (stage, p, m) -> that stage's list of ("F"|"B", micro-batch).
- `micro_batches` and `targets` are lists of m tensors (B_mb, T) of token ids, the same on every rank (the first
  stage reads the inputs, the last the targets; the others use only their shapes).
- Each micro-batch's loss is divided by m before its backward, so the gradients equal those of one backward on
  the mean loss of the whole batch (micro-batches of equal size).
- With `sync_tied=True` and p > 1, the first and last stages exchange the gradient of the tied embedding/head
  matrix and both add it (GPT-2 ties `lm_head.weight` to `wte.weight`; after the split each end holds a copy).
- Returns a dict: `loss` (mean over micro-batches, last stage only, else None), `events` (one per compute op:
  dict(kind "F"/"B", mb, start, end) with time.perf_counter() stamps, a clock shared by the processes of one
  machine), `actions` (this stage's order of operations), `peak_in_flight` (most micro-batches whose forward
  had run and whose backward had not) and `peak_activation_bytes` (the most bytes autograd held saved for the
  in-flight micro-batches, parameters excluded; measured with saved-tensor hooks).

Sends are non-blocking (isend; completed at the end of the step) and receives block until the data is there, so
no schedule that is valid on paper can deadlock; each channel keeps the receive for its next message posted ahead.
Tags keep activations (forward) and gradients (backward) apart. Under torch.profiler the runner's work shows up
by name (record_function): "F3" / "B3" (compute of micro-batch 3), "recv act 3" / "recv grad 3" (blocked waiting
for that message), "send act 3" / "send grad 3" (posting it), "wait for sends" and "tied grad exchange".

Also here: `schedule_actions` (the order of operations of a stage), `check_actions`, `max_in_flight`,
`bubble_fraction` ((p - 1) / (m + p - 1)), `simulate` (the ideal timeline of a schedule), `measured_bubble`
(idle fractions from a timeline), and `sync_tied_grads`. A custom stage module works too: it needs
`forward(x)` (token ids in on the first stage, logits out on the last), a `config.n_embd` (the activation width)
and, if its two ends share a matrix, `tied_weight()` returning that end's copy (None elsewhere).

References: GPipe (Huang et al., https://arxiv.org/abs/1811.06965); 1F1B from PipeDream-Flush as used in
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (https://arxiv.org/abs/2104.04473).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

from mlsys.model import GPT

SCHEDULES = ("gpipe", "1f1b")
_TAG_ACT, _TAG_GRAD = 0, 1


# ----------------------------------------------------------------------------------------------- formulas
def bubble_fraction(num_stages: int, num_micro: int) -> float:
    """Idle fraction of every stage, (p - 1) / (m + p - 1), for equal stages and equal forward/backward times.

    A step lasts (m + p - 1) slots of one micro-batch's forward + backward; each stage is busy for m of them.
    """
    if num_stages < 1 or num_micro < 1:
        raise ValueError(f"need p >= 1 and m >= 1, got p={num_stages}, m={num_micro}")
    return (num_stages - 1) / (num_micro + num_stages - 1)


def schedule_actions(schedule: str, stage: int, num_stages: int, num_micro: int) -> list[tuple[str, int]]:
    """The order of operations of one stage: [("F", 0), ("F", 1), ..., ("B", 0), ...].

    gpipe: all m forwards, then all m backwards.
    1f1b:  warm up with min(p - 1 - s, m) forwards, then alternate one forward and one backward, then drain the
           remaining backwards. A stage never holds more than p - s micro-batches between forward and backward.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {SCHEDULES}")
    if not 0 <= stage < num_stages or num_micro < 1:
        raise ValueError(f"need 0 <= stage < p and m >= 1, got stage={stage}, p={num_stages}, m={num_micro}")
    if schedule == "gpipe":
        return [("F", i) for i in range(num_micro)] + [("B", i) for i in range(num_micro)]
    warmup = min(num_stages - 1 - stage, num_micro)
    actions = [("F", i) for i in range(warmup)]
    for i in range(num_micro - warmup):  # steady state: forward of i + warmup, then backward of i
        actions += [("F", warmup + i), ("B", i)]
    actions += [("B", i) for i in range(num_micro - warmup, num_micro)]  # cool-down
    return actions


def check_actions(actions: Sequence[tuple[str, int]], num_micro: int) -> None:
    """Raise ValueError unless `actions` runs every micro-batch's forward, then its backward, both in order 0..m-1.

    Messages on a channel arrive in micro-batch order, so forwards and backwards must each go in that order.
    """
    fwd = [i for k, i in actions if k == "F"]
    bwd = [i for k, i in actions if k == "B"]
    if fwd != list(range(num_micro)) or bwd != list(range(num_micro)) or len(actions) != 2 * num_micro:
        raise ValueError(f"want forwards and backwards of micro-batches 0..{num_micro - 1} in order, got {actions}")
    done: set[int] = set()
    for kind, i in actions:
        if kind == "B" and i not in done:
            raise ValueError(f"backward of micro-batch {i} before its forward in {actions}")
        done.add(i)


def max_in_flight(actions: Sequence[tuple[str, int]]) -> int:
    """Most micro-batches forwarded and not yet backwarded at any point of an action list."""
    live = peak = 0
    for kind, _ in actions:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def simulate(schedule: Any, num_stages: int, num_micro: int, t_fwd: float | Sequence[float] = 1.0,
             t_bwd: float | Sequence[float] = 2.0) -> list[list[dict]]:
    """The ideal timeline: every forward takes t_fwd, every backward t_bwd, messages arrive instantly.

    t_fwd and t_bwd are one number for every stage, or one number per stage (t_fwd[s]: a forward on stage s).

    F(i) on stage s waits for F(i) on s-1; B(i) waits for B(i) on s+1 (the last stage: for its own F(i)).
    Returns events[s] = [{kind, mb, start, end}], the same shape as the measured ones. Raises on a deadlock.
    """
    tf = list(t_fwd) if isinstance(t_fwd, Sequence) else [t_fwd] * num_stages
    tb = list(t_bwd) if isinstance(t_bwd, Sequence) else [t_bwd] * num_stages
    orders = [schedule(s, num_stages, num_micro) if callable(schedule) else
              schedule_actions(schedule, s, num_stages, num_micro) for s in range(num_stages)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, mb, stage) -> end time
    free = [0.0] * num_stages
    nxt = [0] * num_stages
    events: list[list[dict]] = [[] for _ in range(num_stages)]
    while any(nxt[s] < len(orders[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            if nxt[s] == len(orders[s]):
                continue
            kind, i = orders[s][nxt[s]]
            dep = ("F", i, s - 1) if kind == "F" else ("F", i, s) if s == num_stages - 1 else ("B", i, s + 1)
            if kind == "F" and s == 0:
                ready = 0.0
            elif dep in done:
                ready = done[dep]
            else:
                continue
            start = max(free[s], ready)
            free[s] = done[(kind, i, s)] = start + (tf[s] if kind == "F" else tb[s])
            events[s].append({"kind": kind, "mb": i, "start": start, "end": free[s]})
            nxt[s] += 1
            progressed = True
        if not progressed:
            raise ValueError(f"the schedule deadlocks: {orders}")
    return events


def measured_bubble(events: Sequence[Sequence[dict]]) -> dict[str, Any]:
    """Idle fractions from a timeline: events[s] are stage s's compute ops (dicts with start and end).

    The step runs from the first compute start on any stage to the last compute end on any stage; a stage's
    idle time is that span minus the time it spent computing.
    """
    start = min(e["start"] for stage in events for e in stage)
    end = max(e["end"] for stage in events for e in stage)
    span = end - start
    busy = [sum(e["end"] - e["start"] for e in stage) for stage in events]
    per_stage = [1.0 - b / span for b in busy]
    return {"span": span, "busy": busy, "per_stage": per_stage, "mean": sum(per_stage) / len(per_stage)}


# ----------------------------------------------------------------------------------------------- the stages
class GPTStage(nn.Module):
    """A contiguous slice of a GPT: [embeddings] + blocks[a:b] + [ln_f, lm_head].

    forward(x): the first stage takes token ids (B, T), the others activations (B, T, C); the last returns logits
    (B, T, V), the others activations (B, T, C).
    """

    def __init__(self, model: GPT, first: int, last: int, index: int, num_stages: int):
        super().__init__()
        self.config, self.index, self.num_stages = model.config, index, num_stages
        self.layer_range = (first, last)
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        if self.is_first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.h = nn.ModuleList(model.h[first:last])
        if self.is_last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def global_name(self, name: str) -> str:
        """This stage's parameter name as the whole GPT calls it: h.0.* of stage [2, 4) is h.2.*."""
        if name.startswith("h."):
            local, rest = name[2:].split(".", 1)
            return f"h.{int(local) + self.layer_range[0]}.{rest}"
        return name

    def tied_weight(self) -> nn.Parameter | None:
        """This stage's copy of the embedding/head matrix when the two ends are different stages."""
        if self.num_stages == 1:
            return None
        return self.wte.weight if self.is_first else self.lm_head.weight if self.is_last else None

    embed, head = GPT.embed, GPT.head  # the GPT's own two ends, run on the modules this stage holds

    # --8<-- [start:stage]
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            pos = torch.arange(x.size(1), device=x.device)  # (T,)
            x = self.drop(self.embed(x, pos)[0])  # (B, T, C)
        for block in self.h:
            x = block(x)
        if self.is_last:
            x = self.head(x)  # (B, T, V): final norm, then the head
        return x
    # --8<-- [end:stage]


def split_gpt(model: GPT, num_stages: int, boundaries: Sequence[int] | None = None) -> list[GPTStage]:
    """Cut `model` into `num_stages` independent stages (deep copies; `model` is left untouched).

    Layers are spread as evenly as possible (the first n_layer % p stages take one more) unless `boundaries`
    gives the p + 1 layer indices [0, ..., n_layer]. With p > 1 the head of the last stage gets its own copy of
    the tied matrix; `run_pipeline_step` keeps the two copies' gradients equal.
    """
    n = model.config.n_layer
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} stages (need 1 <= p <= n_layer)")
    if boundaries is None:
        sizes = [n // num_stages + (1 if s < n % num_stages else 0) for s in range(num_stages)]
        boundaries = [sum(sizes[:s]) for s in range(num_stages + 1)]
    if len(boundaries) != num_stages + 1 or boundaries[0] != 0 or boundaries[-1] != n or \
            any(a >= b for a, b in zip(boundaries, boundaries[1:])):
        raise ValueError(f"bad boundaries {list(boundaries)} for {n} layers in {num_stages} stages")
    stages = []
    for s in range(num_stages):
        clone = copy.deepcopy(model)  # each stage owns its tensors, as it would on its own device
        if num_stages > 1:
            clone.lm_head.weight = nn.Parameter(clone.wte.weight.detach().clone())  # untie: two copies
        stages.append(GPTStage(clone, boundaries[s], boundaries[s + 1], s, num_stages))
    return stages


# ----------------------------------------------------------------------------------------------- the runner
class _ActivationMeter:
    """Bytes autograd saves for backward, per micro-batch, parameters excluded (saved_tensors_hooks)."""

    def __init__(self, module: nn.Module):
        self.param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.live: dict[int, dict[int, int]] = {}  # micro-batch -> {storage ptr: bytes}
        self.peak_bytes = 0

    def hooks(self, mb: int) -> Any:
        saved = self.live.setdefault(mb, {})

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.param_storages:
                saved[storage.data_ptr()] = storage.nbytes()  # views of one buffer count once
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def update(self) -> None:
        self.peak_bytes = max(self.peak_bytes, sum(sum(d.values()) for d in self.live.values()))

    def release(self, mb: int) -> None:
        self.live.pop(mb, None)


class _Receiver:
    """The receiving end of this stage's two channels (activations from s-1, gradients from s+1).

    Messages on a channel arrive in micro-batch order, so after taking one message the receiver posts the irecv
    for the next one at once: the peer's isend then finds a waiting receiver and delivers while this stage
    computes. Communication only; the compute lives in _StageStep.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, group: Any):
        self.dtype, self.device, self.group = dtype, device, group
        self.posted: dict[int, tuple[torch.Tensor, Any]] = {}  # tag -> the receive posted for the next message

    def _post(self, shape: tuple, src: int, tag: int) -> None:
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.posted[tag] = (buf, dist.irecv(buf, src=src, group=self.group, tag=tag))

    def recv(self, shape: tuple, src: int, tag: int, more: bool, name: str) -> torch.Tensor:
        """The next message from `src` on channel `tag`; with `more`, post the receive for the one after it.
        `name` labels the wait in a torch.profiler trace ("recv act 3")."""
        if tag not in self.posted:
            self._post(shape, src, tag)
        buf, work = self.posted.pop(tag)
        with record_function(name):
            work.wait()  # blocks until the peer's message is in
        if more:
            self._post(shape, src, tag)
        return buf


class _StageStep:
    """One stage's state during one step: what it received, what it produced, the sends still in flight."""

    def __init__(self, stage: nn.Module, stage_ranks: Sequence[int], micro_batches: Sequence[torch.Tensor],
                 targets: Sequence[torch.Tensor], group: Any):
        self.stage, self.micro_batches, self.targets, self.group = stage, micro_batches, targets, group
        self.s, self.p, self.m = list(stage_ranks).index(dist.get_rank()), len(stage_ranks), len(micro_batches)
        self.prev_rank = stage_ranks[self.s - 1] if self.s > 0 else None
        self.next_rank = stage_ranks[self.s + 1] if self.s < self.p - 1 else None
        self.param = next(stage.parameters())
        self.width = stage.config.n_embd if hasattr(stage, "config") else self.param.size(-1)
        self.receiver = _Receiver(self.param.dtype, self.param.device, group)
        self.inputs: dict[int, torch.Tensor] = {}  # micro-batch -> the activation received (requires grad)
        self.outputs: dict[int, torch.Tensor] = {}  # micro-batch -> this stage's output (or the scaled loss)
        self.pending: list[tuple[torch.Tensor, Any]] = []  # (tensor, isend handle), waited for at the end
        self.events: list[dict] = []
        self.losses: list[torch.Tensor] = []
        self.meter = _ActivationMeter(stage)

    def clock(self) -> float:
        if self.param.is_cuda:  # GPU kernels run asynchronously: wait for them, or the stamps time only the launches
            torch.cuda.synchronize(self.param.device)
        return time.perf_counter()

    # --8<-- [start:forward]
    def forward(self, i: int) -> None:
        s, p, m, param = self.s, self.p, self.m, self.param
        B, T = self.micro_batches[i].shape
        if s == 0:
            x = self.micro_batches[i].to(param.device)  # (B, T) token ids
        else:  # the activation of micro-batch i from stage s-1, (B, T, C)
            x = self.receiver.recv((B, T, self.width), self.prev_rank, _TAG_ACT, i < m - 1, f"recv act {i}")
            x.requires_grad_()
            self.inputs[i] = x
        with record_function(f"F{i}"):  # names the forward in a torch.profiler trace
            start = self.clock()
            with self.meter.hooks(i):
                out = self.stage(x)  # (B, T, C), or logits (B, T, V) on the last stage
                if s == p - 1:
                    loss = F.cross_entropy(out.flatten(0, 1), self.targets[i].to(param.device).flatten())
                    self.losses.append(loss.detach())
                    out = loss / m  # each micro-batch contributes 1/m of the batch's mean loss
            self.events.append({"kind": "F", "mb": i, "start": start, "end": self.clock()})
        self.outputs[i] = out
        if s < p - 1:
            sent = out.detach()
            with record_function(f"send act {i}"):
                self.pending.append((sent, dist.isend(sent, dst=self.next_rank, group=self.group, tag=_TAG_ACT)))
    # --8<-- [end:forward]

    # --8<-- [start:backward]
    def backward(self, i: int) -> None:
        s, p, m = self.s, self.p, self.m
        out = self.outputs.pop(i)
        # dL/d(out) from stage s+1 (the last stage starts from its loss)
        grad = None if s == p - 1 else self.receiver.recv(tuple(out.shape), self.next_rank, _TAG_GRAD, i < m - 1,
                                                          f"recv grad {i}")
        with record_function(f"B{i}"):
            start = self.clock()
            torch.autograd.backward(out, grad)  # frees this micro-batch's saved activations
            self.events.append({"kind": "B", "mb": i, "start": start, "end": self.clock()})
        self.meter.release(i)
        if s > 0:
            x = self.inputs.pop(i)
            with record_function(f"send grad {i}"):
                self.pending.append((x.grad, dist.isend(x.grad, dst=self.prev_rank, group=self.group,
                                                        tag=_TAG_GRAD)))
    # --8<-- [end:backward]

    def wait_for_sends(self) -> None:
        with record_function("wait for sends"):
            for _, work in self.pending:  # the tensor stays referenced until its send is complete
                work.wait()


def run_pipeline_step(stage: nn.Module, stage_ranks: Sequence[int], micro_batches: Sequence[torch.Tensor],
                      targets: Sequence[torch.Tensor], schedule: Any = "1f1b", group: Any = None,
                      sync_tied: bool = True) -> dict[str, Any]:
    """Forward and backward of m micro-batches through the p stages on `stage_ranks` (see the module docstring).

    Gradients accumulate into `stage`'s parameters (call zero_grad before, optimizer.step after).
    """
    me = dist.get_rank()
    if me not in stage_ranks:
        raise ValueError(f"rank {me} is not in the pipeline {list(stage_ranks)}")
    m = len(micro_batches)
    if len(targets) != m:
        raise ValueError(f"{m} micro-batches but {len(targets)} targets")
    if len({tuple(x.shape) for x in micro_batches}) != 1:
        raise ValueError("micro-batches must all have the same shape (the loss of each is weighted 1/m)")
    step = _StageStep(stage, stage_ranks, micro_batches, targets, group)
    actions = schedule(step.s, step.p, m) if callable(schedule) else schedule_actions(schedule, step.s, step.p, m)
    check_actions(actions, m)
    live = peak_live = 0
    for kind, i in actions:
        if kind == "F":
            step.forward(i)
            live += 1
            step.meter.update()
        else:
            step.backward(i)
            live -= 1
        peak_live = max(peak_live, live)
    step.wait_for_sends()
    if sync_tied and step.p > 1:
        with record_function("tied grad exchange"):
            sync_tied_grads(stage, stage_ranks, group)
    return {
        "loss": float(torch.stack(step.losses).mean()) if step.losses else None,
        "events": step.events,
        "actions": actions,
        "stage": step.s,
        "peak_in_flight": peak_live,
        "peak_activation_bytes": step.meter.peak_bytes,
    }


# --8<-- [start:tied]
def sync_tied_grads(stage: nn.Module, stage_ranks: Sequence[int], group: Any = None) -> None:
    """First and last stage swap the gradient of their copy of the tied matrix and both keep the sum.

    In one process the tied matrix gets the embedding's gradient plus the head's; here each end computed one half.
    Both add in the same order (first + last), so the two copies stay bit-identical after the optimizer step.
    """
    getter = getattr(stage, "tied_weight", None)
    weight = getter() if callable(getter) else None
    me, first, last = dist.get_rank(), stage_ranks[0], stage_ranks[-1]
    if me not in (first, last) or first == last:
        return
    if weight is None:
        return  # nothing tied (both ends are the same kind of module, so both skip)
    if weight.grad is None:
        raise RuntimeError("the tied weight has no gradient: run the backward pass first")
    peer = last if me == first else first
    theirs = torch.empty_like(weight.grad)
    ops = [dist.P2POp(dist.isend, weight.grad, peer, group), dist.P2POp(dist.irecv, theirs, peer, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    mine = weight.grad.clone()
    weight.grad.copy_(mine + theirs if me == first else theirs + mine)
# --8<-- [end:tied]
