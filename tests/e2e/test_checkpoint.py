"""Checkpoints through real runs of ./run_train.sh (torchrun processes): exact resume with synchronous
and asynchronous saves, kill -9 in the middle of a save and a full disk (resharding across layouts is in
tests/distributed/test_checkpoint.py).

Every run uses the same global batch (4 sequences of 64 tokens: 1 process x 4, 2 x 2 or 4 x 1) and the
constant learning-rate schedule. The schedule matters for honesty: "10 steps, stop, then the same command
to 20" changes training.steps, and with a decaying schedule the first run's learning rates would come
from a 10-step curve, not the 20-step one of the straight run. With warmup then constant, the learning
rate at a step does not depend on training.steps, so both runs see exactly the straight run's schedule
(asserted below via the logged lr). The kill test's two runs share training.steps.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.launch import kill_tree, read_metrics, run_train, start_train
from trainer.checkpoint import scan_folder, validate_checkpoint

pytestmark = pytest.mark.slow

STEPS = 20
COMMON = ["--lr_scheduler.decay_type", "constant", "--checkpoint.interval", "5"]
CKPT = ["--checkpoint.enable"]


def batch(nproc: int) -> list[str]:
    return ["--training.local_batch_size", str(4 // nproc)]


def records(dump: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(dump)}  # a re-run step: its last record wins


def output(proc) -> str:
    return proc.stdout + proc.stderr


def assert_same(ref: dict[int, dict], got: dict[int, dict], steps, rel: float = 0.0) -> None:
    for s in steps:
        a, b = ref[s], got[s]
        assert b["data_fingerprint"] == a["data_fingerprint"], f"step {s}: different data"
        assert b["lr"] == a["lr"], f"step {s}: lr {b['lr']} != {a['lr']}"
        if rel == 0.0:
            assert b["loss"] == a["loss"], f"step {s}: loss {b['loss']!r} != {a['loss']!r}"
        else:
            assert abs(b["loss"] - a["loss"]) <= rel * abs(a["loss"]), f"step {s}: loss {b['loss']} vs {a['loss']}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[int, dict]:
    """20 steps in one process, no checkpoints: the reference."""
    dump = tmp_path_factory.mktemp("straight")
    run_train(dump, *COMMON, *batch(1), "--training.steps", str(STEPS))
    return records(dump)


def test_exact_resume_sync(straight, tmp_path):
    """10 steps, stop, the same command to 20: steps 11-20 bitwise identical to the straight run."""
    args = [*COMMON, *CKPT, *batch(1), "--checkpoint.last_save_model_only", "false"]
    run_train(tmp_path, *args, "--training.steps", "10")
    proc = run_train(tmp_path, *args, "--training.steps", str(STEPS))
    assert "checkpoint step-10 saved" not in output(proc) and "step-10 loaded" in output(proc)
    got = records(tmp_path)
    assert_same(straight, got, range(1, STEPS + 1))
    assert sorted(got) == list(range(1, STEPS + 1))


def test_exact_resume_async(straight, tmp_path):
    """Asynchronous saves (slowed down so several steps run while one is written) with the default
    model-only final export: with the last step's full save gone, the extended run resumes from the
    asynchronous step-5, bitwise."""
    args = [*COMMON, *CKPT, *batch(1), "--checkpoint.async_mode", "async", "--checkpoint.drill_save_delay_s", "1"]
    first = run_train(tmp_path, *args, "--training.steps", "10")
    saved = re.search(r"checkpoint step-5 saved: .* in ([0-9.]+) s \(training blocked ([0-9.]+) s\)", output(first))
    assert saved, output(first)[-3000:]
    total, blocked = map(float, saved.groups())
    assert total >= 1.0 > blocked  # written in the background while training went on
    shutil.rmtree(tmp_path / "checkpoint" / "step-10")  # leaves final-step-10 (weights only) and step-5
    proc = run_train(tmp_path, *args, "--training.steps", str(STEPS))
    log = output(proc)
    assert "holds only model weights" in log and "step-5 loaded" in log
    assert_same(straight, records(tmp_path), range(1, STEPS + 1))
    kinds = {c.path.name: c.kind for c in scan_folder(tmp_path / "checkpoint")}
    assert kinds == {"step-5": "full", "step-10": "full", "final-step-10": "model_only", "step-15": "full",
                     "step-20": "full", "final-step-20": "model_only"}


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
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_disk_full(tmp_path):
    """A 100 MiB filesystem holds one checkpoint (65 MiB) but not two: the first save succeeds, the
    second is refused with a message about disk space, the run exits non-zero, and step-2 stays intact.
    (Without permission to mount a tmpfs the same is simulated with checkpoint.drill_disk_bytes.)"""
    dump = tmp_path / "small"
    mounted = _mount_tmpfs(dump, "100m")
    try:
        extra = [] if mounted else ["--checkpoint.drill_disk_bytes", str(100 << 20)]
        proc = run_train(dump, *COMMON, *CKPT, *batch(1), "--training.steps", "6", "--checkpoint.interval", "2",
                         "--checkpoint.last_save_model_only", "false", *extra, check=False)
        log = output(proc)
        assert proc.returncode != 0, log[-3000:]
        assert "disk space is short" in log  # said at the start
        assert "not enough disk space for checkpoint step-4" in log and "checkpoint error" in log
        assert [(c.path.name, c.status) for c in scan_folder(dump / "checkpoint")] == [("step-2", "complete")]
        assert validate_checkpoint(dump / "checkpoint" / "step-2")[0] == "complete"
        assert max(records(dump)) == 4
    finally:
        if mounted:
            subprocess.run(["umount", str(dump)], check=False)
