"""A simulated world: the fake process group, fake tensors, the checks a layout must pass, and one rank's
model parts built by the trainer's own builder.

The build is training's (``trainer.setup.build_model_parts``: the model on the meta device, this rank's
pipeline stage, ``parallelize`` with TP, activation checkpointing, FSDP2/HSDP, ``to_empty``), then
``build_optimizer``. Its parameters differ, on purpose:

* ``to_empty`` runs under ``FakeTensorMode``: parameters, gradients and optimizer state are fake tensors
  (shape, dtype, no storage), so a 405B model's shards cost nothing.
* No weight initialisation (``init_weights``): values do not change shapes, memory or communication.
* No pipeline schedule: the step drives the stage itself (the schedule's handshake needs real peers).
* ``torch.compile``, float8 and async TP are switched off (they need a GPU); the step is eager bf16, the
  regime ``trainer plan`` models.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import JobConfig, validate
from trainer.data.checks import grad_accum_steps
from trainer.errors import ConfigError
from trainer.parallel import clean_fqn
from trainer.parallel.dims import ParallelDims
from trainer.parallel.parallelize import DTYPES
from trainer.parallel.config import SINGLE_STAGE, StagePlan, plan_stages, schedule_name
from trainer.parallel.pipeline import n_microbatches
from trainer import setup

SIM_DEVICE = "cpu"  # the fake tensors' device; nothing is allocated on it


# --------------------------------------------------------------------------------------------------
# Config and layout checks (before anything is built)
# --------------------------------------------------------------------------------------------------


def simulation_config(config: JobConfig) -> tuple[JobConfig, list[str]]:
    """A copy of ``config`` with what cannot run on fake CPU tensors switched off, and notes saying so."""
    config = copy.deepcopy(config)
    notes = []
    if config.compile.enable:
        config.compile.enable = False
        notes.append("torch.compile is not simulated: the step runs eager (compile usually saves activation "
                     "memory; trainer plan's estimate is eager too)")
    if "quantize.linear.float8" in config.model.converters:
        config.model.converters = [c for c in config.model.converters if c != "quantize.linear.float8"]
        notes.append("float8 is not simulated: matmuls and FSDP all-gathers run in bf16 (float8 all-gather "
                     "would halve the all-gather bytes)")
    if config.parallelism.enable_async_tensor_parallel:
        config.parallelism.enable_async_tensor_parallel = False
        notes.append("async tensor parallel is not simulated (same bytes, overlapped)")
    return config, notes


@dataclass
class Layout:
    """What the checks resolved: the degrees, accumulation steps and pipeline facts."""

    dims: ParallelDims
    accum_steps: int
    schedule: str | None = None
    stage_plan: StagePlan | None = None
    microbatches: int = 1

    @property
    def num_stages(self) -> int:
        return 1 if self.stage_plan is None else self.stage_plan.num_stages


def check_layout(config: JobConfig, args, world_size: int) -> Layout:
    """Every check that can refuse a layout before it is built; raises ConfigError (one line)."""
    if world_size < 1:
        raise ConfigError(f"--ngpu must be at least 1, got {world_size}")
    validate(config, world_size, files=False)  # every rule a real launch checks, but the files it reads
    dims = ParallelDims.from_config(config.parallelism, world_size)
    if config.training.enable_cpu_offload:
        raise ConfigError("training.enable_cpu_offload is not simulated (it moves state to host memory, which "
                          "the fake world does not model); simulate without it")
    accum = grad_accum_steps(config, dims.dp)
    layout = Layout(dims=dims, accum_steps=accum)
    if dims.pp > 1:
        name = schedule_name(config.parallelism.pipeline_parallel_schedule)
        if name not in SINGLE_STAGE:
            raise ConfigError(f"trainer simulate runs the single-stage pipeline schedules ({', '.join(SINGLE_STAGE)}); "
                              f"{name} holds several stages per rank")
        layout.schedule = name
        layout.stage_plan = plan_stages(config, args.n_layers)
        layout.microbatches = n_microbatches(config, name)
    return layout


def role_ranks(dims: ParallelDims) -> list[tuple[str, int]]:
    """One rank per distinct role: the first, a middle and the last pipeline stage (with pp > 1), each at
    data-parallel and TP coordinate 0. TP and FSDP shards of one stage hold equally shaped pieces (the
    degrees divide the heads and FSDP pads dim 0), so their numbers are the same."""
    per_stage = dims.world_size // dims.pp
    if dims.pp == 1:
        return [("all ranks", 0)]
    roles = [("first stage", 0)]
    if dims.pp >= 3:
        roles.append(("middle stage", (dims.pp // 2) * per_stage))
    roles.append(("last stage", (dims.pp - 1) * per_stage))
    return roles


# --------------------------------------------------------------------------------------------------
# The fake world
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int):
    """This process is ``rank`` of ``world_size`` over torch's fake process group (no communication)."""
    from torch.testing._internal.distributed.fake_pg import (
        FakeStore,  # registers the "fake" backend
    )

    if dist.is_initialized():
        raise RuntimeError("trainer simulate needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def isolated_sharding_propagation():
    """DTensor derives an op's output shape by running the op once on global-shape fake tensors, under the
    fake mode it finds active: ours. Those phantom tensors are as large as the unsharded model (a 405B
    optimizer step's worth), and memory trackers and counters would take them for real ones. Run that
    propagation with the dispatch modes switched off, so it makes its own private fake mode."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    # The uncached function where torch has one (its lru-cached wrapper calls it), else the whole method.
    name = next(n for n in ("_propagate_tensor_meta_non_cached", "_propagate_tensor_meta")
                if hasattr(ShardingPropagator, n))
    original = getattr(ShardingPropagator, name)

    def isolated(self, op_schema):
        with _disable_current_modes():
            return original(self, op_schema)

    setattr(ShardingPropagator, name, isolated)
    try:
        yield
    finally:
        setattr(ShardingPropagator, name, original)


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Non-fake inputs: to_empty turns the meta parameters into fake ones.
    return FakeTensorMode(allow_non_fake_inputs=True)


# --------------------------------------------------------------------------------------------------
# One rank's build
# --------------------------------------------------------------------------------------------------


@dataclass
class RankView:
    rank: int
    coordinate: dict[str, int]
    dims: ParallelDims
    mesh: object
    parts: list[nn.Module]
    stage_ids: list[int] | None
    num_stages: int
    param_shapes: dict[str, tuple[int, ...]]  # this rank's parameters, full (unsharded) shapes
    optimizer: torch.optim.Optimizer
    compute_dtype: torch.dtype

    @property
    def first(self) -> bool:
        return self.stage_ids is None or 0 in self.stage_ids

    @property
    def last(self) -> bool:
        return self.stage_ids is None or self.num_stages - 1 in self.stage_ids


def build_rank_view(config: JobConfig, args, layout: Layout, rank: int, mode) -> RankView:
    """Mesh, stage split, parallelize, fake materialisation and optimizer for the process's rank."""
    from trainer.models.llama.model import Transformer
    from trainer.optim.optimizer import build_optimizer

    dims = dataclasses.replace(layout.dims)
    mesh = dims.build_mesh(SIM_DEVICE)
    compute_dtype = DTYPES[config.training.mixed_precision_param]
    with torch.device("meta"):
        template = Transformer(args)
    built = setup.build_model_parts(template, config, dims, mesh, device=SIM_DEVICE, compute_dtype=compute_dtype,
                              init_seed=None, materialize_in=lambda: mode)
    parts = built.parts
    # A sharded parameter is a DTensor: its shape is the full one.
    shapes = {clean_fqn(n): tuple(p.shape) for part in parts for n, p in part.named_parameters()}
    with mode:
        optimizer = build_optimizer([np for part in parts for np in part.named_parameters()], config.optimizer)
    coordinate = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    return RankView(rank=rank, coordinate=coordinate, dims=dims, mesh=mesh, parts=parts, stage_ids=built.stage_ids,
                    num_stages=layout.num_stages, param_shapes=shapes, optimizer=optimizer,
                    compute_dtype=compute_dtype)


def group_labels(view: RankView) -> dict[str, str]:
    """Process-group name -> the mesh dimension it is (``tp``, ``dp_shard``, ``dp`` ...)."""
    labels = {}
    mesh = view.mesh
    for name in mesh.mesh_dim_names:
        labels[mesh.get_group(name).group_name] = name
    dp_mesh = getattr(view.dims, "dp_mesh", None)
    if dp_mesh is not None:
        labels.setdefault(dp_mesh.get_group().group_name, "dp")
    labels.setdefault(dist.group.WORLD.group_name, "world")
    return labels
