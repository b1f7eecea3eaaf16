"""Config: TOML + CLI merge, precedence, and the errors a user can cause."""

import pytest

from tests.support.launch import ROOT
from trainer.config import ConfigError, load_config, markdown_reference, to_toml, validate


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 128\n[optimizer]\nlr = 1e-3\n")
    c = load_config(["--job.config_file", path, "--training.steps=9"], env={})
    assert c.training.steps == 9  # CLI wins
    assert c.training.seq_len == 128  # TOML over default
    assert c.optimizer.lr == 1e-3
    assert c.training.local_batch_size == 8  # default
    assert c.explicitly_set("training.seq_len") and not c.explicitly_set("training.local_batch_size")


def test_config_file_from_environment(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 3\n")
    assert load_config([], env={"CONFIG_FILE": path}).training.steps == 3


def test_value_forms():
    c = load_config(["--debug.deterministic", "--job.print_config", "false", "--model.converters",
                     "quantize.linear.float8", "--lr_scheduler.decay_ratio", "none",
                     "--stability.skip_steps", "10-20,25", "--optimizer.lr", "2e-4"], env={})
    assert c.debug.deterministic is True and c.job.print_config is False
    assert c.model.converters == ["quantize.linear.float8"]
    assert c.lr_scheduler.decay_ratio is None
    assert c.stability.skip_steps == [[10, 20], [25, 25]]
    assert c.optimizer.lr == 2e-4


def test_nested_section_from_toml(tmp_path):
    path = write(tmp_path, '[quantize.linear.float8]\nrecipe_name = "rowwise"\n[stability]\nskip_steps = [[3, 5], [8, 8]]\n')
    c = load_config(["--job.config_file", path], env={})
    assert c.quantize.linear.float8.recipe_name == "rowwise"
    assert c.stability.skip_steps == [[3, 5], [8, 8]]


@pytest.mark.parametrize("argv, fragment", [
    (["--training.no_such_key=1"], "unknown config key 'training.no_such_key'"),
    (["--training.stepz", "5"], "did you mean 'training.steps'"),
    (["--traning.steps", "5"], "did you mean 'training.steps'"),
    (["--training.steps", "five"], "training.steps: expected int"),
    (["--debug.deterministic", "maybe"], "debug.deterministic: expected bool"),
    (["--activation_checkpoint.mode", "ful"], "did you mean 'full'"),
    (["--training.local_batch_size", "0"], "training.local_batch_size must be >= 1"),
    (["--training.global_batch_size", "12", "--training.local_batch_size", "8"], "multiple of"),
    (["--model.converters", "quantize.linear.int4"], "unknown converter"),
])
def test_errors_name_the_key(argv, fragment):
    with pytest.raises(ConfigError, match=None) as e:
        validate(load_config(argv, env={}))
    assert fragment in str(e.value)


def test_toml_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(["--job.config_file", str(tmp_path / "missing.toml")], env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(["--job.config_file", write(tmp_path, "[training\nsteps=1")], env={})
    with pytest.raises(ConfigError, match="did you mean 'training.seq_len'"):
        load_config(["--job.config_file", write(tmp_path, "[training]\nseqlen = 5\n")], env={})
    with pytest.raises(ConfigError, match="training.steps: expected int"):
        load_config(["--job.config_file", write(tmp_path, "[training]\nsteps = '5'\n")], env={})


def test_world_size_checks():
    c = load_config(["--parallelism.tensor_parallel_degree", "3"], env={})
    with pytest.raises(ConfigError, match="tensor_parallel_degree \\(3\\)"):
        validate(c, 4)
    c = load_config(["--parallelism.data_parallel_shard_degree", "2", "--parallelism.data_parallel_replicate_degree", "3"], env={})
    with pytest.raises(ConfigError, match="multiply to the world size 4"):
        validate(c, 4)
    c = load_config(["--training.global_batch_size", "8"], env={})
    with pytest.raises(ConfigError, match="data-parallel degree \\(3\\)"):
        validate(c, 3)
    validate(load_config(["--training.global_batch_size", "16"], env={}), 2)


def test_resolved_config_round_trips(tmp_path):
    c = load_config(["--training.steps", "11", "--stability.skip_steps", "3-5"], env={})
    path = write(tmp_path, to_toml(c))
    again = load_config(["--job.config_file", path], env={})
    assert again.to_dict() | {"job": None} == c.to_dict() | {"job": None}


def test_docs_config_md_matches_code():
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == markdown_reference(), "regenerate: python -m trainer.config --markdown > docs/config.md"
