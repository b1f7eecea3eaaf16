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
