"""Extending a finished run changes the length of a schedule sized by training.steps: the resume says so
in one line and names the key that keeps the saved schedule (the real ``trainer.train.main``, world size 1,
in this process)."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import shutil
import socket
from pathlib import Path

from tests.utils import DEBUG_CONFIG, FAST

MESSAGE = "the LR schedule was 4 steps long in the saved run and is 8 steps now"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(dump: Path, *args: str, monkeypatch) -> tuple[int, str]:
    from trainer.train import main

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            rc = main(["--job.config_file", str(DEBUG_CONFIG), "--job.dump_folder", str(dump), *FAST,
                       "--checkpoint.enable", *args])
        finally:
            gc.enable()  # the training loop disables automatic GC
    return rc, out.getvalue()


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
