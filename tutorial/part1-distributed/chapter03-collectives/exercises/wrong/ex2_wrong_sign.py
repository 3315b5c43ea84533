"""A mistake for ch03.2: a block from the left is stored in row (rank + step + 1) instead of (rank - step - 1)."""

import torch
import torch.distributed as dist


def ring_all_gather(local):
    world_size, rank = dist.get_world_size(), dist.get_rank()
    out = torch.empty(world_size, local.numel(), dtype=local.dtype)
    out[rank] = local
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for step in range(world_size - 1):
        send_j, recv_j = (rank + step) % world_size, (rank + step + 1) % world_size
        ops = [dist.P2POp(dist.isend, out[send_j], right), dist.P2POp(dist.irecv, out[recv_j], left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out.flatten()
