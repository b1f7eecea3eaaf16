"""torchtitan's own spellings of things this trainer has: a torchtitan file keeps meaning what it means there."""

from __future__ import annotations

from pathlib import Path

from trainer.config import load_config, to_toml, validate

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "torchtitan"


def test_float8_converter_name_from_torchtitans_405b_preset():
    config = load_config(["--job.config_file", str(ASSETS / "llama3_405b.toml")], env={})
    assert config.model.converters == ["quantize.linear.float8"]  # the file says ["float8"]
    assert 'converters = ["quantize.linear.float8"]' in to_toml(config)


def test_float8_beside_its_full_name_is_one_converter():
    config = load_config(["--model.converters", "float8,quantize.linear.float8"], env={})
    assert config.model.converters == ["quantize.linear.float8"]
    validate(config)


def test_a_missing_hf_assets_folder_is_named(tmp_path, monkeypatch):
    """torchtitan's debug TOML run from another folder: its ./tests/assets/tokenizer is not there. The one
    line names that folder, not only the keys that could be set."""
    from trainer.errors import ConfigError
    from trainer.models.config import resolve_model_args
    from trainer.train import main

    monkeypatch.chdir(tmp_path)
    # torchtitan's debugmodel has a vocabulary of its own, so its dry run needs no tokenizer (as 8B's):
    # it passes, and the log names the missing folder.
    argv = ["--job.config_file", str(ASSETS / "debug_model.toml"), "--job.dry_run",
            "--job.dump_folder", str(tmp_path / "out")]
    assert main(argv) == 0
    # A flavor that takes its vocabulary from the tokenizer cannot do without it.
    argv += ["--model.flavor", "debug_gqa"]
    config = load_config(argv, env={})
    try:
        resolve_model_args(config, None)
    except ConfigError as e:
        assert "model.hf_assets_path './tests/assets/tokenizer' does not exist" in str(e), e
    else:
        raise AssertionError("a missing tokenizer folder was accepted")
    assert main(argv) == 2  # the dry run a user would type: one line, the config exit code
