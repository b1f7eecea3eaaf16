"""One rank of a real gloo run of the trainer's step, measured as ``trainer simulate`` measures its fake one.

    torchrun --standalone --nproc_per_node N -m tests.support.real_step OUT_FOLDER [--section.key value ...]

Each rank builds its model parts as training does (``setup.build_model_parts`` on real tensors, initialised;
with pipelining training's stages and schedule, whose first step infers the activations' shapes with the
neighbouring ranks), runs a first step as training does (the optimizer state, the schedule's handshake), then
a second one, the steady state, measured by the simulator's counters (``Measured``: FLOPs, collectives,
memory tracker). Both steps call trainer/step.py as ``Trainer.train_step`` does, not through the simulator's
step driver, so a simulator that drifts from training measures something else. Writes
``OUT_FOLDER/rank_R.json`` with the second step's figures; tests/unit/test_step_shared.py compares them with a
simulated rank of the same layout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainer import step as steps
from trainer.config import load_config
from trainer.models.llama.model import Transformer
from trainer.optim.optimizer import build_optimizer
from trainer.parallel import clean_fqn
from trainer.parallel.parallelize import DTYPES
from trainer.parallel.pipeline import build_stages, schedule_of
from trainer.setup import build_model_parts
from trainer.tools.plan.cli import model_args_for_plan
from trainer.tools.simulate import world
from trainer.tools.simulate.step import Measured

from tests.support.launch import DEBUG_CONFIG

N_LAYERS = 2


def config_and_args(overrides: list[str]):
    """The layout both runs take: the debug model with N_LAYERS blocks, bf16 compute, as simulate sees it."""
    config = load_config(["--job.config_file", str(DEBUG_CONFIG), "--training.mixed_precision_param", "bfloat16",
                          *overrides], env={})
    config, _ = world.simulation_config(config)
    args, _ = model_args_for_plan(config)
    return config, dataclasses.replace(args, n_layers=N_LAYERS)


def real_view(config, args, layout, rank: int) -> world.RankView:
    """This rank's parts, optimizer and (with pipelining) stage and schedule, built as training builds them."""
    dims = dataclasses.replace(layout.dims)
    mesh = dims.build_mesh("cpu")
    compute_dtype = DTYPES[config.training.mixed_precision_param]
    with torch.device("meta"):
        template = Transformer(args)
    built = build_model_parts(template, config, dims, mesh, device=torch.device("cpu"), compute_dtype=compute_dtype,
                              init_seed=0)
    parts = built.parts
    optimizer = build_optimizer([np for part in parts for np in part.named_parameters()], config.optimizer)
    view = world.RankView(rank=rank, coordinate=dict(zip(mesh.mesh_dim_names, mesh.get_coordinate())), dims=dims,
                          mesh=mesh, parts=parts, stage_ids=built.stage_ids, num_stages=layout.num_stages,
                          param_shapes={clean_fqn(n): tuple(p.shape) for part in parts
                                        for n, p in part.named_parameters()},
                          optimizer=optimizer, compute_dtype=compute_dtype)
    if built.stage_ids is not None:
        view.pipeline_loss = steps.PipelineLoss(steps.loss_fn)
        stages = build_stages(parts, built.stage_ids, built.num_stages, mesh["pp"], torch.device("cpu"))
        view.stage, view.schedule = stages[0], schedule_of(stages, config, view.pipeline_loss)
    return view


def random_batches(config, args) -> list[dict[str, torch.Tensor]]:
    shape = (config.training.local_batch_size, config.training.seq_len)
    return [{"input": torch.randint(0, args.vocab_size, shape), "labels": torch.randint(0, args.vocab_size, shape)}]


def forward_backward(view: world.RankView, config, batches, mark=None) -> None:
    """The step's forward and backward as ``Trainer.train_step`` calls them (``mark``: the profiler ranges'
    context, here the measured phases)."""
    autocast = steps.autocast_context("cpu", view.compute_dtype, view.dims.fsdp_enabled)
    parallel = steps.uses_loss_parallel(view.dims.tp, config.parallelism.disable_loss_parallel)
    if view.schedule is None:
        steps.forward_backward(view.parts[0], batches, device=torch.device("cpu"), autocast=autocast,
                               parallel_loss=parallel, **({"mark": mark} if mark else {}))
    else:
        steps.forward_backward_pipeline(view.schedule, batches, pipeline_loss=view.pipeline_loss,
                                        device=torch.device("cpu"), autocast=autocast, parallel_loss=parallel,
                                        has_first=view.first, has_last=view.last)


def clip_and_step(view: world.RankView, config) -> None:
    """The step's clipping and optimizer step as ``Trainer.train_step`` calls them."""
    pp_group = view.mesh["pp"].get_group() if view.dims.pp > 1 else None
    steps.clip_and_step(view.parts, view.optimizer, max_norm=config.training.max_norm, pp_group=pp_group)


def main(argv: list[str]) -> int:
    out, overrides = Path(argv[0]), argv[1:]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config, args = config_and_args(overrides)
    layout = world.check_layout(config, args, world_size)
    dist.init_process_group("gloo")
    try:
        view = real_view(config, args, layout, rank)
        torch.manual_seed(rank)
        # The first step untracked: the schedule's handshake differentiates its sample forward with
        # autograd.grad, which the memory tracker's hooks do not support.
        forward_backward(view, config, random_batches(config, args))
        clip_and_step(view, config)
        batches = random_batches(config, args)
        # As in the simulation, DTensor's sharding propagation stays out of what the counters see.
        with world.isolated_sharding_propagation(), Measured(view, (batches[0]["input"], batches[0]["labels"])) \
                as measured:
            forward_backward(view, config, batches, mark=measured.mark)
            measured.record("after_backward")
            with measured.phase("optimizer"):
                clip_and_step(view, config)
            measured.record("after_step")
        result = measured.result()
    finally:
        dist.destroy_process_group()
    figures = {"memory": result.memory, "peak_by_type": result.peak_by_type, "flops": result.flops,
               "collectives": result.collectives}
    (out / f"rank_{rank}.json").write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
