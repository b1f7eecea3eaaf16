"""Relative paths are the user's: run_train.sh started from another folder reads ``--job.config_file``
(and CONFIG_FILE) relative to that folder, not the repository, and config.toml records the absolute path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.processes import QUICK_S, run

ROOT = Path(__file__).resolve().parents[2]


def user_copy(folder: Path) -> Path:
    """The user's own train_configs/debug_model.toml: the bundled one with steps = 0, which only this copy
    has (the pre-flight refuses it at once; the bundled file would start training)."""
    copy = folder / "train_configs" / "debug_model.toml"
    copy.parent.mkdir(parents=True)
    bundled = (ROOT / "train_configs" / "debug_model.toml").read_text()
    copy.write_text(bundled.replace("\nsteps = 40\n", "\nsteps = 0\n", 1))
    assert "\nsteps = 0\n" in copy.read_text()
    return copy


def launch(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, "NGPU": "1", **(env or {})}
    full.pop("CONFIG_FILE", None)
    full.update(env or {})
    return run([str(ROOT / "run_train.sh"), *args], cwd=cwd, env=full, timeout=300)


def test_a_relative_config_file_is_the_users_not_the_repositorys(tmp_path):
    user_copy(tmp_path)
    for proc in (launch(tmp_path, "--job.config_file", "train_configs/debug_model.toml"),
                 launch(tmp_path, env={"CONFIG_FILE": "train_configs/debug_model.toml"})):
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "training.steps must be >= 1, got 0" in proc.stderr


def test_config_toml_records_the_absolute_path(tmp_path):
    user_copy(tmp_path)
    proc = run([sys.executable, "-m", "trainer.config", "--job.config_file", "train_configs/debug_model.toml",
                "--training.steps", "3"], cwd=tmp_path, timeout=QUICK_S)
    assert proc.returncode == 0, proc.stderr
    assert f'config_file = "{tmp_path / "train_configs" / "debug_model.toml"}"' in proc.stdout


def test_a_relative_path_not_found_names_where_it_looked(tmp_path):
    proc = launch(tmp_path, "--job.config_file", "train_configs/llama3_8b.toml")
    assert proc.returncode == 2
    assert f"(relative to the working directory {tmp_path}); the repository has" in proc.stderr
