"""Weight synchronization from trainer ranks to rollout ranks (chapter 14).

After every policy update, the ranks that generate rollouts must serve the new weights. With the trainer and the
rollout engine in different processes, that is a broadcast from one trainer rank (`src`) to every rollout rank:

    trainer (src)                          rollout ranks (same architecture, so they know every name and shape)
    named tensors ── pack into buckets ──> broadcast(flat bucket) ──> unpack: each slice into its tensor

Two ways to send, both exact (the receivers end up bit-for-bit equal to the sender):

- per tensor: one `dist.broadcast` per parameter. Simple; each call pays the collective's fixed latency, so a model
  with hundreds of small tensors (norms, biases) is latency-bound.
- bucketed: tensors of one dtype are packed in order into flat buffers of at most `bucket_bytes` (a tensor larger
  than the bucket gets a bucket of its own) and each buffer is broadcast once. Fewer, larger messages, at the cost
  of one copy in and one copy out. This is the same trade DDP makes with its gradient buckets (chapter 5). RLHF
  frameworks push weights into vLLM/SGLang both ways: verl packs buckets of at most
  `update_weights_bucket_megabytes`; OpenRLHF's `broadcast_to_vllm` loops over the named parameters and
  broadcasts one tensor per call (vLLM's worker receives it in `update_weight(name, dtype, shape)`).

    plan = plan_buckets(named_meta(params), bucket_bytes=4 << 20)      # same plan on every rank
    broadcast_bucketed(params, plan, src=0, group=sync_group)          # params: {name: tensor}, updated in place

On GPUs the same code runs over NCCL (tensors on cuda, a group with the nccl backend); see the chapter's lesson
for what changes (NVLink bandwidth, CUDA IPC when trainer and rollout share a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


# --8<-- [start:plan]
@dataclass(frozen=True)
class Slot:
    """Where one tensor lives inside its bucket: elements offset .. offset + numel of the flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    slots: tuple[Slot, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def named_meta(tensors: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of each tensor, in the dict's order: all a receiver needs to plan the same buckets."""
    return [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]


def plan_buckets(meta: list[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int) -> list[Bucket]:
    """Greedy packing in order: a tensor joins the open bucket of its dtype if the bucket stays <= bucket_bytes,
    else that bucket is closed and a new one opened. A tensor larger than bucket_bytes travels alone.

    Deterministic from (meta, bucket_bytes), so every rank computes the same plan without talking.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    done: list[Bucket] = []
    open_: dict[torch.dtype, list[Slot]] = {}  # dtype -> slots of the bucket being filled
    for name, shape, dtype in meta:
        numel = 1
        for d in shape:
            numel *= d
        slots = open_.setdefault(dtype, [])
        used = sum(s.numel for s in slots)
        if slots and (used + numel) * _itemsize(dtype) > bucket_bytes:
            done.append(Bucket(dtype, tuple(slots)))
            slots = open_[dtype] = []
            used = 0
        slots.append(Slot(name, tuple(shape), used, numel))
    done.extend(Bucket(dtype, tuple(slots)) for dtype, slots in open_.items() if slots)
    return done
# --8<-- [end:plan]


# --8<-- [start:pack]
def pack(bucket: Bucket, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The bucket's tensors flattened into one contiguous 1-D buffer of bucket.numel elements (a copy)."""
    first = tensors[bucket.slots[0].name]
    flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=first.device)
    for s in bucket.slots:
        flat[s.offset:s.offset + s.numel].copy_(tensors[s.name].detach().reshape(-1))
    return flat


def unpack(bucket: Bucket, flat: torch.Tensor, into: dict[str, torch.Tensor]) -> None:
    """Copy each slice of `flat` back into its tensor in `into` (in place: a model's parameters stay the same
    objects, so an optimizer or an inference engine holding references sees the new values)."""
    if flat.numel() != bucket.numel or flat.dtype != bucket.dtype:
        raise ValueError(f"buffer of {flat.numel()} {flat.dtype} does not match a bucket of "
                         f"{bucket.numel} {bucket.dtype}")
    with torch.no_grad():
        for s in bucket.slots:
            into[s.name].copy_(flat[s.offset:s.offset + s.numel].view(s.shape))
# --8<-- [end:pack]


# --8<-- [start:broadcast]
def broadcast_per_tensor(tensors: dict[str, torch.Tensor], src: int, group=None) -> int:
    """One broadcast per tensor, straight into each receiver's tensor. Returns the number of collective calls."""
    with torch.no_grad():
        for t in tensors.values():
            dist.broadcast(t.data, src=src, group=group)  # .data: a leaf parameter cannot be written in place
    return len(tensors)


def broadcast_bucketed(tensors: dict[str, torch.Tensor], plan: list[Bucket], src: int, group=None) -> int:
    """One broadcast per bucket: src packs, everyone receives the flat buffer, receivers unpack in place.

    Returns the number of collective calls (len(plan)).
    """
    me = dist.get_rank()
    device = next(iter(tensors.values())).device
    for bucket in plan:
        if me == src:
            flat = pack(bucket, tensors)
        else:
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
        dist.broadcast(flat, src=src, group=group)  # (bucket.numel,)
        if me != src:
            unpack(bucket, flat, tensors)
    return len(plan)
# --8<-- [end:broadcast]


def tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit (or are missing from one side); [] when the two are identical."""
    names = set(a) | set(b)
    return sorted(n for n in names if n not in a or n not in b or not torch.equal(a[n].detach().cpu(),
                                                                                  b[n].detach().cpu()))


def unique_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name: tensor} of a model's parameters and buffers, each storage once (a tied lm_head is wte: sent once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[name] = t
    return out


# --8<-- [start:ipc]
def cuda_ipc_handles(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """Co-located trainer and rollout engine on the SAME GPU, in different processes: instead of copying bytes,
    hand over CUDA IPC handles (cudaIpcGetMemHandle under torch's reduce_tensor). The receiver maps the trainer's
    memory into its own address space: no copy, no network, but the trainer must keep the tensors alive until the
    receiver is done. Picklable: send the dict over a pipe or a gloo object collective."""
    from torch.multiprocessing.reductions import reduce_tensor

    if any(not t.is_cuda for t in tensors.values()):
        raise ValueError("CUDA IPC handles exist only for cuda tensors")
    return {name: reduce_tensor(t.detach()) for name, t in tensors.items()}


def open_cuda_ipc_handles(handles: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """The receiver's side: rebuild each tensor from its handle (views of the sender's memory)."""
    return {name: rebuild(*rebuild_args) for name, (rebuild, rebuild_args) in handles.items()}
# --8<-- [end:ipc]
