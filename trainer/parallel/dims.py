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

    Mesh dimensions, outermost first (torchtitan's order): ``pp`` (pipeline stages), ``dp_replicate`` (HSDP
    replicas, across nodes), ``dp_shard`` (FSDP, inside a node), ``cp`` (context parallel: the ranks that
    split each sequence), ``tp`` (tensor parallel, innermost so it stays on the fastest links). Flattened
    dimensions: ``dp`` = ``dp_replicate x dp_shard``, the ranks that see different data (the loader's);
    ``dp_shard_cp`` = ``dp_shard x cp``, what FSDP shards parameters over (CP ranks hold the same parameters
    and average their gradients, as data-parallel ranks do); ``dp_cp`` = ``dp_replicate x dp_shard x cp``,
    what the loss and metrics are averaged over. Expert parallel (``ep`` > 1) splits ``dp_shard`` into
    ``efsdp x ep`` (ep innermost: an EP group's exchanges stay inside a node) and flattens them back into
    ``dp_shard``: trainer/parallel/expert.py.
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    cp: int = 1
    ep: int = 1

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int) -> "ParallelDims":
        rep, shard, tp, pp = resolve_degrees(cfg, world_size)
        return cls(dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, world_size=world_size,
                   cp=cfg.context_parallel_degree, ep=cfg.expert_parallel_degree)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks whose losses and gradients are averaged: data parallel and context parallel."""
        return self.dp * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_cp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        from torch.distributed.device_mesh import init_device_mesh

        from trainer.torch_compat import flatten_mesh

        # The cp dimension only when used, and dp_shard split into (efsdp, ep) only under expert parallel: a
        # layout without them keeps its mesh (and rank coordinates) as before.
        shard_dims = [("efsdp", self.dp_shard // self.ep), ("ep", self.ep)] if self.ep > 1 else [("dp_shard", self.dp_shard)]
        dims = [("pp", self.pp), ("dp_replicate", self.dp_replicate), *shard_dims]
        dims += [("cp", self.cp)] if self.cp > 1 else []
        names, shape = zip(*dims, ("tp", self.tp))
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        shard = [name for name, _ in shard_dims]
        # Kept here: slicing a flattened dimension from the root mesh is deprecated.
        if self.ep > 1:
            flatten_mesh(mesh["efsdp", "ep"], "dp_shard")
        self.dp_mesh = flatten_mesh(mesh["dp_replicate", *shard], "dp")
        self.dp_cp_mesh = flatten_mesh(mesh["dp_replicate", *shard, "cp"], "dp_cp") if self.cp > 1 else self.dp_mesh
        # FSDP's mesh: (dp_replicate, dp_shard_cp) for HSDP, dp_shard_cp alone otherwise.
        self.fsdp_mesh = None
        if self.fsdp_enabled:
            if self.cp > 1:
                flatten_mesh(mesh[(*shard, "cp")], "dp_shard_cp")
            self.fsdp_mesh = self._with_replicas(mesh, "dp_shard_cp" if self.cp > 1 else "dp_shard")
        # Expert parallel: the ep ranks, and the mesh FSDP shards each rank's experts over (the ranks that hold
        # the same experts: efsdp x cp, with dp_replicate as HSDP's outer dimension; one rank is a mesh too).
        self.ep_mesh = self.expert_fsdp_mesh = self.ep_tp_mesh = None
        if self.ep > 1:
            self.ep_mesh = mesh["ep"]
            if self.tp > 1:  # experts split on both their expert and hidden dimensions
                self.ep_tp_mesh = mesh["ep", "tp"]
            if self.cp > 1:
                flatten_mesh(mesh["efsdp", "cp"], "efsdp_cp")
            self.expert_fsdp_mesh = self._with_replicas(mesh, "efsdp_cp" if self.cp > 1 else "efsdp")
        return mesh

    def _with_replicas(self, mesh, shard: str):
        """(dp_replicate, ``shard``) for HSDP, ``shard`` alone otherwise."""
        return mesh["dp_replicate", shard] if self.dp_replicate > 1 else mesh[shard]

    def describe(self) -> str:
        dims = [("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard)]
        # cp and ep only when used: a layout without them reads as before (logs, checkpoints' layout field)
        dims += [("cp", self.cp)] if self.cp > 1 else []
        dims += [("ep", self.ep)] if self.ep > 1 else []
        parts = [f"{k}={v}" for k, v in (*dims, ("tp", self.tp))]
        return f"world {self.world_size}: " + ", ".join(parts)


def device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
