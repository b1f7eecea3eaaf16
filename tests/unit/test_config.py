"""Config: TOML + CLI merge, precedence, and the errors a user can cause."""

import pytest

from tests.support.launch import ROOT
from trainer.config import ConfigError, FrozenConfigError, derive, load_config, markdown_reference, to_toml, validate


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


@pytest.mark.parametrize("args, device, pinned", [
    ([], "cpu", False), ([], "cuda", True), (["--data.pin_memory", "false"], "cuda", False),
    (["--training.dataloader.pin_memory", "false"], "cuda", False),  # torchtitan's name for the same key
    (["--data.pin_memory", "true"], "cpu", True),
], ids=["cpu", "cuda", "user-false", "torchtitan-false", "user-true-cpu"])
def test_the_runs_config_holds_its_derived_values(args, device, pinned):
    """derive: the seed's default (0) and pinned memory on CUDA unless the user said otherwise, computed once
    and written to config.toml; the parsed config is left as it was."""
    c = load_config(args, env={})
    validate(c)
    run = derive(c, device)
    assert run.data.pin_memory is pinned and run.debug.seed == 0
    assert c.debug.seed is None and c.data.pin_memory is (pinned if args else False)
    toml = to_toml(run)
    assert f"pin_memory = {'true' if pinned else 'false'}" in toml.split("[data]")[1].split("\n[")[0]
    assert "seed = 0" in toml.split("[debug]")[1].split("\n[")[0]
    assert derive(load_config(["--debug.seed", "7"], env={}), device).debug.seed == 7


def test_the_runs_config_is_frozen():
    """After derive no key can change (a layer would change what another already read); a copy can."""
    import copy
    import pickle

    run = derive(load_config([], env={}), "cpu")
    with pytest.raises(FrozenConfigError, match="Training.steps cannot change"):
        run.training.steps = 3
    with pytest.raises(FrozenConfigError):
        run.data = None
    with pytest.raises(AttributeError):
        run.explicit_keys.add("training.steps")
    for other in (copy.deepcopy(run), pickle.loads(pickle.dumps(run))):
        other.training.steps = 3
        assert other.training.steps == 3 and other.to_dict() | {"training": None} == run.to_dict() | {"training": None}
    assert run.training.steps == 10000


def test_data_keys_given_under_both_names_must_agree():
    """torchtitan's [training.dataloader] keys are [data]'s: both given and different is refused, not
    decided silently for one of them."""
    with pytest.raises(ConfigError, match=r"data.num_workers \(1\) and training.dataloader.num_workers \(2\) "
                                          "disagree; set one"):
        validate(load_config(["--data.num_workers", "1", "--training.dataloader.num_workers", "2"], env={}))
    same = load_config(["--data.num_workers", "2", "--training.dataloader.num_workers", "2"], env={})
    validate(same)
    assert same.data.num_workers == 2
