"""Extending a finished run changes the length of a schedule sized by training.steps: the resume says so
in one line and names the key that keeps the saved schedule (the real ``trainer.train.main``, world size 1,
in this process)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.support.launch import train_in_process

MESSAGE = "the LR schedule was 4 steps long in the saved run and is 8 steps now"


def train(dump: Path, *args: str, monkeypatch) -> tuple[int, str]:
    return train_in_process(dump, "--checkpoint.enable", *args, monkeypatch=monkeypatch)


def test_a_longer_schedule_on_resume_is_said_and_total_steps_keeps_the_saved_one(tmp_path, monkeypatch):
    rc, log = train(tmp_path / "run", "--training.steps", "4", monkeypatch=monkeypatch)
    assert rc == 0, log
    marker = json.loads((tmp_path / "run" / "checkpoint" / "step-4" / "checkpoint.json").read_text())
    assert marker["lr_schedule_steps"] == 4
    kept = tmp_path / "kept"
    (kept / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "run" / "checkpoint" / "step-4", kept / "checkpoint" / "step-4")

    rc, log = train(tmp_path / "run", "--training.steps", "8", monkeypatch=monkeypatch)
    assert rc == 0 and MESSAGE in log and "lr_scheduler.total_steps = 4" in log, log[-3000:]
    assert "the learning rate at step 4 was" not in log  # one line, not two about the same change

    rc, log = train(kept, "--training.steps", "8", "--lr_scheduler.total_steps", "4", monkeypatch=monkeypatch)
    assert rc == 0 and "the LR schedule was" not in log, log[-3000:]
