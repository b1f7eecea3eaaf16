"""Config layout: each layer's sections load without torch, the launcher's pre-flight validates once,
JobConfig is declared (extensions subclass it), moved keys keep their former names, and no import cycle
runs through the config even when imports made only for type annotations count."""

from __future__ import annotations

import dataclasses
import sys
import typing

import pytest

from tests.support import processes
from tests.support.launch import ROOT
from torchtitan_ext.config import ALIASES, ExtJobConfig
from torchtitan_ext.stability.config import Stability
from trainer import extensions
from trainer.config import (
    ConfigError, JobConfig, help_text, job_config_class, leaf_keys, load_config, markdown_reference, to_toml, validate,
)
from trainer.config.reference import main as config_main

LAYER_CONFIG_MODULES = ["trainer.config", "trainer.models.config", "trainer.optim.config", "trainer.parallel.config",
                        "trainer.checkpoint.config", "trainer.observability.config", "trainer.data.config",
                        "trainer.data.checks", "torchtitan_ext.config"]


def test_import_trainer_config_loads_no_torch():
    """The launcher's pre-flight imports trainer.config: -X importtime lists every module it loads."""
    out = processes.run([sys.executable, "-X", "importtime", "-c", "import trainer.config"], cwd=ROOT)
    assert out.returncode == 0, out.stderr
    loaded = [line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert "trainer.config.validate" in loaded  # the list is the real one
    assert not [m for m in loaded if m == "torch" or m.startswith("torch.")]


@pytest.mark.parametrize("module", LAYER_CONFIG_MODULES)
def test_a_layer_config_module_loads_no_torch(module):
    """Through its package __init__ too: a package __init__ stays light."""
    code = f"import sys, {module}; from trainer.config import validate, load_config; " \
           "validate(load_config([], env={}), 1); print('torch' in sys.modules)"
    out = processes.run([sys.executable, "-c", code], cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def count_validations(monkeypatch) -> list:
    """Every validate() ends with the extensions' rules, once: counting those counts validations."""
    calls = []
    real = extensions.check_config
    monkeypatch.setattr(extensions, "check_config", lambda config, world_size: (calls.append(world_size),
                                                                               real(config, world_size)))
    return calls


def test_the_preflight_validates_once(monkeypatch, tmp_path):
    calls = count_validations(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["--check", "--job.dump_folder", str(tmp_path), "--training.steps", "3"]
    assert config_main(argv) == 0
    assert calls == [2]  # once, with the world size
    calls.clear()
    assert config_main(["--check", "--training.local_batch_size", "0"]) == 2
    assert calls == []  # the first broken rule stops it before the extensions' rules


def test_a_worker_validates_once(monkeypatch, tmp_path, capsys):
    from trainer.train import main

    calls = count_validations(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["--job.dry_run", "--job.dump_folder", str(tmp_path), "--training.seq_len", "64"]) == 0
    assert calls == [1]


def test_load_config_parses_without_validating(monkeypatch):
    calls = count_validations(monkeypatch)
    config = load_config(["--training.local_batch_size", "0"], env={})
    assert calls == [] and config.training.local_batch_size == 0
    with pytest.raises(ConfigError, match="training.local_batch_size must be >= 1"):
        validate(config)
    with pytest.raises(ConfigError, match="unknown config key"):  # parsing still refuses what it cannot read
        load_config(["--training.no_such_key", "1"], env={})


def test_job_config_is_declared_and_extensions_subclass_it():
    core = [f.name for f in dataclasses.fields(JobConfig)]
    assert core[:3] == ["job", "model", "optimizer"] and core[-1] == "debug"
    assert typing.get_type_hints(ExtJobConfig)["stability"] is Stability
    assert [f.name for f in dataclasses.fields(ExtJobConfig)] == [*core, "stability", "eval"]
    assert job_config_class() is ExtJobConfig
    config = load_config(["--training.steps", "3"], env={})
    assert isinstance(config, ExtJobConfig)
    assert config.explicitly_set("training.steps") and config.explicit_keys == {"training.steps"}
    assert "explicit_keys" not in config.to_dict() and "explicit" not in to_toml(config)
    assert not any("explicit" in key for key in leaf_keys())


@pytest.mark.parametrize("former, current, value, toml_value, parsed", [
    ("training.z_loss_weight", "stability.z_loss_weight", "1e-3", "1e-3", 1e-3),
    ("debug.inject_bad_data_steps", "stability.inject_bad_data_steps", "3,5", "[3, 5]", [3, 5]),
    ("debug.inject_nonfinite_loss_steps", "stability.inject_nonfinite_loss_steps", "7", "[7]", [7]),
])
def test_moved_keys_keep_their_former_names(tmp_path, former, current, value, toml_value, parsed):
    assert ALIASES[former] == current
    section, name = current.split(".")
    for key in (former, current):
        config = load_config([f"--{key}", value], env={})
        assert getattr(config.stability, name) == parsed and config.explicitly_set(current)
        toml_section, toml_name = key.split(".")
        path = tmp_path / "c.toml"
        path.write_text(f"[{toml_section}]\n{toml_name} = {toml_value}\n")
        assert getattr(load_config(["--job.config_file", str(path)], env={}).stability, name) == parsed
    assert former not in leaf_keys() and current in leaf_keys()
    with pytest.raises(ConfigError, match=f"{former} is the former name of {current}; set only {current}"):
        load_config([f"--{former}", value, f"--{current}", value], env={})
    assert f"former name `{former}` (alias)" in markdown_reference()
    assert f"former name --{former}." in help_text()


def test_moved_keys_keep_their_rules():
    with pytest.raises(ConfigError, match="stability.z_loss_weight must be >= 0"):
        validate(load_config(["--training.z_loss_weight", "-1"], env={}))


# No import cycle through the config, type-only imports counted: tests/unit/test_architecture.py
# (test_no_import_cycles walks the whole graph with them).
