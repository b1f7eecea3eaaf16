"""Observability through ./run_train.sh (real torchrun processes on CPU): a stalled rank ends the job through
the watchdog with the launcher's exit code, and a 4-rank job's console shows rank 0's lines only."""

from __future__ import annotations

import json
import pickle
import re
import time
from pathlib import Path

import pytest

from tests.support.launch import run_train

STEP_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[rank (\d+)\] INFO step +(\d+) ")
E2E = ["--training.seq_len", "64", "--training.local_batch_size", "2"]


@pytest.mark.slow
def test_stalled_rank_makes_every_rank_dump_stacks_and_exit(tmp_path):
    """Rank 1 sleeps 600 s before step 2 (collectives would wait 600 s too): the watchdog (6 s) on both
    ranks writes the stacks and the flight recorder, and the job ends non-zero in bounded time."""
    dump = tmp_path / "run"
    start = time.monotonic()
    proc = run_train(dump, *E2E, "--training.steps", "4", "--comm.watchdog_timeout_seconds", "6",
                     "--debug.stall_rank", "1", "--debug.stall_at_step", "2", "--debug.stall_seconds", "600",
                     "--comm.train_timeout_seconds", "600", nproc=2, check=False, timeout=400)
    wall = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert wall < 300, wall  # the stall (600 s) and the collective timeout (600 s) were not waited out
    stacks = {r: (dump / "watchdog" / f"rank{r}_stacks.txt").read_text() for r in (0, 1)}
    assert all("most recent call first" in text for text in stacks.values())
    assert "stall_for_drill" in stacks[1]  # the stalled rank's main thread
    for text in stacks.values():  # each rank fired at the configured time after its last step
        waited = int(re.search(r"no progress for (\d+) s \(limit 6 s; last completed: step 1\)", text).group(1))
        assert 6 <= waited < 60, text[:300]  # at the limit, not after the 600 s stall (late only by load)
    assert "train_step" in stacks[0]  # the other rank, waiting for rank 1 in a collective
    # The launcher ends with the worker's code (torchrun's full report goes to the launcher log).
    assert proc.returncode == 124 and "watchdog: rank 0: no progress" in out, out[-2000:]
    assert any("exitcode  : 124" in p.read_text() for p in (dump / "launcher").glob("*.log"))
    recorders = [dump / "comm_traces" / f"rank_{r}" for r in (0, 1)]
    assert any(p.exists() for p in recorders)
    for p in filter(Path.exists, recorders):
        assert any("gloo" in e["profiling_name"] for e in pickle.loads(p.read_bytes())["entries"])
    summary = json.loads((dump / "summary.json").read_text())
    assert summary["status"] == "hung" and summary["step"] == 1


@pytest.mark.slow
def test_two_rank_console_shows_rank0_step_lines_and_the_summary(tmp_path):
    dump = tmp_path / "run"
    proc = run_train(dump, *E2E, "--training.steps", "3", nproc=2, timeout=400)
    lines = proc.stdout.splitlines()
    steps = [m for m in map(STEP_LINE.match, lines) if m]
    assert [(m.group(1), m.group(2)) for m in steps] == [("0", "1"), ("0", "2"), ("0", "3")]
    other = [line for line in lines + proc.stderr.splitlines() if re.search(r"\[rank ?[1-9]\d*\]", line)]
    assert not other, other
    summary_lines = [line for line in lines if "run summary: completed" in line]
    assert len(summary_lines) == 1 and "step 3/3" in summary_lines[0] and "[rank 0]" in summary_lines[0]
    summary = json.loads((dump / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["step"] == 3
