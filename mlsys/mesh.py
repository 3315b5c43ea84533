"""A named 3-D process mesh for data, tensor and pipeline parallelism (chapter 7).

The world's ranks are laid out as an array of shape (pp, dp, tp), tensor-parallel rank varying fastest:

    rank = (pp_index * dp + dp_index) * tp + tp_index

so a tensor-parallel group is tp consecutive ranks (the GPUs of one node share the fastest links), a data-parallel
group strides by tp, and a pipeline group strides by dp * tp. This is the order of
`torch.distributed.device_mesh.init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))`, and
`compare_with_device_mesh` checks that the groups are the same.

    mesh = ParallelMesh(dp=2, tp=2, pp=2)              # pure arithmetic: any rank's coordinates and groups
    mesh.coords(5)                                     # {"pp": 1, "dp": 0, "tp": 1}
    mesh.group_ranks("dp", 5)                          # [5, 7]: ranks that differ from 5 only in dp
    mesh = ParallelMesh.build(dp=2, tp=2, pp=2)        # collective: also creates this rank's process groups
    mesh.group("tp"), mesh.dp_group, mesh.pp_ranks     # torch.distributed groups and rank lists of this rank
"""

from __future__ import annotations

import itertools
from typing import Any

DIMS = ("pp", "dp", "tp")  # slowest to fastest


class ParallelMesh:
    """Sizes of the three dimensions, this rank's coordinates and (after `build`) its three process groups."""

    def __init__(self, dp: int, tp: int, pp: int, rank: int = 0):
        for name, v in (("dp", dp), ("tp", tp), ("pp", pp)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.sizes = {"pp": pp, "dp": dp, "tp": tp}
        self.world_size = dp * tp * pp
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        self.rank = rank
        self._groups: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"ParallelMesh(dp={self.sizes['dp']}, tp={self.sizes['tp']}, pp={self.sizes['pp']}, rank={self.rank})"

    # ------------------------------------------------------------------------------------------- arithmetic
    # --8<-- [start:layout]
    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        """The global rank at these coordinates."""
        coords = {"pp": pp, "dp": dp, "tp": tp}
        for d in DIMS:
            if not 0 <= coords[d] < self.sizes[d]:
                raise ValueError(f"{d} index {coords[d]} is outside 0..{self.sizes[d] - 1}")
        return (pp * self.sizes["dp"] + dp) * self.sizes["tp"] + tp

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """{"pp", "dp", "tp"} indices of `rank` (default: this rank)."""
        rank = self.rank if rank is None else rank
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        tp, rest = rank % self.sizes["tp"], rank // self.sizes["tp"]
        return {"pp": rest // self.sizes["dp"], "dp": rest % self.sizes["dp"], "tp": tp}

    def group_ranks(self, dim: str, rank: int | None = None) -> list[int]:
        """The ranks that share every coordinate of `rank` except `dim`, in order of their `dim` index."""
        if dim not in DIMS:
            raise ValueError(f"dim must be one of {DIMS}, got {dim!r}")
        c = self.coords(rank)
        return [self.rank_of(**{**c, dim: i}) for i in range(self.sizes[dim])]
    # --8<-- [end:layout]

    def all_groups(self, dim: str) -> list[list[int]]:
        """Every group along `dim` (a partition of all ranks), ordered by the other coordinates."""
        others = [d for d in DIMS if d != dim]
        groups = []
        for a, b in itertools.product(range(self.sizes[others[0]]), range(self.sizes[others[1]])):
            base = self.rank_of(**{others[0]: a, others[1]: b, dim: 0})
            groups.append(self.group_ranks(dim, base))
        return groups

    # ------------------------------------------------------------------------------------------- process groups
    @classmethod
    def build(cls, dp: int, tp: int, pp: int) -> ParallelMesh:
        """Collective over WORLD: every rank must call it with the same sizes (dp * tp * pp == world size).

        Creates one process group per group of every dimension (every rank takes part in every new_group call,
        as torch.distributed requires) and keeps the three that contain this rank.
        """
        import torch.distributed as dist

        world = dist.get_world_size()
        if dp * tp * pp != world:
            raise ValueError(f"dp * tp * pp = {dp} * {tp} * {pp} = {dp * tp * pp} != world size {world}")
        mesh = cls(dp, tp, pp, dist.get_rank())
        for dim in DIMS:
            mine, _ = dist.new_subgroups_by_enumeration(mesh.all_groups(dim))
            mesh._groups[dim] = mine
        return mesh

    def group(self, dim: str) -> Any:
        """This rank's torch.distributed process group along `dim` (after `build`)."""
        if dim not in self._groups:
            raise RuntimeError("process groups exist only on a mesh made by ParallelMesh.build")
        return self._groups[dim]

    @property
    def dp_group(self) -> Any:
        return self.group("dp")

    @property
    def tp_group(self) -> Any:
        return self.group("tp")

    @property
    def pp_group(self) -> Any:
        return self.group("pp")

    @property
    def pp_ranks(self) -> list[int]:
        """This rank's pipeline, stage 0 first: the `stage_ranks` of mlsys.pipeline.run_pipeline_step."""
        return self.group_ranks("pp")


def compare_with_device_mesh(mesh: ParallelMesh, device_type: str = "cpu") -> dict[str, list[int]]:
    """Collective: build torch's DeviceMesh of shape (pp, dp, tp) ("cpu" for gloo, "cuda" for nccl) and check that
    this rank's three groups
    hold the same ranks as `mesh` (and that both agree with torch's view of our groups). Returns the groups.

    Raises AssertionError on any difference.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    s = mesh.sizes
    device_mesh = init_device_mesh(device_type, (s["pp"], s["dp"], s["tp"]), mesh_dim_names=DIMS)
    found = {}
    for dim in DIMS:
        theirs = dist.get_process_group_ranks(device_mesh.get_group(dim))
        ours = dist.get_process_group_ranks(mesh.group(dim))
        assert theirs == ours == mesh.group_ranks(dim), f"{dim}: DeviceMesh {theirs}, ours {ours}"
        assert device_mesh.get_local_rank(dim) == mesh.coords()[dim], f"{dim} coordinate differs"
        found[dim] = ours
    return found
