"""Training and ``trainer simulate`` run one step and one model builder: trainer/step.py and trainer/setup.py.

A copy would let the simulator measure a step that no longer trains, so: neither trainer/train.py nor the
simulate package defines a loss, a forward/backward, a gradient clip or a model-part builder of its own, or
computes one inline (cross-entropy, total norm, parallelize, to_empty); both reach the shared functions; and
one simulated step (a small world, in a child process: a fake world leaves caches behind) really goes through
them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import children
from tests.support.launch import DEBUG_CONFIG, ROOT

TRAIN = ROOT / "trainer" / "train.py"
SIMULATE = sorted((ROOT / "trainer" / "tools" / "simulate").glob("*.py"))

# What only trainer/step.py and trainer/setup.py define.
SHARED = {"loss_fn", "loss_parallel", "uses_loss_parallel", "autocast_context", "forward_backward",
          "forward_backward_pipeline", "pipeline_loss", "PipelineLoss", "clip_grad_norm", "clip_and_step",
          "global_loss", "build_model_parts", "apply_converters"}
# Calls that would mean a step or a build written out again.
INLINE = {"cross_entropy", "get_total_norm", "clip_grads_with_norm_", "clip_grad_norm_", "step_unless",
          "parallelize", "to_empty", "build_stage_model", "init_weights", "build_schedule"}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _defined(tree: ast.Module) -> set[str]:
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def _called(tree: ast.Module) -> set[str]:
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            f = n.func
            names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


def _used(tree: ast.Module, module: str) -> set[str]:
    """Names of ``module`` the code reaches: ``from module import x`` and ``alias.x`` of an imported alias."""
    package, _, leaf = module.rpartition(".")
    aliases, names = set(), set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module == module:
            names |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module == package:
            aliases |= {a.asname or a.name for a in n.names if a.name == leaf}
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases:
            names.add(n.attr)
    return names


@pytest.mark.parametrize("path", [TRAIN, *SIMULATE], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_copy_of_the_step_or_the_builder(path):
    tree = _tree(path)
    assert not _defined(tree) & SHARED, f"{path.name} defines its own {sorted(_defined(tree) & SHARED)}"
    assert not _called(tree) & INLINE, f"{path.name} computes {sorted(_called(tree) & INLINE)} itself"


def test_training_and_simulate_reach_the_shared_functions():
    train = _tree(TRAIN)
    assert {"forward_backward", "forward_backward_pipeline", "clip_and_step", "global_loss", "loss_fn",
            "PipelineLoss"} <= _used(train, "trainer.step")
    assert "build_model_parts" in _used(train, "trainer.setup")
    simulate_step = set().union(*(_used(_tree(p), "trainer.step") for p in SIMULATE))
    simulate_setup = set().union(*(_used(_tree(p), "trainer.setup") for p in SIMULATE))
    assert {"forward_backward", "clip_and_step", "loss_fn", "PipelineLoss"} <= simulate_step
    assert "build_model_parts" in simulate_setup


COUNTED = {"trainer.step": ["forward_backward", "clip_and_step", "clip_grad_norm", "loss_fn"],
           "trainer.setup": ["build_model_parts"]}


def _simulate_counting(_rank: int, overrides: list[str], world_size: int) -> dict[str, int]:
    """In a child process: wrap the shared functions with counters, simulate rank 0's step, return the counts."""
    import dataclasses
    import importlib

    from trainer.config import load_config
    from trainer.tools.plan.cli import model_args_for_plan
    from trainer.tools.simulate import world
    from trainer.tools.simulate.cli import simulate_role

    counts: dict[str, int] = {}
    for module_name, names in COUNTED.items():
        module = importlib.import_module(module_name)
        for name in names:
            def counting(*args, _original=getattr(module, name), _key=name, **kwargs):
                counts[_key] = counts.get(_key, 0) + 1
                return _original(*args, **kwargs)

            setattr(module, name, counting)  # the child exits after this one step: nothing to restore
    step = importlib.import_module("trainer.step")
    original_call = step.PipelineLoss.__call__

    def counting_call(self, logits, labels):
        counts["PipelineLoss"] = counts.get("PipelineLoss", 0) + 1
        return original_call(self, logits, labels)

    step.PipelineLoss.__call__ = counting_call
    config = load_config(["--job.config_file", str(DEBUG_CONFIG), "--training.seq_len", "32",
                          "--training.local_batch_size", "2", "--training.global_batch_size", "-1",
                          "--parallelism.data_parallel_replicate_degree", "1", *overrides], env={})
    config, _ = world.simulation_config(config)
    args, _ = model_args_for_plan(config)
    args = dataclasses.replace(args, n_layers=2)
    layout = world.check_layout(config, args, world_size)
    simulate_role(config, args, layout, world_size, world_size - 1, "last", quiet=True)
    return counts


def _in_child(overrides: list[str], world_size: int) -> dict[str, int]:
    # A fresh interpreter, not a fork: by now the test process has threads (loaders, writers) that a forked
    # child would copy mid-operation (it crashed the child under load).
    [counts] = children.call(_simulate_counting, overrides, world_size)
    return counts


def test_a_simulated_step_runs_the_shared_functions():
    counts = _in_child(["--parallelism.data_parallel_shard_degree", "2"], 2)
    assert counts == {"build_model_parts": 1, "forward_backward": 1, "loss_fn": 1, "clip_and_step": 1,
                      "clip_grad_norm": 1}, counts


def test_a_simulated_pipeline_step_runs_the_shared_functions():
    counts = _in_child(["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree",
                        "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
                        "--parallelism.pipeline_parallel_microbatch_size", "1"], 2)
    # The last stage: the trainer's pipeline loss on each of the 2 micro-batches.
    assert counts == {"build_model_parts": 1, "PipelineLoss": 2, "loss_fn": 2, "clip_and_step": 1,
                      "clip_grad_norm": 1}, counts
