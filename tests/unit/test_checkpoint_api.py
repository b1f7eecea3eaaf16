"""The checkpoint package's pieces on their own: the one folder scanner and its naming rule (shared by the
trainer, the offline tools and the stability guard), the ranks' agreement on failures, and the manager
over explicit components (no Trainer) in one process."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist

from tests.support import children
from trainer.checkpoint.layout import MARKER, inspect_checkpoint, locate_folder, scan_folder
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.offline import CheckpointNotFound, find_checkpoint
from trainer.checkpoint.state import TrainState
from trainer.checkpoint.agree import Collectives
from trainer.config import load_config


def _commit_marker(folder, step, files=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".metadata").write_bytes(b"x" * 10)
    files = files or {".metadata": 10}
    (folder / MARKER).write_text(json.dumps({"format": 1, "step": step, "kind": "full", "files": files}))


def test_one_scanner_one_naming_rule(tmp_path):
    ckpt = tmp_path / "checkpoint"
    _commit_marker(ckpt / "step-2", 2)
    _commit_marker(ckpt / "step-4", 4, files={".metadata": 10, "__0_0.distcp": 5})  # a listed file is missing
    (ckpt / "step-6.tmp").mkdir()
    (ckpt / "step-8").mkdir()
    (ckpt / "step-8" / ".metadata").write_bytes(b"y")  # a plain dcp.save by another tool: no marker
    for other in ("step_10", "step-x", "notes"):
        (ckpt / other).mkdir()
    infos = {c.path.name: c for c in scan_folder(ckpt)}
    assert list(infos) == ["step-2", "step-4", "step-6.tmp", "step-8"]
    assert [infos[n].status for n in infos] == ["complete", "corrupt", "incomplete", "incomplete"]
    assert infos["step-6.tmp"].leftover and not infos["step-8"].leftover
    assert infos["step-8"].unmarked and infos["step-8"].readable and not infos["step-8"].complete
    assert "__0_0.distcp is missing" in infos["step-4"].reason
    # The offline readers use the same scanner: another tool's finished save is the newest readable one.
    assert locate_folder(tmp_path) == ckpt
    assert find_checkpoint(tmp_path) == ckpt / "step-8"
    with pytest.raises(CheckpointNotFound, match="corrupt"):
        find_checkpoint(tmp_path, step=4)
    # A folder outside the naming rule is inspected on its own (its step from the marker).
    _commit_marker(tmp_path / "exported", 7)
    assert inspect_checkpoint(tmp_path / "exported").step == 7
    # The stability guard names the same checkpoints.
    from torchtitan_ext.stability.guard import find_checkpoints

    assert find_checkpoints(ckpt) == [2]


def _agree_worker(rank: int, world: int, port: int, errors: list) -> tuple:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        comm = Collectives(dist.new_group(backend="gloo"))
        return rank, comm.agree(errors[rank]), comm.agree(None)
    finally:
        dist.destroy_process_group()


def test_all_ranks_agree_on_failure_reasons():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    errors = ["z: disk full", None, "a: other"]
    results = sorted(children.call(_agree_worker, 3, port, errors, nprocs=3))
    assert [r[0] for r in results] == [0, 1, 2]
    for _, failed, succeeded in results:  # the same sorted distinct reasons on every rank
        assert failed == ["a: other", "z: disk full"] and succeeded == []


class _Loader:
    """A data loader's checkpoint interface: per-rank state, merged over ranks, restored globally."""

    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    @staticmethod
    def merge_states(states):
        return {"position": states[0]["position"]}

    def load_global_state(self, state):
        self.position = state["position"]


class _Callbacks:
    def __init__(self):
        self.state = {"skips": 0}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, sd):
        self.state = dict(sd)


def _components(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model_parts": [model], "optimizer": optimizer, "train_state": TrainState(), "data_loader": _Loader(),
            "callbacks": _Callbacks(), "device": torch.device("cpu")}


