"""A simulated world: the fake process group, fake tensors, the checks a layout must pass, and one rank's
model parts built by the trainer's own builder.

The build is training's (``trainer.setup.build_model_parts``: the model on the meta device, this rank's
pipeline stage, ``parallelize`` with TP, activation checkpointing, FSDP2/HSDP, ``to_empty``), then
``build_optimizer``. Its parameters differ, on purpose:

* ``to_empty`` runs under ``FakeTensorMode``: parameters, gradients and optimizer state are fake tensors
  (shape, dtype, no storage), so a 405B model's shards cost nothing.
* No weight initialisation (``init_weights``): values do not change shapes, memory or communication.
* With pipelining, the stage and the schedule come from trainer/parallel/pipeline.py (``build_stages``,
  ``schedule_of``: what training's ``build_schedule`` runs) with the trainer's ``PipelineLoss``, and the step
  runs that schedule. Its first step's handshake with the neighbouring stages (a vote, then the shapes of
  the activations they pass) needs real peers, so each stage is given its example input and output
  (:func:`stage_examples`: static metadata) and agrees the vote alone (``torch_compat.agree_pipeline_vote``).
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
from trainer.parallel.pipeline import build_stages, n_microbatches, schedule_of
from trainer import setup, torch_compat
from trainer import step as steps

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
    if dist.is_initialized():
        raise RuntimeError("trainer simulate needs a process without a process group")
    dist.init_process_group("fake", store=torch_compat.register_fake_backend(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


isolated_sharding_propagation = torch_compat.isolated_sharding_propagation
fake_mode = torch_compat.fake_tensor_mode


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
    stage: object | None = None  # with pipelining: torch's PipelineStage around parts[0]
    schedule: object | None = None  # and the schedule over it, calling pipeline_loss
    pipeline_loss: steps.PipelineLoss | None = None

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
    from trainer.models.moe import moe_layers

    for layer in moe_layers(*parts):  # fake tensors hold no routing: the exchange takes even shares
        if layer.expert_parallel is not None:
            layer.expert_parallel.even_routing = True
    # A sharded parameter is a DTensor: its shape is the full one.
    shapes = {clean_fqn(n): tuple(p.shape) for part in parts for n, p in part.named_parameters()}
    with mode:
        optimizer = build_optimizer([np for part in parts for np in part.named_parameters()], config.optimizer)
    coordinate = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    view = RankView(rank=rank, coordinate=coordinate, dims=dims, mesh=mesh, parts=parts, stage_ids=built.stage_ids,
                    num_stages=layout.num_stages, param_shapes=shapes, optimizer=optimizer,
                    compute_dtype=compute_dtype)
    if built.stage_ids is not None:
        view.pipeline_loss = steps.PipelineLoss(steps.loss_fn)
        with mode:
            examples = [stage_examples(config, args, dims, compute_dtype, i, layout.num_stages)
                        for i in built.stage_ids]
        stages = build_stages(parts, built.stage_ids, built.num_stages, mesh["pp"], torch.device(SIM_DEVICE),
                              examples)
        for stage in stages:
            torch_compat.agree_pipeline_vote(stage)
        view.stage, view.schedule = stages[0], schedule_of(stages, config, view.pipeline_loss)
    return view


def stage_examples(config: JobConfig, args, dims: ParallelDims, compute_dtype: torch.dtype, stage: int,
                   num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A stage's example input and output for one micro-batch (fake tensors): the first takes token ids, the
    others the hidden state the previous stage passes on (the micro-batch's rows, its sequence (this rank's
    share under context parallel) split over TP by sequence parallel, the width; the compute dtype under
    FSDP's mixed precision, else float32 under autocast), which every stage but the last passes on; the last
    gives the logits."""
    mb, seq = config.parallelism.pipeline_parallel_microbatch_size, config.training.seq_len // dims.cp
    dtype = compute_dtype if dims.fsdp_enabled else torch.float32
    hidden = torch.empty(mb, seq // max(1, dims.tp), args.dim, dtype=dtype, device=SIM_DEVICE).requires_grad_()
    tokens = torch.empty(mb, seq, dtype=torch.long, device=SIM_DEVICE)
    logits = torch.empty(mb, seq, args.vocab_size, dtype=torch.float32, device=SIM_DEVICE)
    return (tokens if stage == 0 else hidden), (logits if stage == num_stages - 1 else hidden)


def group_labels(view: RankView) -> dict[str, tuple[str, int]]:
    """Process-group name -> the mesh dimension it is (``tp``, ``dp_shard``, ``dp`` ...) and its size."""
    labels = {}
    mesh = view.mesh
    for name in mesh.mesh_dim_names:
        group = mesh.get_group(name)
        labels[group.group_name] = (name, group.size())
    # Flattened dimensions: FSDP's (dp_shard_cp with context parallel; under expert parallel dp_shard itself is
    # flattened from efsdp x ep), dp (the loader's), dp_cp, and the experts' FSDP dimension with CP (efsdp_cp).
    fsdp = "dp_shard_cp" if view.dims.cp > 1 else "dp_shard"
    flattened = (("fsdp_mesh", fsdp), ("dp_mesh", "dp"), ("dp_cp_mesh", "dp_cp"), ("expert_fsdp_mesh", "efsdp_cp"))
    for attr, name in flattened:
        flat = getattr(view.dims, attr, None)
        if flat is not None:  # HSDP's meshes are (dp_replicate, shard): the shard dimension
            group = flat.get_group(flat.ndim - 1)
            labels.setdefault(group.group_name, (name, group.size()))
    labels.setdefault(dist.group.WORLD.group_name, ("world", dist.get_world_size()))
    from trainer.optim.muon import GROUP_LABELS  # Muon's shard groups over several mesh dimensions

    for name, label in GROUP_LABELS.items():
        labels.setdefault(name, label)
    return labels
