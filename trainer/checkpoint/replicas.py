"""The checkpoints of a fault-tolerant job: one checkpoint for the whole job, each replica group its data.

Under the job's checkpoint folder (``<job.dump_folder>/<checkpoint.folder>/``, shared by every group)::

    step-40/                  the job's checkpoint of step 40: model, optimizer, counters, as any run's;
                              written by the lowest replica group that took part in step 40. Its marker
                              says ``replica_groups`` (how many groups the job has) instead of holding a
                              data-loader state: each group's is in its own folder
    replica_0/step-40/        replica group 0's part of the data stream at step 40: ``dataloader.json`` and
    replica_1/step-40/        the commit marker (kind "data"), written by each group at every save step

A group resuming (a restarted group, or the whole job started again) loads the job's newest checkpoint
and its own newest data state at or before that step: a group that was down at step 40 goes on from where
its part of the stream stopped, so none of its documents is skipped. A run without
``[fault_tolerance]`` loads the same ``step-N`` folder (nothing of it needs torchft) with the union of every
group's data state of that step: the stream's state an HSDP job with the same data-parallel ranks would
have saved. After a group missed steps its part of the stream is behind the others' for good, which one
loader state cannot express: such a run is told so, and resumes with ``[fault_tolerance]`` or without the
data state.

Nothing here needs a process group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoint.layout import DATA_ONLY, CheckpointInfo, scan_folder
from trainer.checkpoint.state import read_loader_file
from trainer.errors import CheckpointError


@dataclass
class ReplicaGroup:
    """This process's replica group, as the checkpoint manager sees it: ``job_dump_folder`` is the job's
    (the group's own outputs are in a folder under it); ``saves_job_checkpoint()`` says whether this group
    writes the job's checkpoint of the step just taken (it is the lowest group taking part)."""

    replica_id: int
    group_size: int
    job_dump_folder: str
    saves_job_checkpoint: Callable[[], bool]

    def folder(self, checkpoint_folder: Path) -> Path:
        return replica_folder(checkpoint_folder, self.replica_id)


def replica_folder(checkpoint_folder: Path, replica_id: int) -> Path:
    return Path(checkpoint_folder) / f"replica_{replica_id}"


def read_data_state(info: CheckpointInfo) -> dict:
    """The data-loader state a data checkpoint holds."""
    name = info.marker.get("dataloader")
    if not name:
        raise CheckpointError(f"{info.path}: its commit marker names no data-loader state")
    return read_loader_file(info.path / name)


def group_data_state(checkpoint_folder: Path, replica_id: int, step: int) -> CheckpointInfo | None:
    """Replica group ``replica_id``'s newest complete data checkpoint at or before ``step`` (None: none)."""
    found = [c for c in scan_folder(replica_folder(checkpoint_folder, replica_id))
             if c.complete and c.kind == DATA_ONLY and c.step <= step]
    return found[-1] if found else None


def union_states(states: list[dict], step: int) -> dict:
    """One global data state from the replica groups' states of one step: each holds the shards of its own
    data-parallel ranks and the job's sequence count, so the union is what one HSDP job would have saved,
    as long as every group's part of the stream is at the same position (no group ever missed a step)."""
    if not states:
        raise CheckpointError("no replica group's data state to merge")
    first = states[0]
    if any(s.get("num_shards") != first.get("num_shards") or s.get("fingerprint") != first.get("fingerprint")
           for s in states):
        raise CheckpointError(f"the replica groups' data states of step {step} are of different data (fingerprint "
                              "or data.num_shards)")
    positions = sorted({int(s["sequences"]) for s in states})
    if len(positions) > 1:
        raise CheckpointError(
            f"the replica groups' data states of step {step} are at different positions ({positions} sequences): a "
            "group that missed steps goes on from where its part of the stream stopped, which one loader state "
            "cannot say. Resume it with [fault_tolerance], or add 'dataloader' to checkpoint.exclude_from_loading "
            "to start the data afresh")
    shards: dict = {}
    for s in states:
        overlap = set(shards) & set(s["shards"])
        if overlap:
            raise CheckpointError(f"two replica groups' data states of step {step} hold the same shards "
                                  f"({sorted(overlap)[:4]})")
        shards.update(s["shards"])
    return {**first, "shards": shards}


def job_data_state(checkpoint_folder: Path, step: int, group_size: int) -> dict:
    """For a run without fault tolerance loading a job checkpoint: every group's data state of ``step``,
    merged. A group that has none at that step (it was down) makes the stream's position unknowable."""
    states, missing = [], []
    for g in range(group_size):
        info = group_data_state(checkpoint_folder, g, step)
        if info is None or info.step != step:
            missing.append(g)
        else:
            states.append(read_data_state(info))
    if missing:
        raise CheckpointError(
            f"step-{step} is a fault-tolerant job's checkpoint and replica group(s) {missing} saved no data state "
            f"at step {step} (in {replica_folder(checkpoint_folder, missing[0])}): resume it with "
            "[fault_tolerance] (each group continues its own part of the stream), or add 'dataloader' to "
            "checkpoint.exclude_from_loading to start the data afresh")
    return union_states(states, step)
