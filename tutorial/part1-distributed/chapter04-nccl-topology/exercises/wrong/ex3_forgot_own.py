"""A mistake for ch04.3: a rank's partial sum starts from zeros, so every rank's own tensor is left out of the
total."""

import torch
import torch.distributed as dist


def tree_parent(rank):
    return None if rank == 0 else (rank - 1) // 2


def tree_children(rank, world_size):
    return [c for c in (2 * rank + 1, 2 * rank + 2) if c < world_size]


def tree_all_reduce(tensor):
    rank = dist.get_rank()
    parent, children = tree_parent(rank), tree_children(rank, dist.get_world_size())
    total = torch.zeros_like(tensor)
    incoming = torch.empty_like(tensor)
    for child in children:
        dist.recv(incoming, child)
        total += incoming
    if parent is not None:
        dist.send(tensor if not children else total, parent)
        dist.recv(total, parent)
    for work in [dist.isend(total, child) for child in children]:
        work.wait()
    return total


def run_and_count(tensor):
    sent = {"elements": 0, "messages": 0}
    real_send, real_isend = dist.send, dist.isend

    def send(t, *args, **kwargs):
        sent["elements"] += t.numel()
        sent["messages"] += 1
        return real_send(t, *args, **kwargs)

    def isend(t, *args, **kwargs):
        sent["elements"] += t.numel()
        sent["messages"] += 1
        return real_isend(t, *args, **kwargs)

    dist.send, dist.isend = send, isend
    try:
        out = tree_all_reduce(tensor)
    finally:
        dist.send, dist.isend = real_send, real_isend
    return {"result": out.tolist(), "input_after": tensor.tolist(), **sent}  # the checker compares it with its copy
