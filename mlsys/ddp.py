"""Data parallelism by hand: three versions of DistributedDataParallel, from obvious to fast.

Every rank holds a full copy of the model and computes gradients on its own micro-batch; before the optimizer
step, the ranks average their gradients so that every copy takes the same step. The three wrappers differ only in
HOW the averaging is communicated (Chapter 5 measures them against torch.nn.parallel.DistributedDataParallel):

    NaiveDDP       after backward, one all-reduce per parameter            (many small messages)
    BucketedDDP    after backward, one all-reduce per flat bucket of ~MB   (few large messages)
    OverlappedDDP  during backward: a hook on each parameter fills its bucket, and a full bucket's all-reduce
                   is launched asynchronously while autograd keeps computing the earlier layers' gradients

Usage is the same for all three (and close to torch's DDP, which does the synchronisation inside backward):

    ddp = OverlappedDDP(model, bucket_mb=1.0)        # broadcasts rank 0's parameters to every rank
    loss = loss_fn(ddp(x), y)
    loss.backward()
    ddp.finish_gradient_synchronization()            # waits for the all-reduces: grads are now the average
    optimizer.step()

Averaging follows torch's DDP: each gradient is multiplied by 1/W while it is copied into the bucket and the
bucket is then summed (all-reduce SUM), so the result is mean_r(grad_r) on every rank. Buckets are filled in the
REVERSE order of `module.parameters()`, because backward produces the last layers' gradients first.
Reference: Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020,
https://arxiv.org/abs/2006.15704 (sections 3.2.3 and 3.2.4: bucketing and overlapping).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

MB = 2**20  # bucket sizes are in MiB, as torch's bucket_cap_mb


def rank_batches(tokens: torch.Tensor, rank: int, world_size: int, batch_size: int, block_size: int, seed: int,
                 count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` batches (x, y), each (batch_size, block_size), that rank `rank` trains on.

    Rank r reads only its own contiguous shard of the token stream (mlsys.data.shard) and draws windows from it with
    a generator seeded from (seed, r): every rank sees different data, and any process can rebuild any rank's
    batches -- which is how a single process computes the global-batch reference.
    """
    from mlsys.data import get_batch, shard

    part = shard(tokens, rank, world_size)
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    return [get_batch(part, batch_size, block_size, gen) for _ in range(count)]