def test_manager_over_explicit_components(tmp_path):
    config = load_config(["--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--training.steps", "10",
                          "--checkpoint.interval", "5"], env={})
    parts = _components(0)
    model, optimizer = parts["model_parts"][0], parts["optimizer"]
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    parts["train_state"].step, parts["train_state"].tokens_seen = 5, 640
    parts["data_loader"].position, parts["callbacks"].state = 17, {"skips": 2}
    manager = CheckpointManager(config, **parts)
    manager.maybe_save(5)
    assert manager.saves == 1 and manager.metrics() == {"checkpoint_failures": 0}
    assert [(c.step, c.kind) for c in scan_folder(tmp_path / "checkpoint")] == [(5, "full")]

    fresh = _components(1)
    resumed = CheckpointManager(config, **fresh)
    resumed.load()
    assert resumed.loaded_step == 5 and fresh["train_state"].resumed_from_step == 5
    assert fresh["train_state"].tokens_seen == 640 and fresh["data_loader"].position == 17
    assert fresh["callbacks"].state == {"skips": 2}
    assert torch.equal(fresh["model_parts"][0].weight, model.weight)
    saved = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(fresh["optimizer"].state_dict()["state"][0]["exp_avg"], saved)


class _GroupLoader(_Loader):
    """A replica group's loader: its merged state holds only its own shards (as TrainLoader's does under
    fault tolerance) and the job's sequence count."""

    def __init__(self, shards):
        super().__init__()
        self.shards, self.loaded = shards, None

    def merge_states(self, states):
        return {"kind": "global", "num_shards": 4, "fingerprint": {"data": "same"}, "sequences": self.position,
                "shards": {str(j): {"at": self.position} for j in self.shards}}

    def load_global_state(self, state):
        self.loaded = state


def test_fault_tolerant_job_checkpoint(tmp_path):
    """One checkpoint for the job (written by the group told so: the lowest taking part), each replica
    group's data state in its own folder; a group resumes with its own newest data state, a run without
    fault tolerance with the union of every group's of that step, and refuses a step some group missed."""
    from trainer.checkpoint.replicas import ReplicaGroup
    from trainer.errors import CheckpointError

    config = load_config(["--job.dump_folder", str(tmp_path / "replica_x"), "--checkpoint.enable",
                          "--training.steps", "20", "--checkpoint.interval", "5"], env={})
    groups = []
    for g in (0, 1):
        parts = _components(g)
        parts["data_loader"] = _GroupLoader(shards=(g, g + 2))
        groups.append((parts, CheckpointManager(config, **parts, replica=ReplicaGroup(g, 2, str(tmp_path),
                                                                                    lambda g=g: g == 0))))
    for step in (5, 10):
        for g, (parts, manager) in enumerate(groups):
            if step == 10 and g == 1:
                continue  # group 1 is down at step 10
            parts["train_state"].step = parts["data_loader"].position = step
            manager.maybe_save(step)
    ckpt = tmp_path / "checkpoint"  # the job's folder, not the group's dump folder
    job = scan_folder(ckpt)
    assert [(c.step, c.kind, c.marker.get("replica_groups")) for c in job] == [(5, "full", 2), (10, "full", 2)]
    assert not any((c.path / "dataloader.json").exists() for c in job)
    assert [c.step for c in scan_folder(ckpt / "replica_0")] == [5, 10]
    assert [(c.step, c.kind) for c in scan_folder(ckpt / "replica_1")] == [(5, "data")]

    # Group 1 started again: the job's step-10 weights, its own data state of step 5 (nothing skipped).
    parts = _components(3)
    parts["data_loader"] = _GroupLoader(shards=(1, 3))
    manager = CheckpointManager(config, **parts, replica=ReplicaGroup(1, 2, str(tmp_path), lambda: False))
    manager.load()
    assert manager.loaded_step == 10 and parts["train_state"].step == 10
    assert torch.equal(parts["model_parts"][0].weight, groups[0][0]["model_parts"][0].weight)
    assert parts["data_loader"].loaded["shards"] == {"1": {"at": 5}, "3": {"at": 5}}

    # Both at step 15: group 1's part of the stream is 5 steps behind for good.
    groups[1] = (parts, manager)
    for g, (parts, manager) in enumerate(groups):
        parts["train_state"].step, parts["data_loader"].position = 15, 15 - 5 * g
        manager.maybe_save(15)

    # Without fault tolerance: step 15's data states are at different positions, step 10 lacks group 1's
    # (one line each, naming the cause and the fix); step 5 has the union.
    plain = load_config(["--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--training.steps", "20"], env={})
    parts = _components(4)
    parts["data_loader"] = _GroupLoader(shards=())
    with pytest.raises(CheckpointError, match=r"step 15 are at different positions \(\[10, 15\] sequences\)"):
        CheckpointManager(plain, **parts).load()
    plain.checkpoint.load_step = 10
    with pytest.raises(CheckpointError, match=r"replica group\(s\) \[1\] saved no data state at step 10"):
        CheckpointManager(plain, **parts).load()
    plain.checkpoint.load_step = 5
    manager = CheckpointManager(plain, **parts)
    manager.load()
    assert manager.loaded_step == 5
    assert parts["data_loader"].loaded["shards"] == {str(j): {"at": 5} for j in range(4)}
    assert parts["data_loader"].loaded["sequences"] == 5


