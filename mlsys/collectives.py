"""Collectives built from point-to-point messages, and what each collective costs in bytes.

`ring_all_reduce(tensor, group)` is an in-place SUM all-reduce made only of `isend`/`irecv` pairs between ring
neighbours; chapter 4 adds two more made the same way, `tree_all_reduce` (sums up a binary tree, the total back
down) and `halving_doubling_all_reduce` (Rabenseifner's, for a power-of-two world size).
`comm_volume(collective, num_bytes, world_size)` says how many bytes one process sends and receives in the
bandwidth-optimal algorithm of each collective. Chapter 3 teaches the ring and the volumes; later chapters import
them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

# A trace hook sees every step: (phase, step, send_chunk_index, recv_chunk_index, bytes_sent, chunks).
StepHook = Callable[[str, int, int, int, int, list[torch.Tensor]], None]


def _peer(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """P2P calls take global ranks; on a sub-group translate the group rank to the global one."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


# --8<-- [start:exchange]
def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group) -> None:
    """Send `send` to the right neighbour and receive `recv` from the left one, at the same time.

    Posting both before waiting is what keeps the ring from deadlocking: every rank is sending and receiving at once.
    A zero-length chunk (tensor shorter than the ring) is skipped on both ends; both sides know its length.
    """
    ops = []
    if send.numel() > 0:
        ops.append(dist.P2POp(dist.isend, send, right, group))
    if recv.numel() > 0:
        ops.append(dist.P2POp(dist.irecv, recv, left, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
# --8<-- [end:exchange]


# --8<-- [start:ring]
def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                    on_step: StepHook | None = None) -> torch.Tensor:
    """Sum `tensor` over the ranks of `group`, in place, with the ring algorithm; returns `tensor`.

    The flattened tensor is cut into W chunks (uneven when W does not divide its length: `torch.tensor_split`).
    Rank r sends to r+1 and receives from r-1. Example, W=3, chunk k of rank r written `k_r`:

        reduce-scatter (W-1 steps): send chunk (r-s), add the received chunk (r-s-1) into our copy
                     rank 0          rank 1          rank 2
          start      0_0 1_0 2_0     0_1 1_1 2_1     0_2 1_2 2_2
          step 0     sends 0         sends 1         sends 2
                     2 += 2_2        0 += 0_0        1 += 1_1
          step 1     sends 2(02)     sends 0(01)     sends 1(12)
                     1 += 1_12       2 += 2_02       0 += 0_01
          now        rank r holds the full sum of chunk (r+1): rank 0 chunk 1, rank 1 chunk 2, rank 2 chunk 0

        all-gather (W-1 steps): send the finished chunk (r+1-s), overwrite chunk (r-s) with the received one
          step 0     sends 1         sends 2         sends 0         -> each rank now has 2 finished chunks
          step 1     sends 0         sends 1         sends 2         -> each rank has all 3

    Every rank sends 2(W-1) chunks of N/W elements: 2(W-1)/W * N in all, whatever W is -- the bandwidth-optimal
    amount (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009,
    https://doi.org/10.1016/j.jpdc.2008.09.002). The price is 2(W-1) latency-bound steps.

    `on_step(phase, step, send_index, recv_index, bytes_sent, chunks)` is called after each step (for traces).
    """
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return tensor
    rank = dist.get_rank(group)  # our position in the ring, group-relative
    right, left = _peer(group, (rank + 1) % world_size), _peer(group, (rank - 1) % world_size)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()  # (N,)
    chunks = list(flat.tensor_split(world_size))  # W views of flat; sizes differ by at most 1

    # reduce-scatter: after step s, chunk (r-s-1) holds the sum over s+2 ranks
    for step in range(world_size - 1):
        send_i, recv_i = (rank - step) % world_size, (rank - step - 1) % world_size
        incoming = torch.empty_like(chunks[recv_i])
        _exchange(chunks[send_i], incoming, right, left, group)
        chunks[recv_i].add_(incoming)
        if on_step:
            on_step("reduce-scatter", step, send_i, recv_i, chunks[send_i].nbytes, chunks)

    # all-gather: rank r owns finished chunk (r+1); pass finished chunks around the ring, receiving straight in place
    for step in range(world_size - 1):
        send_i, recv_i = (rank + 1 - step) % world_size, (rank - step) % world_size
        _exchange(chunks[send_i], chunks[recv_i], right, left, group)
        if on_step:
            on_step("all-gather", step, send_i, recv_i, chunks[send_i].nbytes, chunks)

    if not tensor.is_contiguous():  # we worked on a flat copy: write the result back
        tensor.copy_(flat.view_as(tensor))
    return tensor
# --8<-- [end:ring]


# ------------------------------------------------------- two more all-reduces (chapter 4): tree, halving-doubling
# --8<-- [start:sendrecv]
def sendrecv(send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int) -> None:
    """Post a send and a receive together and wait for both (either may be absent or empty).

    Plain isend/irecv rather than batch_isend_irecv: with gloo on this CPU the batched call was the slower of the
    two for small messages (it adds bookkeeping around the same two operations)."""
    works = [dist.isend(send, dst)] if send is not None and send.numel() else []
    works += [dist.irecv(recv, src)] if recv is not None and recv.numel() else []
    for work in works:
        work.wait()
# --8<-- [end:sendrecv]


# --8<-- [start:tree]
def tree_parent(rank: int) -> int | None:
    """Binary tree in heap order: rank r's parent is (r-1)//2; rank 0 is the root.

                0
              /   \\
             1     2
            / \\   / \\
           3   4 5   6      floor(log2 p) levels below the root: p=4 -> 2, p=5 -> 2, p=8 -> 3
    """
    return None if rank == 0 else (rank - 1) // 2


def tree_children(rank: int, world_size: int) -> list[int]:
    return [c for c in (2 * rank + 1, 2 * rank + 2) if c < world_size]


def tree_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """In-place SUM: every child's partial sum flows up to rank 0, then the total flows back down."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    parent, children = tree_parent(rank), tree_children(rank, world_size)
    incoming = [torch.empty_like(tensor) for _ in children]  # [n] per child
    for work in [dist.irecv(buf, c) for buf, c in zip(incoming, children)]:  # both children at once
        work.wait()
    for buf in incoming:
        tensor.add_(buf)  # now: the sum over my subtree
    if parent is not None:
        dist.send(tensor, parent)
        dist.recv(tensor, parent)  # the root's total, coming back down
    for work in [dist.isend(tensor, c) for c in children]:
        work.wait()
    return tensor
# --8<-- [end:tree]


# --8<-- [start:halving]
def halving_doubling_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Rabenseifner's all-reduce for a power-of-two world size, in place (SUM).

    Reduce-scatter by recursive halving: at distance d = p/2, p/4, .., 1 exchange half of the current range with
    partner rank ^ d; the rank whose bit d is 0 keeps the lower half. After log2(p) steps each rank owns 1/p of the
    vector, fully summed. All-gather by recursive doubling replays the steps backwards, swapping owned ranges.
    Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005),
    https://doi.org/10.1177/1094342005051521
    """
    flat = tensor.view(-1)  # [n]
    plan = halving_doubling_plan(dist.get_rank(), dist.get_world_size(), flat.numel())
    for partner, keep, give in plan:  # reduce-scatter: the range I keep halves each step
        incoming = flat.new_empty(keep[1] - keep[0])
        sendrecv(flat[give[0]:give[1]], partner, incoming, partner)
        flat[keep[0]:keep[1]].add_(incoming)
    for partner, keep, give in reversed(plan):  # all-gather: send what I own, receive what the partner owns
        sendrecv(flat[keep[0]:keep[1]], partner, flat[give[0]:give[1]], partner)
    return tensor


def halving_doubling_plan(rank: int, world_size: int, numel: int) -> list[tuple[int, tuple, tuple]]:
    """Rank `rank`'s reduce-scatter steps: (partner, range kept, range given) at distance p/2, p/4, .., 1."""
    lo, hi, plan = 0, numel, []
    distance = world_size // 2
    while distance >= 1:
        partner, mid = rank ^ distance, lo + (hi - lo) // 2  # both partners hold the same [lo, hi): same mid
        keep, give = ((lo, mid), (mid, hi)) if rank & distance == 0 else ((mid, hi), (lo, mid))
        plan.append((partner, keep, give))
        (lo, hi), distance = keep, distance // 2
    return plan
# --8<-- [end:halving]


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


# --8<-- [start:volume]
COLLECTIVES = ("broadcast", "scatter", "gather", "all_gather", "reduce", "all_reduce", "reduce_scatter", "all_to_all")


def comm_volume(collective: str, num_bytes: int, world_size: int) -> dict:
    """Bytes one process sends and receives in the bandwidth-optimal algorithm of `collective`.

    Convention: `num_bytes` (N) is the size of the FULL buffer, and W the world size:
      broadcast       N = the tensor the root sends         pipelined chain: each rank forwards all N bytes
      scatter         N = the root's input (W pieces)       root sends the W-1 pieces that are not its own
      gather          N = the root's output (W pieces)      root receives W-1 pieces
      all_gather      N = each rank's OUTPUT (W pieces)     ring: W-1 steps of one piece
      reduce          N = each rank's input (= output)      pipelined chain toward the root: each rank adds its
                                                            tensor to the partial sums passing through, N in, N out
      all_reduce      N = each rank's tensor                ring: reduce-scatter + all-gather, 2(W-1) pieces
      reduce_scatter  N = each rank's INPUT (output N/W)    ring: W-1 steps of one piece
      all_to_all      N = each rank's input (W blocks)      direct: keep one block, send W-1
    A piece is N/W bytes. "sent" is the most any one rank sends and "received" the most any one rank receives: the
    bottleneck a bandwidth-bound collective waits for. In a symmetric collective every rank moves the same amount;
    in a rooted one the two maxima can belong to different ranks (in scatter the root sends W-1 pieces, and each
    other rank receives one).
    """
    n, w = float(num_bytes), world_size
    if w < 1:
        raise ValueError(f"world_size must be >= 1, got {w}")
    piece, others = n / w, (w - 1) / w * n  # one rank's share; everything but one share
    table = {
        "broadcast": ("pipelined chain", n if w > 1 else 0.0, n if w > 1 else 0.0),
        "scatter": ("direct from root", others, piece if w > 1 else 0.0),
        "gather": ("direct to root", piece if w > 1 else 0.0, others),
        "all_gather": ("ring", others, others),
        # N in, N out: chapter 4's bus bandwidth (busbw) uses this factor of 1 for reduce
        "reduce": ("pipelined chain", n if w > 1 else 0.0, n if w > 1 else 0.0),
        "all_reduce": ("ring", 2 * others, 2 * others),
        "reduce_scatter": ("ring", others, others),
        "all_to_all": ("direct pairwise", others, others),
    }
    if collective not in table:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")
    algorithm, sent, received = table[collective]
    return {"collective": collective, "algorithm": algorithm, "sent": sent, "received": received}
# --8<-- [end:volume]
