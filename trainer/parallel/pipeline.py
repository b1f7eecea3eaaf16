"""Pipeline parallelism: split the model into stages by layers and run them with a
``torch.distributed.pipelining`` schedule.

Each stage is a copy of the (meta) model with the modules it does not own removed, so parameter names
stay the full model's names (``layers.5.attention.wq.weight`` is called that on every layout) and
checkpoints load across pipeline degrees. Every stage then goes through the same ``parallelize`` step
as a whole model (TP, activation checkpointing, compile, FSDP). The split itself (``plan_stages``) and the
schedule names are in config.py, with the rules that check them before launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import copy

from trainer.errors import ConfigError
from trainer.parallel.config import LOOPED, SCHEDULES, SINGLE_STAGE, n_microbatches, schedule_name

if TYPE_CHECKING:  # torch is imported where it is used, so the launcher's pre-flight stays torch-free
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.config import JobConfig


def build_stage_model(template: nn.Module, names: list[str]) -> nn.Module:
    """A copy of the (meta) model keeping only ``names``; parameter names are unchanged."""
    stage = copy.deepcopy(template)
    keep = set(names)
    for name in ("tok_embeddings", "norm", "output"):
        if name not in keep:
            setattr(stage, name, None)
    for key in list(stage.layers.keys()):
        if f"layers.{key}" not in keep:
            del stage.layers[key]
    return stage


def schedule_microbatches(config: JobConfig) -> int:
    """Micro-batches the schedule splits each local batch into (what :func:`schedule_of` gives it)."""
    return n_microbatches(config, schedule_name(config.parallelism.pipeline_parallel_schedule))


def build_stages(stage_modules: list[nn.Module], stage_ids: list[int], num_stages: int, pp_mesh: DeviceMesh,
                 device: torch.device, examples: list[tuple] | None = None) -> list:
    """This rank's ``PipelineStage``s, one per stage module, over the mesh's pipeline group.

    ``examples``: per stage, an example input and output (``PipelineStage``'s static metadata). Training gives
    none: the schedule's first step infers them with the neighbouring stages. ``trainer simulate`` gives them,
    its neighbours being fake."""
    from torch.distributed.pipelining import PipelineStage

    examples = examples or [(None, None)] * len(stage_modules)
    return [PipelineStage(m, i, num_stages, device, input_args=x, output_args=y, group=pp_mesh.get_group())
            for m, i, (x, y) in zip(stage_modules, stage_ids, examples)]


def schedule_of(stages: list, config: JobConfig, loss_fn):
    """The configured schedule over this rank's ``stages`` (from :func:`build_stages`), calling ``loss_fn``
    on each micro-batch the last stage finishes."""
    import torch
    from torch.distributed.pipelining import schedules

    name = schedule_name(config.parallelism.pipeline_parallel_schedule)
    cls = getattr(schedules, SCHEDULES[name], None)
    if cls is None:
        raise ConfigError(f"schedule {name} is not available in this torch version ({torch.__version__})")
    n_micro = n_microbatches(config, name)
    # Gradients are already normalised by the loss (tokens of the whole step): no extra scaling.
    return cls(stages[0] if name in SINGLE_STAGE else stages, n_microbatches=n_micro, loss_fn=loss_fn,
               scale_grads=False)


def build_schedule(stage_modules: list[nn.Module], stage_ids: list[int], num_stages: int, pp_mesh: DeviceMesh,
                   device: torch.device, config: JobConfig, loss_fn):
    """The schedule driving this rank's stages."""
    return schedule_of(build_stages(stage_modules, stage_ids, num_stages, pp_mesh, device), config, loss_fn)


def bubble_fraction(schedule: str, pp: int, n_micro: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of a step in the usual idealised model (equal stage times, backward = 2x forward,
    communication free).

    GPipe / 1F1B: (p - 1) / (m + p - 1). Looped schedules with v stages per rank divide the warm-up and
    drain by v: ((p - 1) / v) / (m + (p - 1) / v). Zero-bubble schedules split backward into input- and
    weight-gradient passes and fill idle time with weight-gradient work: the interleaved variant keeps
    about a third of the interleaved bubble (ZB-H1), the V schedules reach about zero once m >= 2p (ZB-V)
    and a third of the 1F1B bubble below that.
    """
    one_f_one_b = (pp - 1) / (n_micro + pp - 1)
    v = stages_per_rank
    looped = ((pp - 1) / v) / (n_micro + (pp - 1) / v)
    if schedule in SINGLE_STAGE:
        return one_f_one_b
    if schedule == "InterleavedZeroBubble":
        return looped / 3
    if schedule in LOOPED:
        return looped
    return 0.0 if n_micro >= 2 * pp else one_f_one_b / 3