# --8<-- [start:token_loss]
def global_token_mean(loss_sum: torch.Tensor, num_tokens: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The loss a rank backpropagates through a DDP wrapper when ranks hold different numbers of tokens.

    `loss_sum` is this rank's SUM of per-token losses over its `num_tokens` tokens. The global-batch loss is
    (1/N) sum_i l_i with N = sum_r n_r, but every DDP wrapper (torch's and the ones below) divides the summed
    gradient by W. So a rank divides its sum by N/W, not by N: after DDP's 1/W the gradient is
    (1/N) sum_r grad(loss_sum_r), the global-batch gradient. Dividing by N alone would leave it W times too small.
    Costs one extra all-reduce of a scalar (N).
    """
    total = torch.tensor([float(num_tokens)], device=loss_sum.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)  # N, the same on every rank
    return loss_sum / (total[0] / dist.get_world_size(group))
# --8<-- [end:token_loss]


def broadcast_parameters(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Make every rank start from the group's first rank's parameters and buffers (what torch's DDP does)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src, group=group)


# --8<-- [start:assign]
def assign_buckets(numels: list[int], element_size: int, bucket_bytes: int) -> list[list[int]]:
    """Group tensors, in the order given, into buckets of at least `bucket_bytes` (the last may be smaller).

    A tensor is added to the open bucket; once the bucket holds `bucket_bytes` or more, it is closed. So a bucket
    overshoots the cap by less than one tensor, and a tensor bigger than the cap gets a bucket of its own. This is
    the rule of torch.distributed._compute_bucket_assignment_by_size (the tests compare the two).
        numels [10, 300, 5, 700, 20], 4-byte floats, cap 1000 B  ->  [[0, 1], [2, 3], [4]]
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, numel in enumerate(numels):
        current.append(index)
        filled += numel * element_size
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets
# --8<-- [end:assign]


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]  # parameters() yields a tied weight once


class _DDPBase(nn.Module):
    """Holds the module, the group and the counters every version reports."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.module, self.group = module, group
        self.world_size = dist.get_world_size(group)
        self.params = _trainable(module)
        self.allreduce_calls = 0  # collectives launched since construction
        self.allreduce_bytes = 0  # bytes handed to all_reduce since construction
        broadcast_parameters(module, group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        self.allreduce_calls += 1
        self.allreduce_bytes += tensor.numel() * tensor.element_size()
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError


# --8<-- [start:naive]
class NaiveDDP(_DDPBase):
    """Step 1: after backward, average every parameter's gradient with its own all-reduce."""

    def finish_gradient_synchronization(self) -> None:
        for p in self.params:
            if p.grad is None:  # a parameter this rank did not use still joins the collective
                p.grad = torch.zeros_like(p)
            p.grad.mul_(1.0 / self.world_size)  # pre-divide, then sum: the mean over ranks
            self._all_reduce(p.grad)
# --8<-- [end:naive]


# --8<-- [start:bucketed]
class BucketedDDP(_DDPBase):
    """Step 2: after backward, copy gradients into a few flat buffers and all-reduce each buffer once."""

    def __init__(self, module: nn.Module, bucket_mb: float = 25.0, group: dist.ProcessGroup | None = None):
        super().__init__(module, group)
        order = self.params[::-1]  # backward produces the LAST layers' gradients first
        sizes = [p.numel() for p in order]
        self.buckets: list[list[nn.Parameter]] = [
            [order[i] for i in idx] for idx in assign_buckets(sizes, order[0].element_size(), int(bucket_mb * MB))]
        self.buffers = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
                        for b in self.buckets]  # one flat (numel,) buffer per bucket, reused every step
        self.slots: dict[nn.Parameter, tuple[int, torch.Tensor]] = {}  # param -> (bucket, view of its slice)
        for i, (bucket, buf) in enumerate(zip(self.buckets, self.buffers)):
            offset = 0
            for p in bucket:
                self.slots[p] = (i, buf[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def _fill(self, p: nn.Parameter) -> None:
        """Copy p's gradient into its slot of the bucket, divided by W (zeros if p got no gradient)."""
        _, slot = self.slots[p]
        if p.grad is None:
            slot.zero_()
        else:
            torch.mul(p.grad, 1.0 / self.world_size, out=slot)

    def _unpack(self, i: int) -> None:
        """Copy the averaged bucket back into the .grad of its parameters."""
        for p in self.buckets[i]:
            slot = self.slots[p][1]
            if p.grad is None:
                p.grad = slot.clone()
            else:
                p.grad.copy_(slot)

    def finish_gradient_synchronization(self) -> None:
        for i, bucket in enumerate(self.buckets):
            for p in bucket:
                self._fill(p)
            self._all_reduce(self.buffers[i])
            self._unpack(i)
# --8<-- [end:bucketed]


# --8<-- [start:overlapped]
class OverlappedDDP(BucketedDDP):
    """Step 3: launch each bucket's all-reduce from inside backward, as soon as its last gradient is ready."""

    def __init__(self, module: nn.Module, bucket_mb: float = 25.0, group: dist.ProcessGroup | None = None):
        super().__init__(module, bucket_mb, group)
        self.sync_enabled = True
        self._reset()
        for p in self.params:  # fires once per step, after p.grad holds the sum of all its contributions
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _reset(self) -> None:
        self.missing = [len(b) for b in self.buckets]  # gradients each bucket still waits for
        self.next_bucket = 0  # buckets are launched strictly in index order, identical on every rank
        self.handles: list[dist.Work] = []

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.sync_enabled:  # inside no_sync(): gradients just accumulate locally
            return
        i, _ = self.slots[p]
        self._fill(p)
        self.missing[i] -= 1
        # Launch every consecutive full bucket. If bucket 3 fills before bucket 2, it waits for bucket 2: the
        # ranks must issue their collectives in the same order, whatever order the gradients arrived in.
        while self.next_bucket < len(self.buckets) and self.missing[self.next_bucket] == 0:
            self.handles.append(self._all_reduce(self.buffers[self.next_bucket], async_op=True))
            self.next_bucket += 1

    def finish_gradient_synchronization(self) -> None:
        if not self.sync_enabled:
            return
        if self.next_bucket < len(self.buckets):  # torch's DDP would need find_unused_parameters=True here
            waiting = {id(p) for p in self.buckets[self.next_bucket]}
            stuck = [n for n, p in self.module.named_parameters() if id(p) in waiting and p.grad is None]
            raise RuntimeError(f"bucket {self.next_bucket} never filled: no gradient for {stuck or 'some params'}")
        for i, handle in enumerate(self.handles):
            handle.wait()  # the all-reduce of bucket i is done: its buffer holds the average
            self._unpack(i)
        self._reset()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this block skip communication (gradient accumulation, as torch's no_sync)."""
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = True
# --8<-- [end:overlapped]


IMPLEMENTATIONS = {"naive": NaiveDDP, "bucketed": BucketedDDP, "overlapped": OverlappedDDP}


def wrap(kind: str, module: nn.Module, bucket_mb: float = 25.0, group: dist.ProcessGroup | None = None):
    """One of "naive", "bucketed", "overlapped" (hand-written) or "torch" (torch's DistributedDataParallel).

    The returned object has .module and finish_gradient_synchronization() (a no-op for torch's DDP, which
    synchronises inside backward), so a training loop can switch between them with one flag.
    """
    if kind == "torch":
        ddp = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_mb, process_group=group)
        ddp.finish_gradient_synchronization = lambda: None  # type: ignore[attr-defined]
        return ddp
    if kind == "naive":
        return NaiveDDP(module, group)
    if kind not in IMPLEMENTATIONS:
        raise ValueError(f"unknown DDP kind {kind!r}; choose naive, bucketed, overlapped or torch")
    return IMPLEMENTATIONS[kind](module, bucket_mb, group)
