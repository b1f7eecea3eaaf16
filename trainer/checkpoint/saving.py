"""Saving: write a checkpoint with DCP (synchronously or in the background), commit it, keep the latest.

A save is atomic: every rank writes into ``step-N.tmp``, the ranks agree that all of them succeeded,
then rank 0 writes the commit marker (every file's size and checksum, hashed while it was written) and
renames the folder to ``step-N``. A failed (or refused) save is reported with every rank's reason,
cleaned up and counted; the run stops after ``checkpoint.max_failed_saves`` in a row.

A background save (``checkpoint.async_mode``) runs on a thread of its own
(:mod:`trainer.checkpoint.background`), which also commits it; its outcome (saved, or failed and
counted) is agreed by the ranks at a step boundary, as a synchronous save's is: at every step boundary
while it runs the ranks share (one small all-reduce) whether it failed on any of them or has ended on
all, and agree on its outcome at the first boundary where either holds; at the latest at the next save
step (before that step's save starts), the end of training, or a stop on a signal. A failure on one rank
thus stops the run (at ``max_failed_saves``) at the step boundary after the failure, on every rank: a
failed write fails DCP's save on every rank, and a rank whose copy failed still takes part in DCP's
collectives (failing them while planning), so no rank waits for another until ``timeout_seconds``.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.agree import ERRORS, Collectives, attempt, format_exception
from trainer.checkpoint.background import BackgroundSave, FreshStaging, ReusedStaging, SaveTarget, Staging
from trainer.checkpoint.layout import (
    DATA_ONLY,
    DATALOADER_JSON,
    DATALOADER_PT,
    FORMAT_VERSION,
    RESUMABLE_KINDS,
    TMP_SUFFIX,
    commit,
    human_bytes,
    scan_folder,
    step_dirname,
    write_file_atomic,
)
from trainer.checkpoint.space import DiskSpace
from trainer.checkpoint.state import (
    EXPORT_DTYPES,
    Components,
    estimate_checkpoint_bytes,
    merge_loader_states,
    pickle_bytes,
)
from trainer.checkpoint.writer import new_writer
from trainer.errors import CheckpointError

logger = logging.getLogger("trainer")


def write_sidecar(tmp: Path, sidecar: tuple[str, bytes]) -> None:
    """Write the data-loader state file (name, bytes) into the checkpoint's temporary folder, durably."""
    tmp.mkdir(parents=True, exist_ok=True)
    write_file_atomic(tmp / sidecar[0], sidecar[1])


