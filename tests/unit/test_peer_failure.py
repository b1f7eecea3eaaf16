"""A rank that sees another rank's failure (a collective that lost its peer, the job's store gone) reports
it in one line with exit code 7 (trainer/errors.py: PeerLost), not the one line followed by a traceback."""

from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist

from tests.support.launch import train_in_process


def _trainer_failing_with(error):
    class FailingTrainer:
        def __init__(self, config):
            if isinstance(error, RuntimeError) and not isinstance(error, dist.DistError):
                dist.init_process_group("gloo")  # a collective's failure is seen inside a live process group
            raise error

    return FailingTrainer


@pytest.mark.parametrize("error, fragment", [
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                  "[127.0.0.1]:41234"), "collective lost a peer on rank 0 of 1"),
    (dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed."),
     "lost the job's store: another node or rank stopped first"),
], ids=["collective", "store"])
def test_a_lost_peer_is_one_line_and_exit_7(error, fragment, tmp_path, monkeypatch):
    import trainer.train

    monkeypatch.setattr(trainer.train, "Trainer", _trainer_failing_with(error))
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    rc, _ = train_in_process(tmp_path / "out", monkeypatch=monkeypatch)  # raised before: a traceback, exit 1
    assert rc == 7
    line = json.loads(error_file.read_text())["message"]  # what the launcher prints, once
    assert fragment in line and "\n" not in line, line


class _Stopped(BaseException):
    """The process ending in the middle of a write (the agent's SIGTERM, with no handler left to catch it)."""


def test_a_worker_stopped_while_it_writes_its_line_leaves_no_half_written_file(tmp_path, monkeypatch):
    """torchrun's agent parses the error file of every failed worker; on an empty or half-written one it ends
    with a JSONDecodeError traceback instead of the job's failure line (seen on a two-node job whose
    surviving rank was stopped while it wrote). A write stopped before it is whole leaves no file; a finished
    one a file the agent parses."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    import trainer.launch

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    def stopped_before_the_rename(src, dst):
        raise _Stopped

    with monkeypatch.context() as m:
        m.setattr(os, "replace", stopped_before_the_rename)
        with pytest.raises(_Stopped):
            trainer.launch.record_failure("peer lost", "collective lost a peer")
    assert list(tmp_path.iterdir()) == []
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(error_file))  # no file: no parse
    assert "Signal 15" in failure.message, failure.message

    trainer.launch.record_failure("peer lost", "collective lost a peer\non rank 1")
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=7, error_file=str(error_file))
    assert failure.message == "peer lost: collective lost a peer on rank 1"
