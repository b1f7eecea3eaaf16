"""Process setup (device, process group, determinism, per-step seeds, collective timeouts) and the one builder
of a rank's model parts, which both training and ``trainer simulate`` call.

:func:`build_model_parts` takes the model on the meta device through conversion, this rank's pipeline stages,
parallelization and materialisation. What differs between the two callers is a parameter, not a copy:
training materialises on its device and initialises the weights, and builds the pipeline schedule; the
simulator materialises fake tensors (``materialize_in`` its ``FakeTensorMode``), skips initialisation (values
change no shape, memory or communication) and builds the stages and schedule from build_schedule's halves
(trainer/parallel/pipeline.py), giving each stage the metadata its fake neighbours cannot.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import JobConfig, run_seed
from trainer.parallel.dims import ParallelDims, device_type
from trainer.parallel.init import init_weights
from trainer.parallel.parallelize import parallelize
from trainer.parallel.config import plan_stages, schedule_name
from trainer.parallel.pipeline import build_schedule, build_stage_model

logger = logging.getLogger("trainer")


# --------------------------------------------------------------------------------------------------
# Process
# --------------------------------------------------------------------------------------------------


def init_device() -> torch.device:
    if device_type() == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_process_group(device: torch.device, timeout_s: int) -> None:
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    # CPU collectives (fingerprints, loader state) go over gloo even when the GPUs use NCCL.
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


def close_process_group() -> None:
    """Tear the default process group down in order when this process is done with it (left to the
    interpreter's exit, gloo's threads can be destroyed still running: an abort, exit 134)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def set_train_timeout(seconds: int) -> None:
    """After the first step, a collective that waits this long means a hung rank: fail fast.

    A process group's ``set_timeout`` changes that group only, so it is applied to the default group and to every
    group the device mesh created (``mesh_*``: FSDP/HSDP, TP, PP collectives), NCCL and gloo backends
    alike. Groups made elsewhere with their own timeout (checkpoint saves) keep theirs."""
    try:
        from trainer.torch_compat import process_groups

        default = dist.group.WORLD
        groups = [pg for pg in process_groups()
                  if pg is default or str(getattr(pg, "group_desc", "")).startswith("mesh_")]
        for pg in groups:
            pg.set_timeout(timedelta(seconds=seconds))
        logger.info("collective timeout now %d s on %d process group(s) (comm.train_timeout_seconds)",
                    seconds, len(groups))
    except Exception as e:  # older/other backends: keep the start-up timeout
        logger.warning("could not shorten the collective timeout: %s", e)


def configure_determinism(config: JobConfig, device: torch.device) -> None:
    torch.manual_seed(run_seed(config))
    if config.debug.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=config.debug.deterministic_warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def seed_step(seed: int, device: torch.device) -> None:
    """Seed the generators a step can draw from: the CPU's and this rank's device's, so that whatever a step
    draws is a function of (seed, step) alone, through a resume too. Each gets the same seed
    ``torch.manual_seed`` would give it; that call also seeds every other device type, and where one is not
    initialised (CUDA on a CPU host) it formats a stack trace per call: 1-3 ms a step for generators this
    rank never draws from."""
    torch.default_generator.manual_seed(seed)
    if device.type != "cpu":
        torch.get_device_module(device.type).manual_seed(seed)


# --------------------------------------------------------------------------------------------------
# Model parts
# --------------------------------------------------------------------------------------------------


def apply_converters(model: nn.Module, config: JobConfig) -> None:
    if "quantize.linear.float8" in config.model.converters:
        from trainer.parallel.float8 import convert_to_float8

        convert_to_float8(model, config)


@dataclass
class ModelParts:
    """This rank's share of the model: the whole model, or its pipeline stages and their schedule."""

    parts: list[nn.Module]
    stage_ids: list[int] | None = None  # None without pipelining
    num_stages: int = 1
    schedule: object | None = None  # the pipeline schedule, when one was built

    @property
    def has_first(self) -> bool:
        return self.stage_ids is None or 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.stage_ids is None or self.num_stages - 1 in self.stage_ids


def build_model_parts(template: nn.Module, config: JobConfig, dims: ParallelDims, mesh, *,
                      device: torch.device | str, compute_dtype: torch.dtype, init_seed: int | None,
                      materialize_in=contextlib.nullcontext, pipeline_loss=None) -> ModelParts:
    """Convert, parallelize, materialise and (``init_seed`` not None) initialise ``template`` (the model on
    the meta device), or this rank's pipeline stages of it.

    ``materialize_in()`` is the context ``to_empty`` runs in. With pipelining and a ``pipeline_loss``, the
    schedule driving the stages is built with that loss."""
    if dims.pp == 1:
        built = ModelParts([copy.deepcopy(template)])
    else:
        plan = plan_stages(config, template.args.n_layers)
        stage_ids = plan.stages_of_rank(mesh["pp"].get_local_rank(), dims.pp,
                                        schedule_name(config.parallelism.pipeline_parallel_schedule))
        built = ModelParts([build_stage_model(template, plan.modules[i]) for i in stage_ids], stage_ids,
                           plan.num_stages)
        logger.info("pipeline: %d stages, this rank holds %s: %s", plan.num_stages, stage_ids,
                    [plan.modules[i] for i in stage_ids])
    for part in built.parts:
        stage_template = copy.deepcopy(part) if init_seed is not None else None
        apply_converters(part, config)
        parallelize(part, dims, mesh, config, param_dtype=compute_dtype)
        with materialize_in():
            part.to_empty(device=device)
        if stage_template is not None:
            init_weights(part, stage_template, init_seed, device)
    if built.stage_ids is not None and pipeline_loss is not None:
        built.schedule = build_schedule(built.parts, built.stage_ids, built.num_stages, mesh["pp"], device, config,
                                        pipeline_loss)
    return built
