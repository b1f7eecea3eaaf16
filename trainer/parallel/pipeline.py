"""Pipeline parallelism: split the model into stages by layers and run them with a
``torch.distributed.pipelining`` schedule.

Each stage is a copy of the (meta) model with the modules it does not own removed, so parameter names
stay the full model's names (``layers.5.attention.wq.weight`` is called that on every layout) and
checkpoints load across pipeline degrees. Every stage then goes through the same ``parallelize`` step
as a whole model (TP, activation checkpointing, compile, FSDP).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import copy
import difflib
from dataclasses import dataclass

from trainer.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where it is used, so the launcher's pre-flight stays torch-free
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.config import JobConfig

# Schedules with one stage per rank; the others run several (virtual) stages per rank.
SINGLE_STAGE = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B"}
# Looped: rank r holds stages r, r + pp, r + 2 pp, ...
LOOPED = {"Interleaved1F1B": "ScheduleInterleaved1F1B", "LoopedBFS": "ScheduleLoopedBFS",
          "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble"}
# V-shaped: rank r holds stages r and 2 pp - 1 - r, so the first and last stage share rank 0.
V_SHAPED = {"ZBVZeroBubble": "ScheduleZBVZeroBubble", "DualPipeV": "ScheduleDualPipeV"}
SCHEDULES = {**SINGLE_STAGE, **LOOPED, **V_SHAPED}


def schedule_name(name: str) -> str:
    """The canonical schedule name (case-insensitive match) or a ConfigError listing the valid ones."""
    for valid in SCHEDULES:
        if valid.lower() == name.lower():
            return valid
    close = difflib.get_close_matches(name, list(SCHEDULES), n=1)
    raise ConfigError(f"parallelism.pipeline_parallel_schedule: unknown schedule {name!r}"
                      + (f" (did you mean {close[0]!r}?)" if close else "") + f"; valid: {', '.join(SCHEDULES)}")


@dataclass
class StagePlan:
    num_stages: int  # over all ranks (virtual stages included)
    modules: list[list[str]]  # module names per stage, e.g. ["tok_embeddings", "layers.0", ...]

    def stages_of_rank(self, pp_rank: int, pp: int, schedule: str) -> list[int]:
        per_rank = self.num_stages // pp
        if schedule in V_SHAPED:
            return [pp_rank, self.num_stages - 1 - pp_rank]
        return [pp_rank + k * pp for k in range(per_rank)]


def plan_stages(config: JobConfig, n_layers: int) -> StagePlan:
    """Decide how many (virtual) stages there are and which modules each holds."""
    p = config.parallelism
    pp = p.pipeline_parallel_degree
    schedule = schedule_name(p.pipeline_parallel_schedule)
    if p.module_fqns_per_model_part:
        modules = [list(m) for m in p.module_fqns_per_model_part]
        _check_explicit(modules, n_layers)
        num_stages = len(modules)
    else:
        if p.pipeline_parallel_layers_per_stage is not None:
            per = p.pipeline_parallel_layers_per_stage
            if per < 1 or n_layers % per:
                raise ConfigError(f"parallelism.pipeline_parallel_layers_per_stage ({per}) must divide the model's "
                                  f"{n_layers} layers")
            num_stages = n_layers // per
        else:
            num_stages = pp * (1 if schedule in SINGLE_STAGE else 2)
        if num_stages > n_layers:
            raise ConfigError(f"{num_stages} pipeline stages for {n_layers} layers: every stage needs a layer")
        modules = _even_split(n_layers, num_stages)
    if num_stages % pp:
        raise ConfigError(f"{num_stages} pipeline stages do not divide over pipeline_parallel_degree {pp}")
    per_rank = num_stages // pp
    if schedule in SINGLE_STAGE and per_rank != 1:
        raise ConfigError(f"schedule {schedule} runs one stage per rank, but the split gives {per_rank}; "
                          f"use an interleaved or V schedule ({', '.join([*LOOPED, *V_SHAPED])}) or fewer stages")
    if schedule in V_SHAPED and per_rank != 2:
        raise ConfigError(f"schedule {schedule} runs exactly two stages per rank, but the split gives {per_rank}")
    if schedule in LOOPED and per_rank < 2:
        raise ConfigError(f"schedule {schedule} needs at least two stages per rank, but the split gives {per_rank}")
    return StagePlan(num_stages=num_stages, modules=modules)


def _even_split(n_layers: int, num_stages: int) -> list[list[str]]:
    """Layers as even as possible; the remainder goes to the middle stages, since the first stage also
    holds the embedding and the last one the output layer."""
    base, extra = divmod(n_layers, num_stages)
    counts = [base] * num_stages
    order = sorted(range(num_stages), key=lambda i: (i in (0, num_stages - 1), abs(i - num_stages / 2)))
    for i in order[:extra]:
        counts[i] += 1
    modules, start = [], 0
    for i, count in enumerate(counts):
        names = [f"layers.{j}" for j in range(start, start + count)]
        start += count
        if i == 0:
            names.insert(0, "tok_embeddings")
        if i == num_stages - 1:
            names += ["norm", "output"]
        modules.append(names)
    return modules


def _check_explicit(modules: list[list[str]], n_layers: int) -> None:
    flat = [m for stage in modules for m in stage]
    expected = ["tok_embeddings", *[f"layers.{i}" for i in range(n_layers)], "norm", "output"]
    if sorted(flat) != sorted(expected) or len(flat) != len(set(flat)):
        missing = sorted(set(expected) - set(flat))
        unknown = sorted(set(flat) - set(expected))
        raise ConfigError(
            "parallelism.module_fqns_per_model_part must name every module exactly once, in order "
            f"(missing: {missing or 'none'}, unknown: {unknown or 'none'})"
        )
    if flat != expected:
        raise ConfigError("parallelism.module_fqns_per_model_part must list the modules in model order")


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


def n_microbatches(config: JobConfig, schedule: str) -> int:
    t, p = config.training, config.parallelism
    if t.local_batch_size % p.pipeline_parallel_microbatch_size:
        raise ConfigError(f"training.local_batch_size ({t.local_batch_size}) must be a multiple of "
                          f"parallelism.pipeline_parallel_microbatch_size ({p.pipeline_parallel_microbatch_size})")
    n = t.local_batch_size // p.pipeline_parallel_microbatch_size
    pp = p.pipeline_parallel_degree
    if schedule not in SINGLE_STAGE and n % pp:
        raise ConfigError(f"schedule {schedule} needs the number of pipeline micro-batches ({n} = local_batch_size / "
                          f"pipeline_parallel_microbatch_size) to be a multiple of pipeline_parallel_degree ({pp})")
    if schedule == "1F1B" and n < pp:
        raise ConfigError(f"schedule 1F1B needs at least as many micro-batches ({n}) as stages ({pp}); "
                          "lower pipeline_parallel_microbatch_size or raise local_batch_size")
    return n


def build_schedule(stage_modules: list[nn.Module], stage_ids: list[int], num_stages: int, pp_mesh: DeviceMesh,
                   device: torch.device, config: JobConfig, loss_fn):
    """The schedule driving this rank's stages."""
    import torch
    from torch.distributed.pipelining import PipelineStage, schedules

    name = schedule_name(config.parallelism.pipeline_parallel_schedule)
    stages = [PipelineStage(m, i, num_stages, device, group=pp_mesh.get_group())
              for m, i in zip(stage_modules, stage_ids)]
    cls = getattr(schedules, SCHEDULES[name], None)
    if cls is None:
        raise ConfigError(f"schedule {name} is not available in this torch version ({torch.__version__})")
    n_micro = n_microbatches(config, name)
    # Gradients are already normalised by the loss (tokens of the whole step): no extra scaling.
    return cls(stages[0] if name in SINGLE_STAGE else stages, n_microbatches=n_micro, loss_fn=loss_fn,
               scale_grads=False)


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
