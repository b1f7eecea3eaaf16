"""Fast checks of the pieces that keep work safe: checksums, the run lock, commit and move-aside, signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.support import processes
from trainer.checkpoint import integrity
from trainer.checkpoint.layout import MARKER, MOVED_ASIDE, commit, inspect_checkpoint, scan_folder
from trainer.preemption import PreemptionHandler
from trainer.runlock import LOCK_FILE, RunLock, RunLockedError


def _dcp_save(folder, algo: str) -> dict:
    """A real single-process DCP save through the hashing filesystem; returns the streamed checksums."""
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(str(folder))
    writer.fs, sums = integrity.hashing_filesystem(writer.fs, algo)
    state = {"w": torch.randn(256, 64), "b": torch.arange(1000)}
    with pytest.warns(UserWarning):  # no process group: DCP says it saves in one process
        dcp.save(state, storage_writer=writer)
    return sums


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_checksums_streamed_while_writing_match_the_files(tmp_path, algo):
    if not integrity.available(algo):
        pytest.skip(f"{algo} unavailable")
    sums = _dcp_save(tmp_path / "step-1.tmp", algo)
    assert sums and all(name.endswith(".distcp") for name in sums)
    for name, entry in sums.items():
        assert integrity.file_checksum(tmp_path / "step-1.tmp" / name, algo) == (entry["size"], entry["checksum"])
    commit(tmp_path / "step-1.tmp", tmp_path / "step-1", {"format": 1, "step": 1, "kind": "full"}, sums, algo)
    marker = json.loads((tmp_path / "step-1" / MARKER).read_text())
    assert marker["checksum"] == algo and set(marker["files"]) >= {".metadata", *sums}
    assert integrity.verify_files(tmp_path / "step-1", marker) is None
    # A flipped bit keeps the size (the scan still calls it complete) but fails its checksum, by name.
    victim = tmp_path / "step-1" / sorted(sums)[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    assert inspect_checkpoint(tmp_path / "step-1").complete
    assert integrity.verify_files(tmp_path / "step-1", marker).startswith(f"{victim.name} fails its {algo} checksum")
    (tmp_path / "step-1" / ".metadata").unlink()
    assert integrity.verify_files(tmp_path / "step-1", marker, [".metadata"]) == ".metadata is missing"


def test_verify_command_exit_codes(tmp_path, capsys):
    from trainer.checkpoint.cli import main as checkpoint_main

    sums = _dcp_save(tmp_path / "ckpt" / "step-2.tmp", "sha256")
    commit(tmp_path / "ckpt" / "step-2.tmp", tmp_path / "ckpt" / "step-2", {"format": 1, "step": 2, "kind": "full"},
           sums, "sha256")
    assert checkpoint_main(["verify", str(tmp_path / "ckpt")]) == 0
    assert "sha256 checksums match" in capsys.readouterr().out
    victim = tmp_path / "ckpt" / "step-2" / sorted(sums)[0]
    data = victim.read_bytes()
    victim.write_bytes(data[:-1] + bytes([data[-1] ^ 0x80]))
    assert checkpoint_main(["verify", str(tmp_path / "ckpt")]) == 3
    assert f"{victim.name} fails its sha256 checksum" in capsys.readouterr().out


def test_foreign_folder_moved_aside_not_deleted(tmp_path):
    folder = tmp_path / "checkpoint"
    sums = _dcp_save(folder / "step-3.tmp", "sha256")
    # In the way: a complete DCP folder without our commit marker, holding a user's file.
    theirs = folder / "step-3"
    theirs.mkdir(parents=True)
    (theirs / ".metadata").write_bytes(b"not ours")
    (theirs / "notes.txt").write_text("keep me")
    commit(folder / "step-3.tmp", theirs, {"format": 1, "step": 3, "kind": "full"}, sums, "sha256")
    moved = list((folder / MOVED_ASIDE).iterdir())
    assert len(moved) == 1 and (moved[0] / "notes.txt").read_text() == "keep me"
    assert inspect_checkpoint(theirs).complete
    assert [c.path.name for c in scan_folder(folder)] == ["step-3"]
    # Our own committed folder with a file the marker does not list: moved aside too.
    (theirs / "user.bin").write_bytes(b"x")
    sums = _dcp_save(folder / "step-3.tmp", "sha256")
    commit(folder / "step-3.tmp", theirs, {"format": 1, "step": 3, "kind": "full"}, sums, "sha256")
    assert len(list((folder / MOVED_ASIDE).iterdir())) == 2 and not (theirs / "user.bin").exists()


def test_run_lock_refuses_then_takes_over_stale(tmp_path):
    lock = RunLock(tmp_path, stale_after_s=60).acquire()
    info = json.loads((tmp_path / LOCK_FILE).read_text())
    assert info["host"] == socket.gethostname() and info["pid"] == os.getpid() and info["started"]
    with pytest.raises(RunLockedError, match="in use by another run"):
        RunLock(tmp_path, stale_after_s=60).acquire()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    # A dead process on this host: taken over.
    dead = processes.popen([sys.executable, "-c", "pass"])
    dead.wait()
    processes.forget(dead)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid,
                                                  "heartbeat": time.time()}))
    RunLock(tmp_path, stale_after_s=60).acquire().release()
    # Another host whose heartbeat stopped long ago: taken over; a fresh one is not.
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1, "heartbeat": 0}))
    old = time.time() - 3600
    os.utime(tmp_path / LOCK_FILE, (old, old))
    RunLock(tmp_path, stale_after_s=60).acquire().release()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1, "heartbeat": time.time()}))
    with pytest.raises(RunLockedError):
        RunLock(tmp_path, stale_after_s=60).acquire()


def test_signal_sets_flag_and_agreement_waits_for_check_step():
    before = signal.getsignal(signal.SIGTERM)  # the test session's own handler (tests/conftest.py)
    handler = PreemptionHandler(check_steps=3)
    handler.install()
    assert signal.getsignal(signal.SIGTERM) != before
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a second one while stopping is ignored
        assert handler.signum == signal.SIGTERM
        assert handler.agreed(4) == 0 and handler.agreed(6) == signal.SIGTERM
    finally:
        handler.restore()
    assert signal.getsignal(signal.SIGTERM) == before  # the previous handler is back


def test_skipped_documents_counted_by_kind_resumed_exactly_and_stop_names_file_and_line(tmp_path):
    from trainer.data.loader import build_train_loader
    from trainer.data.faults import SkipMonitor
    from tests.support.data import ByteTokenizer, make_config, synthetic_texts
    from trainer.errors import DataError

    path = tmp_path / "c.jsonl"
    good = [json.dumps({"text": t}) for t in synthetic_texts(150, seed=3)]
    bad = ['{"txt": "no text field"}', "", "not json", '{"text": "\\ud800 lone surrogate"}']
    lines = good[:40] + bad + good[40:]
    path.write_text("\n".join(lines) + "\n")

    def loader(**kw):
        config = make_config(**{"data.sources": [f"jsonl:{path}"], "training.seq_len": 16,
                                "training.local_batch_size": 4, "data.num_shards": 1, "data.shuffle": False, **kw})
        return config, build_train_loader(config, ByteTokenizer(), dp_rank=0, dp_world_size=1)

    config, first = loader(**{"data.max_skipped_fraction": 1.0})
    monitor = SkipMonitor(first, config, None, 1)
    while first.stats["documents"] < 120:
        next(first)
    record = monitor.record(is_logging_rank=True)
    assert record["data_skipped"] == {"malformed": 1, "empty": 1, "undecodable": 1, "missing_field": 1}
    # The counters are loader state: a resumed loader continues them exactly.
    config, resumed = loader(**{"data.max_skipped_fraction": 1.0})
    resumed.load_state_dict(first.state_dict())
    for _ in range(3):
        next(first), next(resumed)
    assert {k: v for k, v in resumed.stats.items() if k.startswith("skipped")} == \
        {k: v for k, v in first.stats.items() if k.startswith("skipped")}
    # Above data.max_skipped_fraction: a DataError naming the file and the line of the last one.
    config, strict = loader(**{"data.max_skipped_fraction": 0.01})
    while strict.stats["documents"] < 120:
        next(strict)
    with pytest.raises(DataError, match=rf"{path}:44.*data.text_field='text'"):
        SkipMonitor(strict, config, None, 1).record(is_logging_rank=True)
