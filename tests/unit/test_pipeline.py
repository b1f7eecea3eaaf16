"""Pipeline parallel: stage plans, schedule errors and bubble fractions (no processes)."""

import pytest

from trainer.config import ConfigError, load_config, validate
from trainer.parallel.config import plan_stages
from trainer.parallel.pipeline import bubble_fraction


def cfg(*argv):
    config = load_config(["--parallelism.pipeline_parallel_degree", "2", *argv], env={})
    validate(config)
    return config


def test_stage_plans():
    plan = plan_stages(cfg(), n_layers=6)
    assert plan.modules == [["tok_embeddings", "layers.0", "layers.1", "layers.2"],
                            ["layers.3", "layers.4", "layers.5", "norm", "output"]]
    v = plan_stages(cfg("--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"), n_layers=6)
    assert v.num_stages == 4 and v.stages_of_rank(0, 2, "ZBVZeroBubble") == [0, 3]
    looped = plan_stages(cfg("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                             "--parallelism.pipeline_parallel_layers_per_stage", "1"), n_layers=6)
    assert looped.num_stages == 6 and looped.stages_of_rank(1, 2, "Interleaved1F1B") == [1, 3, 5]
    flat = [m for stage in v.modules for m in stage]
    assert flat == ["tok_embeddings", *[f"layers.{i}" for i in range(6)], "norm", "output"]


def test_pipeline_errors():
    with pytest.raises(ConfigError, match="must divide the model's 6 layers"):
        plan_stages(cfg("--parallelism.pipeline_parallel_layers_per_stage", "4"), n_layers=6)
    with pytest.raises(ConfigError, match="valid: GPipe, 1F1B"):
        cfg("--parallelism.pipeline_parallel_schedule", "Zigzag")
    with pytest.raises(ConfigError, match="did you mean 'Interleaved1F1B'"):
        cfg("--parallelism.pipeline_parallel_schedule", "Interleaved1F1C")
    with pytest.raises(ConfigError, match="one stage per rank"):
        plan_stages(cfg("--parallelism.pipeline_parallel_layers_per_stage", "1"), n_layers=6)
    with pytest.raises(ConfigError, match="name every module exactly once"):
        plan_stages(cfg("--parallelism.module_fqns_per_model_part", '[["tok_embeddings","layers.0"],["norm","output"]]'),
                    n_layers=2)


def test_bubble_fractions():
    assert bubble_fraction("GPipe", pp=4, n_micro=4) == pytest.approx(3 / 7)
    assert bubble_fraction("1F1B", pp=4, n_micro=12) == pytest.approx(3 / 15)
    assert bubble_fraction("Interleaved1F1B", pp=4, n_micro=12, stages_per_rank=2) < bubble_fraction("1F1B", 4, 12)
