"""Parallel degrees and the device mesh they describe."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass

from trainer.parallel.config import Parallelism, resolve_degrees

if TYPE_CHECKING:  # torch is imported where it is used: the layout is also described without a device
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class ParallelDims:
    """Degrees of each parallel dimension; their product is the world size.

    Mesh dimensions, outermost first: ``pp`` (pipeline stages), ``dp_replicate`` (HSDP replicas, across
    nodes), ``dp_shard`` (FSDP, inside a node), ``tp`` (tensor parallel, innermost so it stays on the
    fastest links). ``dp`` is ``dp_replicate x dp_shard`` flattened: the ranks that see different data.
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int) -> "ParallelDims":
        rep, shard, tp, pp = resolve_degrees(cfg, world_size)
        return cls(dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, world_size=world_size)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        from torch.distributed.device_mesh import init_device_mesh

        from trainer.torch_compat import flatten_mesh

        names = ("pp", "dp_replicate", "dp_shard", "tp")
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        # Kept here: slicing a flattened dimension from the root mesh is deprecated.
        self.dp_mesh = flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")
        return mesh

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in (("pp", self.pp), ("dp_replicate", self.dp_replicate),
                                           ("dp_shard", self.dp_shard), ("tp", self.tp))]
        return f"world {self.world_size}: " + ", ".join(parts)


def device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
