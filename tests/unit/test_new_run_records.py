"""A new run in a dump folder that holds an earlier run's records but no checkpoint: the earlier records are
moved aside (and the log says where), so metrics.jsonl and TensorBoard hold one run's steps only; a resumed
run keeps appending to its own. The real ``trainer.train.main`` at world size 1, in this process."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.launch import train_in_process


def steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def test_a_new_run_moves_the_earlier_records_aside(tmp_path, monkeypatch):
    dump = tmp_path / "run"
    rc, log = train_in_process(dump, "--training.steps", "4", "--checkpoint.enable", "false",
                               "--metrics.enable_tensorboard", "true", monkeypatch=monkeypatch)
    assert rc == 0, log[-3000:]
    rc, log = train_in_process(dump, "--training.steps", "2", "--checkpoint.enable", "false",
                               "--metrics.enable_tensorboard", "true", monkeypatch=monkeypatch)
    assert rc == 0, log[-3000:]
    assert steps(dump / "metrics.jsonl") == [1, 2]  # this run's steps only
    (previous,) = (dump / "previous_runs").iterdir()
    assert f"moved them to {previous}" in log
    assert steps(previous / "metrics.jsonl") == [1, 2, 3, 4]
    assert len(list((previous / "tb").rglob("events.out.tfevents.*"))) == 1
    assert len(list((dump / "tb").rglob("events.out.tfevents.*"))) == 1
    assert json.loads((previous / "summary.json").read_text())["status"] == "completed"


def test_a_resumed_run_keeps_its_records(tmp_path, monkeypatch):
    dump = tmp_path / "run"
    rc, log = train_in_process(dump, "--training.steps", "2", "--checkpoint.enable", monkeypatch=monkeypatch)
    assert rc == 0, log[-3000:]
    rc, log = train_in_process(dump, "--training.steps", "4", "--checkpoint.enable", monkeypatch=monkeypatch)
    assert rc == 0, log[-3000:]
    assert steps(dump / "metrics.jsonl") == [1, 2, 3, 4] and not (dump / "previous_runs").exists()


def test_the_first_step_is_always_logged(tmp_path, monkeypatch):
    """As torchtitan: step 1's line comes at once whatever metrics.log_freq is, then every log_freq steps and
    the last."""
    rc, log = train_in_process(tmp_path / "run", "--training.steps", "7", "--metrics.log_freq", "3",
                               "--checkpoint.enable", "false", monkeypatch=monkeypatch)
    assert rc == 0, log[-3000:]
    assert steps(tmp_path / "run" / "metrics.jsonl") == [1, 3, 6, 7]
