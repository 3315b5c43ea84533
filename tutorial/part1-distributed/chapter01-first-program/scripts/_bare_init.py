"""The bare minimum: init_process_group and one all_reduce, with nothing from the book's launcher.

Deliberately outside the book's script contract (no flags, no self-check beyond one assert), so that every line
is torch.distributed itself. It expects torchrun to start it and to set RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT:

    torchrun --nproc-per-node 2 tutorial/part1-distributed/chapter01-first-program/scripts/_bare_init.py

Run with plain `python` instead, it stops in init_process_group: nobody set the environment variables.
"""

# --8<-- [start:bare]
import torch
import torch.distributed as dist

dist.init_process_group(backend="gloo")  # env://: reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, world_size = dist.get_rank(), dist.get_world_size()
try:
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)  # sum over ranks, in place, on every rank
    assert x.item() == world_size * (world_size - 1) / 2, x
    print(f"rank {rank} of {world_size}: all_reduce gave {x.item():g}", flush=True)
finally:
    dist.destroy_process_group()  # leave the group cleanly, even after an error
# --8<-- [end:bare]