def _async_config(tmp_path):
    return load_config(["--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--training.steps", "10",
                        "--checkpoint.interval", "5", "--checkpoint.async_mode", "async",
                        "--checkpoint.max_failed_saves", "3"], env={})


def _train_step(model, optimizer):
    model(torch.randn(2, 4, device=model.weight.device)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_stage_copy_copies_every_tensor_once():
    from trainer.checkpoint.background import stage_copy

    t, u = torch.arange(6.0).view(2, 3), torch.ones(2)
    state = {"a": t, "b": [t, (u, 3)], "c": b"pickled", "d": {"lr": 0.5}}
    staged = stage_copy(state)
    assert staged["a"] is staged["b"][0] and staged["a"].data_ptr() != t.data_ptr()  # one copy of t
    assert torch.equal(staged["a"], t) and torch.equal(staged["b"][1][0], u) and staged["b"][1][1] == 3
    assert staged["d"] == {"lr": 0.5} and staged["d"] is not state["d"] and staged["c"] is state["c"]
    t.add_(1.0)
    assert torch.equal(staged["a"], torch.arange(6.0).view(2, 3))


def test_async_save_commits_the_state_of_its_step(tmp_path, monkeypatch):
    """The save call returns before the state is copied (the copy runs on the save's own thread); the next
    optimizer step waits for the copy; the committed checkpoint is the state of the save's step, bitwise,
    though training changed the weights and moments while it was written."""
    import threading

    from trainer.checkpoint import background

    config = _async_config(tmp_path)
    parts = _components(0)
    model, optimizer = parts["model_parts"][0], parts["optimizer"]
    _train_step(model, optimizer)
    manager = CheckpointManager(config, **parts)
    gate, copy = threading.Event(), background.stage_copy

    def gated_copy(state, memo=None):
        gate.wait(10.0)  # a copy inside the call would make the call itself wait here
        return copy(state, memo)

    monkeypatch.setattr(background, "stage_copy", gated_copy)
    parts["train_state"].step = 5
    weight, moment = model.weight.detach().clone(), optimizer.state[model.weight]["exp_avg"].clone()
    assert manager.save(5, asynchronous=True)
    assert manager.pending is not None and not manager.pending.staging.done()  # nothing copied in the call
    threading.Timer(0.2, gate.set).start()
    _train_step(model, optimizer)  # its pre-step hook waits for the copy
    with torch.no_grad():
        model.weight.add_(1.0)  # during the background write
    manager.pending.upload.result()
    # Committed by the save's own thread (marker written last, folder renamed) before the loop polls it.
    assert [(c.step, c.status) for c in scan_folder(tmp_path / "checkpoint")] == [(5, "complete")]
    manager.finish()
    assert manager.saves == 1 and manager.failures == 0
    fresh = _components(1)
    resumed = CheckpointManager(config, **fresh)
    resumed.load()
    assert resumed.loaded_step == 5
    assert torch.equal(fresh["model_parts"][0].weight, weight) and not torch.equal(model.weight, weight)
    assert torch.equal(fresh["optimizer"].state_dict()["state"][0]["exp_avg"], moment)


@pytest.mark.parametrize("broken", ["write_sidecar", "commit"])
def test_failed_background_write_is_counted_and_nothing_committed(tmp_path, monkeypatch, broken):
    """The data-loader state file and the commit of an asynchronous save are written on the save's thread:
    a failure there fails the save when it is polled (counted, the temporary folder removed); a
    synchronous save fails likewise."""
    from trainer.checkpoint import saving

    def fail(*args):
        raise OSError("disk gone")

    monkeypatch.setattr(saving, broken, fail)
    parts = _components(0)
    _train_step(parts["model_parts"][0], parts["optimizer"])
    manager = CheckpointManager(_async_config(tmp_path), **parts)
    assert manager.save(5, asynchronous=True)  # started; the failure comes from the background
    manager.finish()
    assert manager.failures == 1 and manager.saves == 0
    assert scan_folder(tmp_path / "checkpoint") == [] and not (tmp_path / "checkpoint" / "step-5.tmp").exists()
    assert not manager.save(6)
    assert manager.failures == 2 and scan_folder(tmp_path / "checkpoint") == []


def test_space_check_scans_the_folder_only_when_a_save_may_not_fit(tmp_path, monkeypatch, caplog):
    """The warning that the next saves will not fit counts the committed checkpoints (a folder scan); with
    room for every save it looks ahead to, the check does not scan (it runs in every save's blocking part)."""
    import logging
    from types import SimpleNamespace

    from trainer.checkpoint.space import DiskSpace

    mib = 1 << 20
    cfg = SimpleNamespace(keep_latest_k=0, interval=5, drill_disk_bytes=100 * mib)
    space = DiskSpace(cfg, tmp_path / "checkpoint")
    scans = []
    monkeypatch.setattr(DiskSpace, "committed_count", lambda self: scans.append(1) or 0)
    logger = logging.getLogger("trainer")  # the run's logger may not propagate to caplog's root handler
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="trainer"):
            assert space.check(1, 10 * mib, warn=True) is None
            assert scans == [] and "running out" not in caplog.text
            assert space.check(2, 40 * mib, warn=True) is None  # two fit, not three
            assert scans == [1] and "only the next 2 save(s) will fit" in caplog.text
    finally:
        logger.removeHandler(caplog.handler)
    assert "not enough disk space" in space.check(3, 120 * mib, warn=True)


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_reused_staging_async_saves_commit_the_state_of_their_step(tmp_path, monkeypatch, caplog, device):
    """async_with_pinned_mem: the same background path, staged into buffers allocated at
    the first save and reused by the next (pinned on CUDA; ordinary memory on a CPU-only machine, which the
    run says at start); each committed checkpoint is the state of its step, bitwise, though the weights
    changed while it was written."""
    import logging

    from trainer.checkpoint.background import ReusedStaging

    config = load_config(["--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--training.steps", "10",
                          "--checkpoint.interval", "5", "--checkpoint.async_mode", "async_with_pinned_mem"], env={})
    parts = _components(0)
    model = parts["model_parts"][0].to(device)
    parts["optimizer"] = optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    parts["device"] = torch.device(device)
    buffers, stage = [], ReusedStaging.stage

    def recorded(self, state):  # the real copy; what it returns is recorded
        staged = stage(self, state)
        buffers.append((self.pinned, [(t.data_ptr(), t.is_pinned()) for t in _tensors(
            {k: staged[k] for k in ("model", "optimizer")}) if t.numel() > 1]))  # not the step counters
        return staged

    monkeypatch.setattr(ReusedStaging, "stage", recorded)
    logger = logging.getLogger("trainer")  # the run's logger may not propagate to caplog's root handler
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="trainer"):
            manager = CheckpointManager(config, **parts)
    finally:
        logger.removeHandler(caplog.handler)
    said = {r.getMessage() for r in caplog.records if "async_with_pinned_mem" in r.getMessage()}
    assert said == (set() if device == "cuda" else {
        "checkpoint.async_mode async_with_pinned_mem: pinned memory needs CUDA; the staging buffers are ordinary "
        "CPU memory on this machine, still reused from save to save"})
    saved = {}
    for step in (5, 10):
        _train_step(model, optimizer)
        parts["train_state"].step = step
        saved[step] = model.weight.detach().cpu().clone()
        assert manager.save(step, asynchronous=True)
        _train_step(model, optimizer)  # its pre-step hook waits for the copy
        with torch.no_grad():
            model.weight.add_(1.0)  # during the background write
        manager.maybe_save(step + 1)  # a step boundary: the save, ended, is agreed here
        assert manager.pending is None or not manager.pending.done
    manager.finish()
    assert manager.saves == 2 and manager.failures == 0
    # The second save copied into the first one's buffers (pinned on CUDA), none of them the live tensors.
    (pinned, first), (_, second) = buffers
    live = {t.data_ptr() for t in _tensors({"m": model.state_dict(), "o": optimizer.state_dict()})}
    assert pinned == (device == "cuda") and first == second and len(first) >= 4
    assert all(is_pinned == pinned for _, is_pinned in first) and not live & {ptr for ptr, _ in first}
    for step in (5, 10):
        config.checkpoint.load_step = step
        fresh = _components(1)
        fresh["model_parts"][0].to(device)
        fresh["optimizer"] = torch.optim.AdamW(fresh["model_parts"][0].parameters(), lr=1e-3)
        fresh["device"] = torch.device(device)
        resumed = CheckpointManager(config, **fresh)
        resumed.load()
        assert resumed.loaded_step == step
        assert torch.equal(fresh["model_parts"][0].weight.cpu(), saved[step])
