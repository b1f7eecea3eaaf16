"""Pipeline parallel: every schedule reproduces the single-process loss (real torchrun, gloo on CPU)."""

import pytest

from tests.test_parallel import STEPS, relative_diffs
from tests.utils import losses, run_train
from trainer.config import ConfigError, load_config, validate
from trainer.parallel.config import SCHEDULES, plan_stages
from trainer.parallel.pipeline import bubble_fraction

PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    dump = tmp_path_factory.mktemp("single")
    run_train(dump, *STEPS, "--training.local_batch_size", "8")
    return losses(dump)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_schedule_matches_single_process(schedule, single, tmp_path):
    run_train(tmp_path, *STEPS, "--training.local_batch_size", "8", *PP2,
              "--parallelism.pipeline_parallel_schedule", schedule, nproc=2)
    diffs = relative_diffs(losses(tmp_path), single)
    assert max(diffs) <= 1e-5, diffs


@pytest.mark.slow
@pytest.mark.parametrize("extra, local_batch", [
    (["--parallelism.data_parallel_shard_degree", "2"], "4"),
    (["--parallelism.tensor_parallel_degree", "2"], "8"),
])
def test_pp_composes_with_fsdp_and_tp(extra, local_batch, single, tmp_path):
    run_train(tmp_path, *STEPS, "--training.local_batch_size", local_batch, *PP2, *extra, nproc=4)
    diffs = relative_diffs(losses(tmp_path), single)
    assert max(diffs) <= 1e-5, diffs


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


def test_too_few_microbatches_is_a_clear_error(tmp_path):
    proc = run_train(tmp_path, "--training.steps", "1", "--training.local_batch_size", "2",
                     "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size",
                     "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", nproc=2, check=False)
    assert proc.returncode != 0
    assert "multiple of pipeline_parallel_degree (2)" in proc.stdout + proc.stderr


def test_bubble_fractions():
    assert bubble_fraction("GPipe", pp=4, n_micro=4) == pytest.approx(3 / 7)
    assert bubble_fraction("1F1B", pp=4, n_micro=12) == pytest.approx(3 / 15)
    assert bubble_fraction("Interleaved1F1B", pp=4, n_micro=12, stages_per_rank=2) < bubble_fraction("1F1B", 4, 12)


@pytest.mark.slow
def test_pp_checkpoint_loads_under_pp1_and_fsdp2(tmp_path):
    """Saved under PP 2, resumed under 1 process and under FSDP 2: same losses as a straight run."""
    common = ["--lr_scheduler.decay_type", "constant", "--debug.deterministic", "--training.global_batch_size", "8",
              "--checkpoint.interval", "3", "--checkpoint.last_save_model_only", "false"]
    run_train(tmp_path / "straight", *common, "--training.local_batch_size", "8", "--training.steps", "6")
    straight = losses(tmp_path / "straight")
    run_train(tmp_path / "pp", *common, "--checkpoint.enable", "--training.local_batch_size", "8", *PP2,
              "--training.steps", "3", nproc=2)
    for name, nproc, batch in (("pp1", 1, "8"), ("fsdp2", 2, "4")):
        dump = tmp_path / name
        dump.mkdir()
        import shutil

        shutil.copytree(tmp_path / "pp" / "checkpoint", dump / "checkpoint")
        run_train(dump, *common, "--checkpoint.enable", "--training.local_batch_size", batch, "--training.steps", "6",
                  nproc=nproc)
        resumed = losses(dump)
        assert sorted(resumed) == [4, 5, 6], resumed  # continued from step 3
        for step in (4, 5, 6):
            assert abs(resumed[step] - straight[step]) <= 1e-5 * straight[step], (name, step, resumed, straight)
