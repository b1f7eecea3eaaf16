"""Never lose or corrupt work, end to end through run_train.sh (real torchrun, gloo, DCP files).

One straight 20-step run on 2 processes is the reference for every other run here; a second launch into
the dump folder of a run that is still going must be refused. Tiny settings: two of the debug model's six
blocks at seq_len 32, a constant learning rate after warmup (so that a 10-step run continued to 20 follows the
same schedule).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.batches import spec
from trainer.checkpoint import cli as checkpoint_cli
from tests.support.launch import losses, read_metrics, run_train, start_train, train_in_process
from tests.support.processes import QUICK_S, alive, descendants, kill_tree, run

TINY = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
        "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_type", "constant",
        "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "true", "--model.n_layers", "2"]
STEPS = 20


def train(dump: Path, *args: str, nproc: int = 2, check: bool = True) -> subprocess.CompletedProcess:
    return run_train(dump, *TINY, *args, nproc=nproc, check=check, fast=False)


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def flip_bit(path: Path) -> None:
    """One bit of a file's middle byte changed; the size stays."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def wait_for_step(dump: Path, step: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        path = dump / "metrics.jsonl"
        if path.exists() and any(r["step"] >= step for r in read_metrics(dump)):
            return
        assert proc.poll() is None, f"the run ended before step {step}"
        assert time.monotonic() < deadline, f"step {step} not reached"
        time.sleep(0.1)


# The reference: 20 steps on 2 processes, a checkpoint every 5 (a batched run: the other runs here go through
# the launcher, this one only has to be the same training).
STRAIGHT = spec("never_lose_work_straight", 2, *TINY, "--training.steps", str(STEPS), "--checkpoint.interval", "5",
                fast=False, lane="never_lose_work")  # a start of its own: this file's tests begin by reading it
# The default checkpoint settings (only the last step's save), 10 steps and then continued to 20: batched runs
# too (resuming is the trainer's; the launcher adds nothing to it), the first run's final export copied aside
# before the second starts.
FIRST_10 = spec("never_lose_work_first_10", 2, *TINY, "--training.steps", "10", fast=False, lane="never_lose_work")
TO_20 = spec("never_lose_work_to_20", 2, *TINY, "--training.steps", str(STEPS), fast=False, lane="never_lose_work",
             after=(FIRST_10,), dump=f"{{root}}/{FIRST_10}",
             copy=((f"{{root}}/{FIRST_10}/checkpoint/final-step-10", "{root}/first_final_step_10"),))
pytestmark = [pytest.mark.slow, pytest.mark.runs(STRAIGHT)]


@pytest.fixture(scope="module")
def straight(batches) -> Path:
    return batches.get(STRAIGHT).dump


def test_second_launch_refused(straight, tmp_path):
    """While a run holds its dump folder (stalled before step 2 by the hang drill, so it holds it for as
    long as the test needs), a second launch into the folder is refused at once; a run that ended has
    released the folder."""
    assert not (straight / "run.lock").exists()  # released when the run ended
    assert sorted(losses(straight)) == list(range(1, STEPS + 1))
    dump = tmp_path / "run"
    first = start_train(dump, *TINY, "--training.steps", str(STEPS), "--debug.stall_at_step", "2",
                        "--debug.stall_seconds", "3600", nproc=1, fast=False)
    try:
        wait_for_step(dump, 1, first)  # step 2 stalls: the first run holds the folder until it is killed
        assert (dump / "run.lock").exists()
        second = train(dump, "--training.steps", str(STEPS), check=False)
        # Refused at once: the second launch ended while the first (stalled for an hour) still holds the folder.
        assert first.poll() is None
    finally:
        kill_tree(first)
    assert second.returncode == 6, output(second)
    assert "in use by another run" in output(second) and "Traceback" not in output(second)


def test_bit_flip_in_newest_checkpoint(straight, tmp_path, capsys):
    dump = tmp_path / "run"
    shutil.copytree(straight, dump)
    victim = dump / "checkpoint" / "step-20" / "__1_0.distcp"
    flip_bit(victim)
    # `trainer checkpoint verify` run in this process (the `trainer` command's dispatch is tests/unit/test_cli.py's):
    # it names the damaged file; then a launch resumes from step-15.
    rc, out = checkpoint_cli.main(["verify", str(dump)]), capsys.readouterr().out
    assert rc == 3 and "step-20: __1_0.distcp fails its" in out, out
    proc = train(dump, "--training.steps", str(STEPS), "--checkpoint.interval", "5")
    log = output(proc)
    assert "step-20 could not be loaded (CORRUPT: step-20/__1_0.distcp" in log, log[-3000:]
    assert "step-15 loaded" in log
    # The damaged step-20 and the earlier final export were moved aside when step 20 was saved again.
    kept = sorted(p.name.split(".")[0] for p in (dump / "checkpoint" / "moved-aside").iterdir())
    assert kept == ["final-step-20", "step-20"]
    got, want = losses(dump), losses(straight)
    assert [got[s] for s in range(16, STEPS + 1)] == [want[s] for s in range(16, STEPS + 1)]


