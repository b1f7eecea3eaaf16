"""Checkpoints through real runs of ./run_train.sh (torchrun processes): kill -9 of the whole job in the
middle of a save; and a full disk, the trainer in this process (exact resume and resharding are in tests/distributed/test_checkpoint.py;
the shared settings in tests/support/checkpoints.py). The kill test's two runs share training.steps.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.support.checkpoints import CKPT, COMMON, STEPS, STRAIGHT, assert_same, batch
from tests.support.launch import FULL_WIDTH, read_metrics, run_train, start_train, train_in_process
from tests.support.processes import kill_tree, run
from trainer.checkpoint.layout import scan_folder, validate_checkpoint

pytestmark = pytest.mark.slow


def records(dump: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(dump)}  # a re-run step: its last record wins


def output(proc) -> str:
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def straight(batches) -> dict[int, dict]:
    """20 steps in one process, no checkpoints: the reference (a batched run, tests/support/checkpoints.py)."""
    return batches.get(STRAIGHT).records()


@pytest.mark.runs(STRAIGHT)
def test_kill_during_save(straight, tmp_path):
    """kill -9 of the whole job (launcher and both ranks) while step-10 is being written: the restart
    reports the interrupted save, resumes from step-5 and completes, with the straight run's data and
    losses (relative 1e-5: two processes sum in another order than one)."""
    args = [*COMMON, *CKPT, *batch(2), "--training.steps", str(STEPS)]
    killed_log = tmp_path.parent / f"{tmp_path.name}-killed.log"
    proc = start_train(tmp_path, *args, "--checkpoint.drill_save_delay_s", "3", nproc=2, log=killed_log)
    tmp = tmp_path / "checkpoint" / "step-10.tmp"
    deadline = time.monotonic() + 300
    try:
        while not tmp.exists():
            assert proc.poll() is None, f"run ended before the kill:\n{killed_log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, "the step-10 save never started"
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        kill_tree(proc)  # kill -9 of the launcher and all its workers at once, like a lost node
    assert proc.returncode != 0
    assert [(c.path.name, c.status) for c in scan_folder(tmp_path / "checkpoint")] == [
        ("step-5", "complete"), ("step-10.tmp", "incomplete")]
    assert max(records(tmp_path)) == 10

    restart = run_train(tmp_path, *args, nproc=2)
    log = output(restart)
    assert "step-10.tmp is incomplete" in log and "step-5 loaded" in log
    assert [c.path.name for c in scan_folder(tmp_path / "checkpoint")] == ["step-5", "step-10", "step-15", "step-20",
                                                                           "final-step-20"]
    assert_same(straight, records(tmp_path), range(1, STEPS + 1), rel=1e-5)


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], timeout=60).returncode == 0


def test_disk_full(tmp_path, monkeypatch):
    """A 100 MiB filesystem holds one checkpoint (65 MiB) but not two: the first save succeeds, the
    second is refused with a message about disk space, the run exits non-zero, and step-2 stays intact.
    (Without permission to mount a tmpfs the same is simulated with checkpoint.drill_disk_bytes.) The trainer
    runs in this process: the refusal is the trainer's, and a launch would add only its start-up."""
    dump = tmp_path / "small"
    mounted = _mount_tmpfs(dump, "100m")
    try:
        extra = [] if mounted else ["--checkpoint.drill_disk_bytes", str(100 << 20)]
        rc, log = train_in_process(dump, *COMMON, *CKPT, *batch(1), "--training.steps", "6", "--checkpoint.interval",
                                   "2", "--checkpoint.last_save_model_only", "false", "--model.n_layers", "6",
                                   *FULL_WIDTH, *extra,
                                   monkeypatch=monkeypatch)  # the debug model's six blocks: 65 MiB a checkpoint
        assert rc != 0, log[-3000:]
        assert "disk space is short" in log  # said at the start
        assert "not enough disk space for checkpoint step-4" in log and "checkpoint error" in log
        assert [(c.path.name, c.status) for c in scan_folder(dump / "checkpoint")] == [("step-2", "complete")]
        assert validate_checkpoint(dump / "checkpoint" / "step-2")[0] == "complete"
        assert max(records(dump)) == 4
    finally:
        if mounted:
            umount = run(["umount", str(dump)], timeout=60)
    if mounted:  # the run stopped on an error and keeps nothing open in its dump folder
        assert umount.returncode == 0, umount.stderr
