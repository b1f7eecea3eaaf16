"""The run lock belongs to the job: the nodes of one multi-node job (named by their rendezvous) share a dump
folder, whichever node arrives first; another job, or a single-node launch, is still refused."""

from __future__ import annotations

import json
import os
import time

import pytest

from trainer.launch import job_identity
from trainer.runlock import LOCK_FILE, RunLock, RunLockedError

JOB = "trainer@10.0.0.1:29500"


def test_the_nodes_of_one_job_share_the_lock(tmp_path):
    first = RunLock(tmp_path, 300, job=JOB).acquire()
    try:
        second = RunLock(tmp_path, 300, job=JOB).acquire()  # another node of the same job, any node rank
        assert second.joined and not second.held and first.held
        second.release()  # joining never removes the job's lock
        assert (tmp_path / LOCK_FILE).exists()
        with pytest.raises(RunLockedError, match="in use by another run"):
            RunLock(tmp_path, 300, job="other@10.0.0.9:29500").acquire()
        with pytest.raises(RunLockedError):
            RunLock(tmp_path, 300).acquire()  # a single-node launch into the job's folder
    finally:
        first.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_dead_jobs_lock_is_taken_over_not_joined(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "gone", "pid": 1, "job": JOB, "heartbeat": 0}))
    old = time.time() - 3600
    os.utime(tmp_path / LOCK_FILE, (old, old))
    lock = RunLock(tmp_path, 300, job=JOB).acquire()  # the same name restarted after its nodes died
    try:
        assert lock.held and not lock.joined
    finally:
        lock.release()


def test_a_lock_file_not_yet_written_is_waited_for(tmp_path):
    (tmp_path / LOCK_FILE).write_text("")  # another launcher's O_EXCL create, before its write
    with pytest.raises(RunLockedError, match="in use by another run"):
        RunLock(tmp_path, 300, job=JOB).acquire()  # still empty after the wait: a live lock, refused


def test_job_identity_from_torchruns_arguments():
    from torch.distributed.run import parse_args

    two = parse_args(["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29500", "--rdzv-id=run7",
                      "--node-rank=0", "-m", "trainer.train"])
    assert job_identity(two) == "run7@10.0.0.1:29500"
    assert job_identity(parse_args(["--standalone", "--nnodes=1", "-m", "trainer.train"])) is None


def test_the_lock_stays_while_any_part_of_the_job_runs(tmp_path):
    """The part that took the job's lock ends first (e.g. replica group 0): the others still hold it, another
    job is still refused, and the last part to end removes it; a dead part's holder file does not keep it."""
    from trainer.runlock import HOLDERS_DIR

    first = RunLock(tmp_path, 300, job=JOB).acquire()
    second = RunLock(tmp_path, 300, job=JOB).acquire()
    assert first.held and second.joined
    first.release()  # the taker ends first: its pid is still this one, so fake a dead taker
    info = json.loads((tmp_path / LOCK_FILE).read_text())
    (tmp_path / LOCK_FILE).write_text(json.dumps({**info, "pid": 2 ** 22 + 7, "heartbeat": 0}))
    try:
        with pytest.raises(RunLockedError, match="in use by another run"):
            RunLock(tmp_path, 300, job="other@10.0.0.9:29500").acquire()
        third = RunLock(tmp_path, 300, job=JOB).acquire()  # a restarted part of the job joins
        assert third.joined
        third.release()
        assert (tmp_path / LOCK_FILE).exists()
    finally:
        second.release()
    assert not (tmp_path / LOCK_FILE).exists()
    # A holder that died (its heartbeat long gone) does not keep a dead taker's lock.
    first = RunLock(tmp_path, 300, job=JOB).acquire()
    dead = tmp_path / HOLDERS_DIR / "gone-1.json"
    dead.write_text(json.dumps({"host": "gone", "pid": 1, "job": JOB, "heartbeat": 0}))
    old = time.time() - 3600
    os.utime(dead, (old, old))
    first.release()
    assert not (tmp_path / LOCK_FILE).exists() and not dead.exists()