def test_every_checkpoint_corrupt_stops_untouched(straight, tmp_path, monkeypatch):
    """The trainer in this process (one process, as a launch would start): what it refuses is the trainer's;
    the launcher passing a worker's exit code on is tests/e2e/test_launcher_errors.py's."""
    dump = tmp_path / "run"
    shutil.copytree(straight, dump)
    for step_dir in (dump / "checkpoint").iterdir():
        flip_bit(step_dir / "__0_0.distcp")
    before = hashes(dump / "checkpoint")
    rc, log = train_in_process(dump, *TINY, "--training.steps", "25", monkeypatch=monkeypatch, fast=False)
    assert rc == 3, log[-3000:]
    assert "holds checkpoints but none can be loaded" in log and "Traceback" not in log
    for step in (5, 10, 15, 20):
        assert f"step-{step}: CORRUPT" in log
    assert hashes(dump / "checkpoint") == before


def test_sigterm_saves_and_resumes_exactly(straight, tmp_path):
    dump = tmp_path / "run"
    args = ["--training.steps", str(STEPS), "--checkpoint.interval", "100", "--checkpoint.preemption_check_steps", "1"]
    proc = start_train(dump, *TINY, *args, nproc=2, fast=False)
    try:
        wait_for_step(dump, random.randint(3, 8), proc)
        os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler does: the launcher and the workers
        rc = proc.wait(timeout=QUICK_S)
    finally:
        kill_tree(proc)
    log = Path(f"{dump}.log").read_text()
    assert rc == 128 + signal.SIGTERM, log[-3000:]
    assert "Traceback" not in log
    summary = json.loads((dump / "summary.json").read_text())
    stopped = summary["step"]
    assert summary["status"] == "preempted" and stopped < STEPS
    assert (dump / "checkpoint" / f"step-{stopped}" / "checkpoint.json").is_file()
    assert max(losses(dump)) == stopped
    train(dump, *args)
    got, want = losses(dump), losses(straight)
    assert [got[s] for s in range(1, STEPS + 1)] == [want[s] for s in range(1, STEPS + 1)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_kill_9_of_agent_leaves_no_worker(tmp_path):
    dump = tmp_path / "run"
    proc = start_train(dump, *TINY, "--training.steps", "500", nproc=1, fast=False)
    try:
        wait_for_step(dump, 1, proc)
        workers = descendants(proc.pid)
        assert workers
        os.kill(proc.pid, signal.SIGKILL)  # the launcher is torchrun's agent
        proc.wait(timeout=QUICK_S)
        deadline = time.monotonic() + QUICK_S
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in workers if alive(p)]
    finally:
        kill_tree(proc)


@pytest.mark.runs(TO_20)
def test_train_10_then_continue_to_20(straight, batches):
    """The default checkpoint settings (only the last step's save): the continued run resumes exactly, the
    first run's final export stays, and both runs match the reference."""
    run = batches.get(TO_20)
    first_final = run.dump / "checkpoint" / "final-step-10"
    marker = json.loads((run.dump.parent / "first_final_step_10" / "checkpoint.json").read_text())
    assert marker["kind"] == "model_only"
    assert "step-10 loaded" in run.log
    assert json.loads((first_final / "checkpoint.json").read_text()) == marker
    assert (run.dump / "checkpoint" / "final-step-20").is_dir() and (run.dump / "checkpoint" / "step-20").is_dir()
    got, want = losses(run.dump), losses(straight)
    assert [got[s] for s in range(1, STEPS + 1)] == [want[s] for s in range(1, STEPS + 1)]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_disk_full_under_dump_folder(tmp_path):
    """metrics.jsonl on a full device (/dev/full): one line, exit code 5, summary.json written."""
    dump = tmp_path / "run"
    dump.mkdir()
    (dump / "metrics.jsonl").symlink_to("/dev/full")
    proc = run_train(dump, *TINY, "--training.steps", "3", "--checkpoint.enable", "false", nproc=1, check=False,
                     fast=False)
    log = output(proc)
    assert proc.returncode == 5, log[-3000:]
    assert "output error: cannot write the dump folder" in proc.stderr and "Traceback" not in log
    summary = json.loads((dump / "summary.json").read_text())
    assert summary["status"] == "failed" and "No space left" in summary["error"]