class Saver:
    """Writes, commits and retains the checkpoints of ``components`` in ``folder`` (all ranks call every
    method together), one save at a time. ``async_pg`` is the process group of background saves (None:
    synchronous only). ``replica_groups``: in a fault-tolerant job, how many replica groups it has; its
    full checkpoints then hold no data-loader state (each group saves its own:
    :mod:`trainer.checkpoint.replicas`)."""

    def __init__(self, cfg, folder: Path, components: Components, comm: Collectives, async_pg: Any = None,
                 replica_groups: int | None = None):
        self.cfg = cfg
        self.replica_groups = replica_groups
        self.folder = folder
        self.components = components
        self.comm = comm
        self.async_pg = async_pg
        self.space = DiskSpace(cfg, folder)
        self.failures = 0  # failed saves in this run (metrics: checkpoint_failures)
        self.consecutive_failures = 0
        self.saves = 0
        self.pending: BackgroundSave | None = None  # the background save whose outcome is not agreed yet
        self._committed_steps: set[int] = set()  # full checkpoints committed (or verified on load) by this run
        self._resumed_steps: set[int] = set()  # the checkpoint this launch resumed from (verified on load)
        self._damaged_steps: set[int] = set()  # checkpoints the loader could not load: never deleted
        self._staging: Staging | None = None  # kept from save to save (async_with_pinned_mem: reused buffers)

    def due(self, step: int, last: bool = False) -> bool:
        """Whether ``step`` is a save step: every ``checkpoint.interval`` steps and the last step."""
        return last or step % self.cfg.interval == 0

    def has_committed(self, step: int) -> bool:
        """Whether this run holds a committed checkpoint of ``step`` (saved by it, or resumed from)."""
        return step in self._committed_steps

    def note_loaded(self, loaded_step: int | None, verified: bool, damaged: set[int]) -> None:
        """What the load of this launch found: the checkpoint it resumed from (when ``verified``, it counts
        for ``keep_latest_k`` like one this run committed) and the ``damaged`` ones it could not load,
        which may hold intact weights and are never deleted."""
        if loaded_step is not None and verified:
            self._committed_steps.add(loaded_step)
            self._resumed_steps.add(loaded_step)
        self._damaged_steps |= damaged

    def maybe_save(self, step: int, last: bool = False, write: bool = True) -> None:
        """After every optimizer step, at a save step (every ``checkpoint.interval`` steps and the last
        step): agree on the outcome of the background save in flight, then save (unless not ``write``:
        another replica group writes the job's checkpoint of this step)."""
        if not self.due(step, last):
            if self.pending is not None:
                self.poll(step)
            return
        if self.pending is not None:
            self.join(step)
        if not write:
            return
        if last:
            # The last step's save is always full (a longer run continues from it exactly); the model-only
            # export is an addition under its own name, so no run overwrites another run's final save.
            self.save(step, kind="full", asynchronous=False)
            if self.cfg.last_save_model_only:
                self.save(step, kind="model_only", dtype=EXPORT_DTYPES[self.cfg.export_dtype], asynchronous=False,
                          final=True)
        else:
            self.save(step, kind="full", asynchronous=self.cfg.async_mode != "disabled")

    def finish(self) -> None:
        """End of training (or a stop): wait for the background save, agree on its outcome, free the
        staging buffers."""
        if self.pending is not None:
            self.join()
        if self._staging is not None:
            attempt("closing the checkpoint staging buffers", self._staging.close)
            self._staging = None

    def save(self, step: int, kind: str = "full", dtype: torch.dtype | None = None, asynchronous: bool = False,
             final: bool = False) -> bool:
        """Save ``step`` (all ranks), after agreeing on the outcome of a background save still in flight.
        Returns whether it was committed (a synchronous save) or started (an asynchronous one). Failures
        are counted and raise :class:`CheckpointError` once ``checkpoint.max_failed_saves`` happen in a
        row."""
        import torch.distributed.checkpoint as dcp

        if self.pending is not None:
            self.join()
        target = SaveTarget(step, self.folder / step_dirname(step, TMP_SUFFIX, final=final),
                            self.folder / step_dirname(step, final=final), {}, time.perf_counter())
        if kind == DATA_ONLY:
            return self._save_data(target)
        model_only = kind != "full"
        state = self.components.snapshot(step, self.comm.rank, model_only, dtype)
        # Every rank counts its entries at their global sizes; ranks of one pipeline stage count the same
        # ones, so the sum over ranks divided by the ranks per stage is the whole checkpoint.
        nbytes = self.comm.sum([estimate_checkpoint_bytes(state)])[0] * self.components.pp_degree // self.comm.world
        reasons = self.comm.agree(self._prepare(step, target.tmp, nbytes))
        if reasons:
            return self._failed(step, target.tmp, reasons, refused=True)
        target.marker = self._marker(step, kind, dtype, nbytes)
        sidecar = None  # (file name, bytes) of the data-loader state, on rank 0
        if not model_only and self.replica_groups is not None:
            target.marker["replica_groups"] = self.replica_groups  # their data states: <folder>/replica_<id>/step-N
        elif not model_only:
            sidecar, error = self._dataloader_state(target.marker, target.tmp if not asynchronous else None)
            reasons = self.comm.agree(error)
            if reasons:
                return self._failed(step, target.tmp, reasons, refused=False)
        writer = self._writer(target.tmp, step)
        if asynchronous:
            return self._start_background(target, state, writer, sidecar)
        _, error = attempt("checkpoint save", dcp.save, state, storage_writer=writer, process_group=self.comm.pg)
        del state
        return self._finish_save(target, error, time.perf_counter() - target.t0, writer)

    def _save_data(self, target: SaveTarget) -> bool:
        """A data-only checkpoint (a replica group's part of the data stream): the merged loader state of
        this group's ranks and the commit marker."""
        reasons = self.comm.agree(self._prepare(target.step, target.tmp, 0))
        if reasons:
            return self._failed(target.step, target.tmp, reasons, refused=True)
        target.marker = self._marker(target.step, DATA_ONLY, None, 0)
        _, error = self._dataloader_state(target.marker, target.tmp)
        reasons = self.comm.agree(error)
        if reasons:
            return self._failed(target.step, target.tmp, reasons, refused=False)
        return self._finish_save(target, None, time.perf_counter() - target.t0)

    def _prepare(self, step: int, tmp: Path, nbytes: int) -> str | None:
        """Rank 0 clears a stale temporary folder of this step before anyone writes into it (the agreement
        that follows is also the barrier that orders this); every rank checks the disk space."""
        if self.comm.rank == 0:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
            except OSError as e:
                return f"cannot prepare {tmp}: {e}"
        return self.space.check(step, nbytes, warn=self.comm.rank == 0)

    def _marker(self, step: int, kind: str, dtype: torch.dtype | None, nbytes: int) -> dict:
        """The commit marker's content known before writing (files and sizes are added at commit)."""
        c = self.components
        return {
            "format": FORMAT_VERSION, "step": step, "kind": kind,
            "dtype": str(dtype).replace("torch.", "") if dtype is not None else "as trained",
            "tokens_seen": c.train_state.tokens_seen, "skipped_steps": c.train_state.skipped_steps,
            "lr": c.lr_at(step), "lr_schedule_steps": c.schedule_steps(), "world_size": self.comm.world,
            "layout": c.layout,
            "estimated_bytes": nbytes, "torch": torch.__version__,
        }

    def _dataloader_state(self, marker: dict, tmp: Path | None = None) -> tuple[tuple[str, bytes] | None, str | None]:
        """Gather the per-rank loader states and merge and encode them (rank 0): ((file name, bytes) of the
        sidecar, or None on other ranks; the error, if any). Every rank takes part in the gather whatever
        happens locally. The state is taken now, at the save's step; the file is written into ``tmp`` when
        given, else by the caller (a background save's thread)."""
        sidecar, error = self._gather_dataloader_state(marker)
        if tmp is not None and error is None and sidecar is not None:
            _, error = attempt("data-loader state", write_sidecar, tmp, sidecar)
            error = error and f"data-loader state: {error}"
        return sidecar, error

    def _gather_dataloader_state(self, marker: dict) -> tuple[tuple[str, bytes] | None, str | None]:
        c = self.components
        local, error = attempt("data-loader state", lambda: (int(c.dp_rank), c.data_loader.state_dict()))
        gathered = self.comm.gather(local)
        if error is not None:
            return None, f"data-loader state: {error}"
        if self.comm.rank != 0:
            return None, None
        if any(g is None for g in gathered):
            return None, "data-loader state: not available on another rank (see its log)"
        by_dp: dict[int, Any] = {}
        for dp_rank, sd in gathered:
            by_dp.setdefault(dp_rank, sd)
        states = [by_dp[r] for r in sorted(by_dp)]
        sidecar, error = attempt("data-loader state", self._encode_loader_state, states)
        if error is not None:
            return None, f"data-loader state: {error}"
        marker["dataloader"] = sidecar[0]
        marker["dataloader_dp_ranks"] = len(states)
        return sidecar, None

    def _encode_loader_state(self, states: list) -> tuple[str, bytes]:
        global_state = merge_loader_states(self.components.data_loader, states)
        try:
            return DATALOADER_JSON, json.dumps(global_state).encode()
        except (TypeError, ValueError):  # not JSON-able: pickled
            return DATALOADER_PT, pickle_bytes(global_state)

    def _writer(self, tmp: Path, step: int):
        fail = step in self.cfg.drill_fail_save_steps and self.comm.rank == self.comm.world - 1
        delay = self.cfg.drill_save_delay_s if self.comm.rank == 0 else 0.0
        return new_writer(str(tmp), checksum=self.cfg.checksum, thread_count=self.cfg.save_threads, delay_s=delay,
                          fail=fail)

    # ----------------------------------------------------------------------------------------------
    # Background saves
    # ----------------------------------------------------------------------------------------------

    def _start_background(self, target: SaveTarget, state: dict, writer, sidecar: tuple[str, bytes] | None) -> bool:
        """Start the save's thread (it copies ``state``, writes it, and on rank 0 commits it) and return."""
        job = BackgroundSave(target, writer, step_now=lambda: self.components.train_state.step)
        _, error = attempt("async checkpoint save", self._start_thread, job, state, sidecar)
        reasons = self.comm.agree(error)
        job.call_returned(time.perf_counter() - target.t0)  # the save's thread may commit from now on
        if reasons:
            return self._failed(target.step, target.tmp, reasons, refused=False)
        self.pending = job
        return True

    def _start_thread(self, job: BackgroundSave, state: dict, sidecar: tuple[str, bytes] | None) -> None:
        if self._staging is None:
            # Pinned buffers need CUDA; the side stream is created here, on the training thread.
            reuse = self.cfg.async_mode == "async_with_pinned_mem"
            self._staging = ReusedStaging(pinned=self.components.use_cuda) if reuse else FreshStaging()
        staging = self._staging
        if job.target.step in self.cfg.drill_fail_copy_steps and self.comm.rank == self.comm.world - 1:
            staging = _FailingCopy()
        comm = Collectives(self.async_pg)
        job.start(state, staging, lambda staged, copy_error: self._write_in_background(job, staged, copy_error,
                                                                                       sidecar, comm))

    def _write_in_background(self, job: BackgroundSave, staged: dict | None, copy_error: BaseException | None,
                             sidecar: tuple[str, bytes] | None, comm: Collectives) -> Any:
        """On the save's thread: DCP's write, the data-loader state file, the checksums gathered, and on
        rank 0 the commit once the save call has returned (the marker records how long it blocked). After
        a failed copy (``copy_error``) this rank enters DCP's save with nothing and its writer raises the
        error while planning, so DCP fails the save on every rank before anyone writes."""
        import torch.distributed.checkpoint as dcp

        target = job.target
        if copy_error is not None:
            job.writer.abort = copy_error
            staged = {}
        # DCP first: every rank takes part in its collectives whatever happens to rank 0's sidecar. DCP
        # raises on every rank when one failed, so every rank that gets past it takes part in the gather.
        result = dcp.save(staged, storage_writer=job.writer, process_group=self.async_pg)
        error = None
        if sidecar is not None:
            try:
                write_sidecar(target.tmp, sidecar)
            except OSError as e:
                error = f"data-loader state: {e}"
        gathered = comm.gather(job.writer.sums)
        if comm.rank == 0 and error is None:
            blocking_s = job.wait_call_returned()
            try:
                self._commit(target, gathered, blocking_s)
            except ERRORS as e:
                raise CheckpointError(f"commit failed: {format_exception(e)}") from e
        if error is not None:
            raise OSError(error)
        return result

    def wait_staging(self) -> None:
        """Wait until the background save has copied the state it reads (before the optimizer changes it)."""
        job = self.pending
        if job is not None:
            try:
                job.staging.result()
            except ERRORS:
                pass  # reported with the upload's result, when the ranks agree on the outcome

    def poll(self, step: int) -> None:
        """At a step boundary while a background save is in flight (all ranks; one small all-reduce): when
        it failed on any rank, or has ended on every rank, agree on its outcome now, as a synchronous save
        would have (a failure stops the run at ``checkpoint.max_failed_saves``, or is counted)."""
        job = self.pending
        failed, done = self.comm.sum([int(job.failed), int(job.done)])
        if failed or done == self.comm.world:
            self.join(step)

    def join(self, step: int | None = None) -> None:
        """Wait for the background save on every rank and agree on its outcome (saved, or failed: counted,
        and the run stops at ``checkpoint.max_failed_saves`` in a row). ``step``: the step just trained."""
        job, self.pending = self.pending, None
        job.wait()
        _, error = attempt("background checkpoint save", job.upload.result)
        note = ""
        if job.ended_in_step is not None and step is not None:
            note = (f" (in the background: it ended during step {job.ended_in_step}, agreed by every rank after "
                    f"step {step})")
        self._finish_save(job.target, error, job.blocking_s, committed=True, seconds=job.done_s, note=note)

    # ----------------------------------------------------------------------------------------------
    # Outcome
    # ----------------------------------------------------------------------------------------------

    def _finish_save(self, target: SaveTarget, error: str | None, blocking_s: float, writer: Any = None,
                     committed: bool = False, seconds: float | None = None, note: str = "") -> bool:
        """After DCP wrote (or failed to write) ``target.tmp``: rank 0 gathers the checksums every rank
        computed while writing and commits when its own save succeeded (DCP's coordinator succeeds only if
        every rank did), unless the save's thread did (``committed``), then all ranks agree on the outcome.
        ``seconds``: how long the save took, when it ended before now (a background save); ``note``: said
        with a failure."""
        step, marker = target.step, target.marker
        if not committed:
            gathered = self.comm.gather(writer.sums if writer is not None else {})
            if error is None and self.comm.rank == 0:
                _, error = attempt("checkpoint commit", self._commit, target, gathered, blocking_s)
                error = error and f"commit failed: {error}"
        reasons = self.comm.agree(error)
        if reasons:
            return self._failed(step, target.tmp, reasons, refused=False, note=note)
        self.consecutive_failures = 0
        self.saves += 1
        if marker["kind"] in RESUMABLE_KINDS:
            self._committed_steps.add(step)
        if self.comm.rank == 0 and marker["kind"] == DATA_ONLY:
            logger.info("this replica group's data state of %s saved -> %s", target.final.name, target.final)
            self._retain(step)
        elif self.comm.rank == 0:
            logger.info("checkpoint %s saved: %s%s in %.2f s (training blocked %.2f s) -> %s",
                        target.final.name, human_bytes(marker.get("bytes", 0)),
                        "" if marker["kind"] == "full" else f", {marker['kind']} {marker['dtype']}",
                        seconds if seconds is not None else time.perf_counter() - target.t0, blocking_s,
                        target.final)
            self._retain(step)
        return True

    def _commit(self, target: SaveTarget, gathered: list, blocking_s: float) -> None:
        """Rank 0: the commit marker (every rank's checksums) written last, then the rename."""
        sums = {name: entry for part in gathered for name, entry in part.items()}
        target.marker["save_seconds"] = round(time.perf_counter() - target.t0, 3)
        target.marker["blocking_seconds"] = round(blocking_s, 3)
        commit(target.tmp, target.final, target.marker, sums, self.cfg.checksum)

    def _retain(self, step: int) -> None:
        """Delete the checkpoints older than the newest ``keep_latest_k`` (0 keeps all) full checkpoints of
        the run up to ``step`` (the one just committed), whichever launch of the run committed them: a
        preemptible job restarts many times, and counting one launch's saves only let the folder grow by
        every launch's. Counted and deleted are only committed, complete checkpoints (marker and sizes);
        one the loader found damaged (it may hold intact weights), a final model-only save, anything
        that is not a ``step-N`` folder, and checkpoints after ``step`` (a run sent back with load_step
        replaces them as it passes their steps) are never deleted. Nothing is deleted before this launch
        has committed a checkpoint of its own, so the one it resumed from stays until a newer one exists."""
        k = self.cfg.keep_latest_k
        if k <= 0 or not self._committed_steps - self._resumed_steps:
            return
        infos = [c for c in scan_folder(self.folder) if not c.final and not c.leftover
                 and c.complete and c.step <= step and c.step not in self._damaged_steps]
        full = [c for c in infos if c.kind in RESUMABLE_KINDS]
        if len(full) <= k:
            return
        keep_from = full[-k].step
        for c in infos:
            if c.step < keep_from:
                shutil.rmtree(c.path, ignore_errors=True)
                logger.info("checkpoint %s deleted (keep_latest_k=%d)", c.path.name, k)

    def _failed(self, step: int, tmp: Path, reasons: list[str], refused: bool, note: str = "") -> bool:
        """A failed (or refused) save, agreed by all ranks: report it, clean up, count it, maybe stop."""
        self.failures += 1
        self.consecutive_failures += 1
        if self.comm.rank == 0:
            causes = list(reasons)
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
            except OSError as e:
                causes.append(f"(could not remove {tmp}: {e})")
            latest = [c.path.name for c in scan_folder(self.folder) if c.complete]
            logger.error(
                "checkpoint step-%d %s%s: %s. Failed saves: %d in this run, %d in a row (checkpoint.max_failed_saves"
                "=%d). Latest complete checkpoint: %s", step, "refused" if refused else "FAILED", note,
                " | ".join(causes), self.failures, self.consecutive_failures, self.cfg.max_failed_saves,
                latest[-1] if latest else "none")
        if self.consecutive_failures >= self.cfg.max_failed_saves:
            raise CheckpointError(
                f"stopping after {self.consecutive_failures} failed checkpoint save(s) in a row "
                f"(checkpoint.max_failed_saves={self.cfg.max_failed_saves}); last: step-{step}: {reasons[0]}")
        return False


class _FailingCopy:
    """Fault drill (``checkpoint.drill_fail_copy_steps``): the copy of a background save fails."""

    def stage(self, state: dict) -> dict:
        raise OSError("fault drill: injected copy failure (checkpoint.drill_fail_copy_steps)")

    def close(self) -> None:
        pass
