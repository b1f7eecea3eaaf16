"""[fault_tolerance]: replica groups over torchft, with a real lighthouse (`trainer lighthouse`) and each group
launched as users do (run_train.sh with its fault_tolerance.replica_id), on CPU over gloo. Each test costs
two launches, so there are few: groups of 2 processes (FSDP inside each group) throughout.

- Without a fault, two groups train as one job: their losses are plain HSDP's on the same global batch
  and their final weights are bitwise equal.
- kill -9 of group 1 mid-run: group 0 keeps stepping while it is down; group 1 started again loads the job's
  checkpoint (written by the lowest live group) with its own data state, then takes the live group's newer
  state (torchft's recovery) and both finish with bitwise-equal weights.
- DiLoCo: the groups step on their own and synchronise every sync_steps steps.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.batches import spec
from trainer.checkpoint.integrity import verify_files
from trainer.checkpoint.layout import scan_folder
from trainer.checkpoint.replicas import group_data_state, job_data_state, read_data_state
from trainer.errors import CheckpointError
from tests.support.launch import start_train, train_in_process
from tests.support.parity import IN_TRAINING_EVAL, STEPS, relative_diffs
from tests.support.processes import QUICK_S, free_port, kill_tree, popen, wait_for

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

# Plain HSDP, 2 replicas x 2 FSDP ranks: the run tests/distributed/test_parallel.py declares as layout_hsdp2x2
# (with its in-training evaluation, which leaves the losses as they are).
HSDP = spec("layout_hsdp2x2", 4, *STEPS, "--training.local_batch_size", "2",
            "--parallelism.data_parallel_replicate_degree", "2", *IN_TRAINING_EVAL)


def lighthouse(folder: Path, min_replicas: int) -> tuple[subprocess.Popen, str]:
    """`trainer lighthouse` on a free port; returns it and its address (TORCHFT_LIGHTHOUSE)."""
    port = free_port()
    log = folder / f"lighthouse_{port}.log"
    with open(log, "w") as out:
        proc = popen([sys.executable, "-m", "trainer.cli", "lighthouse", "--port", str(port), "--min_replicas",
                      str(min_replicas), "--heartbeat_timeout_ms", "1000", "--join_timeout_ms", "2000"],
                     stdout=out, stderr=subprocess.STDOUT)

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for(listening, "the lighthouse to listen", timeout=QUICK_S, proc=proc, log=log)
    assert log.read_text().startswith("export TORCHFT_LIGHTHOUSE=http://")
    return proc, f"http://localhost:{port}"


def start_group(dump: Path, replica_id: int, address: str, *args: str, nproc: int = 1) -> subprocess.Popen:
    return start_train(dump, "--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
                       "--fault_tolerance.replica_id", str(replica_id), *args, nproc=nproc,
                       env={"TORCHFT_LIGHTHOUSE": address}, log=dump.parent / f"group{replica_id}.log")


def records(dump: Path, replica_id: int) -> list[dict]:
    path = dump / f"replica_{replica_id}" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def last_step(dump: Path, replica_id: int) -> int:
    return max((r["step"] for r in records(dump, replica_id)), default=0)


def summary(dump: Path, replica_id: int) -> dict:
    return json.loads((dump / f"replica_{replica_id}" / "summary.json").read_text())


def finish(procs: list[subprocess.Popen], dump: Path, timeout: float = 600) -> None:
    for r, proc in enumerate(procs):
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        log = (dump.parent / f"group{r}.log").read_text(errors="replace")[-5000:]
        assert rc == 0, f"group {r} ended with {rc}:\n{log}"


@pytest.mark.runs(HSDP)
def test_two_groups_without_a_fault_train_as_plain_hsdp(tmp_path, batches, monkeypatch):
    """2 groups of 2 processes (FSDP inside each group) against plain HSDP 2 x 2 on the same global batch;
    then a run without fault tolerance, on one process, resumes from the job's checkpoint."""
    lh, address = lighthouse(tmp_path, min_replicas=2)  # both groups in every quorum, from the first step
    dump = tmp_path / "job"
    try:
        procs = [start_group(dump, r, address, *STEPS, "--training.local_batch_size", "2", "--checkpoint.enable",
                             nproc=2) for r in (0, 1)]
        finish(procs, dump)
    finally:
        kill_tree(lh)
    by_group = [{r["step"]: r for r in records(dump, g)} for g in (0, 1)]
    assert [r["replica_groups"] for r in by_group[0].values()] == [2] * 5
    assert {s: r["loss"] for s, r in by_group[0].items()} == {s: r["loss"] for s, r in by_group[1].items()}
    diffs = relative_diffs({s: r["loss"] for s, r in by_group[0].items()}, batches.get(HSDP).losses())
    assert max(diffs) <= 1e-5, diffs
    s0, s1 = summary(dump, 0), summary(dump, 1)
    assert s0["weights_sha256"] == s1["weights_sha256"] is not None
    assert s0["fault_tolerance"]["faults_survived"] == 0 and s0["fault_tolerance"]["recoveries"] == []
    assert s0["tokens_seen"] == batches.get(HSDP).records()[5]["tokens_seen"]
    # The job's checkpoint of step 5 (group 0's) and both groups' data states of step 5, at one position: a
    # run without fault tolerance (no torchft, one process) resumes from them, data included.
    ckpt = dump / "checkpoint"
    (job,) = [c for c in scan_folder(ckpt) if c.complete and not c.final]
    assert job.step == 5 and job.marker["replica_groups"] == 2
    parts = [read_data_state(group_data_state(ckpt, g, 5))["shards"] for g in (0, 1)]
    # group g's data-parallel ranks are 2g and 2g + 1 of 4: they read the shards j with j % 4 // 2 == g
    assert all(parts) and all(int(j) % 4 // 2 == g for g in (0, 1) for j in parts[g])
    assert job_data_state(ckpt, 5, 2)["shards"] == {**parts[0], **parts[1]}
    rc, out = train_in_process(dump, *STEPS[2:], "--training.steps", "6", "--checkpoint.enable", monkeypatch=monkeypatch)
    assert rc == 0 and " loaded in " in out and "not restored" not in out, out[-3000:]
    resumed = json.loads((dump / "summary.json").read_text())
    assert resumed["start_step"] == 5 and resumed["tokens_seen"] == s0["tokens_seen"] * 6 // 5


def test_a_killed_group_rejoins_from_a_live_group(tmp_path, nproc=2):
    """2 groups of 2 processes (FSDP inside each: the live group sends its shards and optimizer state shard by
    shard); groups of 1 process (plain tensors) take the same path with nproc=1. The job has one checkpoint
    folder: the lowest live group writes step-N, each group its data state; group 1 started again loads the
    job's newest checkpoint (group 0 held stopped, past it), then takes group 0's newer state."""
    lh, address = lighthouse(tmp_path, min_replicas=1)
    dump = tmp_path / "job"
    args = ("--training.steps", "30", "--fault_tolerance.process_group_timeout_ms", "5000", "--checkpoint.enable",
            "--checkpoint.interval", "5")
    env_log = dump.parent / "group1.log"
    try:
        procs = [start_group(dump, r, address, *args, nproc=nproc) for r in (0, 1)]
        wait_for(lambda: any(r["replica_groups"] == 2 for r in records(dump, 0) if r["step"] >= 6),
                 "both groups stepping together", proc=procs[0], log=dump.parent / "group0.log")
        kill_tree(procs[1])  # kill -9 of the whole group: launcher and worker
        at_kill = last_step(dump, 0)
        wait_for(lambda: last_step(dump, 0) >= at_kill + 3, "group 0 stepping while group 1 is down",
                 proc=procs[0], log=dump.parent / "group0.log")
        alone = [r for r in records(dump, 0) if r["step"] > at_kill]
        assert all(r["replica_groups"] == 1 for r in alone[1:]), alone
        # Group 0 waits (stopped) while group 1 starts again and loads the job's checkpoint, so that it cannot
        # finish first on a busy machine and is past that checkpoint (stopped after a step that saves none: a
        # checkpoint is saved after its step's record); it goes on before group 1 asks for its first quorum.
        kill_tree(procs[0], signal.SIGSTOP)
        while last_step(dump, 0) % 5 == 0:
            kill_tree(procs[0], signal.SIGCONT)
            at = last_step(dump, 0)
            wait_for(lambda: last_step(dump, 0) > at, "group 0 stepping", proc=procs[0], log=dump.parent / "group0.log")
            kill_tree(procs[0], signal.SIGSTOP)
        stopped_at = last_step(dump, 0)
        try:
            procs[1] = start_group(dump, 1, address, *args, nproc=nproc)
            wait_for(lambda: env_log.exists() and " loaded in " in env_log.read_text(),
                     "group 1 loading the job's checkpoint", proc=procs[1], log=env_log)
        finally:
            kill_tree(procs[0], signal.SIGCONT)
        finish(procs, dump)
    finally:
        kill_tree(lh)
    s0, s1 = summary(dump, 0), summary(dump, 1)
    assert s0["status"] == s1["status"] == "completed"
    assert s0["weights_sha256"] == s1["weights_sha256"] is not None
    assert s0["fault_tolerance"]["faults_survived"] >= 1
    # One checkpoint folder for the job: full checkpoints of every interval (no group was the lowest but
    # group 0), each group's data states beside them; nothing under the groups' own folders.
    ckpt = dump / "checkpoint"
    job = [c for c in scan_folder(ckpt) if c.complete and not c.final]
    assert [c.step for c in job] == [5, 10, 15, 20, 25, 30] and {c.marker["replica_groups"] for c in job} == {2}
    assert not (dump / "replica_0" / "checkpoint").exists() and not (dump / "replica_1" / "checkpoint").exists()
    data = [[c.step for c in scan_folder(ckpt / f"replica_{g}") if c.complete and c.kind == "data"] for g in (0, 1)]
    assert data[0] == [5, 10, 15, 20, 25, 30] and data[1][-1] == 30
    # Group 1 started again from the job's newest checkpoint when group 0 stopped, with its own newest data
    # state at or before it (saved before it was killed), then took group 0's newer state.
    loaded = stopped_at // 5 * 5
    resumed_data = max(s for s in data[1] if s <= loaded)
    assert s1["start_step"] == loaded and resumed_data <= at_kill
    if resumed_data < loaded:
        assert f"replica group 1's newest data state is of step {resumed_data}" in env_log.read_text()
    (recovery,) = s1["fault_tolerance"]["recoveries"]  # from the live group, at its step
    assert recovery["from_step"] == loaded and recovery["step"] > stopped_at
    assert s1["fault_tolerance"]["steps_missed"] == recovery["step"] - 1 - loaded
    assert recovery["step"] in {r["step"] for r in records(dump, 1)}
    # What the groups print: the recovery at the step it joins at (as summary.json); a step a group failed
    # in is repeated, not counted as skipped (nor carried to the group that recovers); no torchft noise.
    logs = [(dump.parent / f"group{g}.log").read_text(errors="replace") for g in (0, 1)]
    assert f"it joins at step {recovery['step']} " in logs[1], logs[1][-3000:]
    assert s0["skipped_steps"] == s1["skipped_steps"] == 0, (s0["skipped_steps"], s1["skipped_steps"])
    assert "skipped (None)" not in logs[0]
    if s0["fault_tolerance"]["uncommitted_steps"]:  # group 1 was killed inside a step
        assert "skipped (not committed: a replica group failed during it; repeated)" in logs[0]
    for text in logs:
        assert "buffer is not writable" not in text and "Unable to reset NCCL flight recorder" not in text
        assert "GET /checkpoint/" not in text
    # Every file verifies. Group 1's part of the stream is behind group 0's for good (it missed steps, and
    # step 1 too: group 0 began alone), which one loader state cannot say: a run without fault tolerance
    # is told so (the test without a fault resumes such a run).
    assert all(verify_files(c.path, c.marker) is None for c in job)
    with pytest.raises(CheckpointError, match="step 30 are at different positions"):
        job_data_state(ckpt, 30, 2)


def test_diloco_groups_synchronise_every_sync_steps(tmp_path):
    """torchft's DiLoCo (the method of torchtitan's llama3_ft preset); LocalSGD is the same hook with a plain
    average. One fragment, so that every parameter is synchronised at step 8, the last."""
    lh, address = lighthouse(tmp_path, min_replicas=2)
    dump = tmp_path / "job"
    try:
        procs = [start_group(dump, r, address, "--training.steps", "8", "--fault_tolerance.semi_sync_method",
                             "diloco", "--fault_tolerance.sync_steps", "4") for r in (0, 1)]
        finish(procs, dump)
    finally:
        kill_tree(lh)
    by_group = [{r["step"]: r for r in records(dump, g)} for g in (0, 1)]
    assert all(by_group[g][8]["replica_groups"] == 2 for g in (0, 1))
    assert by_group[0][8]["loss"] != by_group[1][8]["loss"]  # each group steps on its own part of the data
    assert summary(dump, 0)["weights_sha256"] == summary(dump, 1)["weights_sha256"]
    for g in (0, 1):  # each group said once which outer optimizer it uses
        log = (tmp_path / f"group{g}.log").read_text()
        assert log.count("outer optimizer SGD lr 0.7, momentum 0.9, Nesterov (the default") == 1, log[-3000:]
