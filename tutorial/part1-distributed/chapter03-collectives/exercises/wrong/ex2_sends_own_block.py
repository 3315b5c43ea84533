"""A mistake for ch03.2: every step sends the rank's OWN block instead of the one it received last."""

import torch
import torch.distributed as dist


def ring_all_gather(local):
    world_size, rank = dist.get_world_size(), dist.get_rank()
    out = torch.empty(world_size, local.numel(), dtype=local.dtype)
    out[rank] = local
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for step in range(world_size - 1):
        recv_j = (rank - step - 1) % world_size
        ops = [dist.P2POp(dist.isend, out[rank], right), dist.P2POp(dist.irecv, out[recv_j], left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out.flatten()
