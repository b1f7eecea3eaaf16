"""Saving: write a checkpoint with DCP (synchronously or in the background), commit it, keep the latest.

A save is atomic: every rank writes into ``step-N.tmp``, the ranks agree that all of them succeeded,
then rank 0 writes the commit marker (every file's size and checksum, hashed while it was written) and
renames the folder to ``step-N``. A failed (or refused) save
is reported with every rank's reason, cleaned up and counted; the run stops after
``checkpoint.max_failed_saves`` in a row.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.agree import ERRORS, Collectives, attempt, format_exception
from trainer.checkpoint.integrity import hashing_filesystem
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
from trainer.errors import CheckpointError

logger = logging.getLogger("trainer")


def _make_writer_class():
    from torch.distributed.checkpoint import FileSystemWriter

    class DrillWriter(FileSystemWriter):
        """FileSystemWriter plus the fault drills (checkpoint.drill_*): a slow save, a failing save."""

        def __init__(self, path, *, delay_s: float = 0.0, fail: bool = False, checksum: str = "none", **kwargs):
            super().__init__(path, **kwargs)
            self._delay_s = delay_s
            self._fail = fail
            self.sums: dict[str, dict] = {}  # {file: {size, checksum}} of the files this rank wrote
            if checksum != "none" and hasattr(getattr(self, "fs", None), "create_stream"):
                # Hash while writing; without this hook rank 0 hashes the files by reading them at commit.
                self.fs, self.sums = hashing_filesystem(self.fs, checksum)

        def write_data(self, plan, planner):
            if self._delay_s > 0:
                time.sleep(self._delay_s)
            if self._fail:
                raise OSError(f"fault drill: injected write failure (checkpoint.drill_fail_save_steps) in {self.path}")
            with without_zip_crc32():
                return super().write_data(plan, planner)

    return DrillWriter


_crc_lock = threading.Lock()
_crc_users = 0
_crc_saved: bool | None = None


@contextlib.contextmanager
def without_zip_crc32():
    """DCP writes each tensor as a small ``torch.save`` zip, whose CRC-32 per record costs as much CPU as the
    disk takes to write the bytes, and ``torch.load`` never checks it. The checkpoint's own checksum (hashed
    while writing) covers every byte of every file, so while our writers run the CRC is not computed (with
    checksum none too: nothing reads it). A process-wide torch setting: restored when the last concurrent
    save finishes."""
    global _crc_users, _crc_saved
    try:
        from torch.utils.serialization import config as serialization_config
    except ImportError:  # another torch version: the CRC stays
        yield
        return
    with _crc_lock:
        if _crc_users == 0:
            _crc_saved = serialization_config.save.compute_crc32
            serialization_config.save.compute_crc32 = False
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                serialization_config.save.compute_crc32 = _crc_saved


def write_sidecar(tmp: Path, sidecar: tuple[str, bytes]) -> None:
    """Write the data-loader state file (name, bytes) into the checkpoint's temporary folder, durably."""
    tmp.mkdir(parents=True, exist_ok=True)
    write_file_atomic(tmp / sidecar[0], sidecar[1])


def stage_copy(obj: Any, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """A copy of a state dict whose tensors are in fresh CPU memory: what a background save writes while
    training changes the live tensors. DTensors stay DTensors of the same mesh, placements and global
    shape (their local shards are copied); dicts, lists and tuples are copied; other values (numbers,
    strings, bytes) are immutable and shared. A tensor object that appears twice is copied once. Each
    copy is one ``Tensor.copy_``, which releases the GIL: the training loop's Python runs beside it."""
    if memo is None:
        memo = {}
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:
            memo[key] = _copy_tensor(obj)
        return memo[key]
    if isinstance(obj, dict):
        return {k: stage_copy(v, memo) for k, v in obj.items()}
    if isinstance(obj, list):
        return [stage_copy(v, memo) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(stage_copy(v, memo) for v in obj)
    return obj


def _copy_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if isinstance(t, DTensor):
            local = _copy_tensor(t.to_local())
            return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                      stride=t.stride())
        out = torch.empty_like(t, device="cpu")
        out.copy_(t)
        return out


class BackgroundSave:
    """One asynchronous save on a thread of its own, started before anything is copied (the call that
    starts it returns at once): first ``stage_copy`` of ``state`` (``staging`` is done then, and the live
    tensors may change), then ``write(copy)`` (``upload`` holds its result or its exception). The copy is
    freed when the write returns."""

    def __init__(self, state: dict, write: Any):
        self.staging: Future = Future()
        self.upload: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(state, write), name="checkpoint-save")
        self._thread.start()

    def _run(self, state: dict, write: Any) -> None:
        try:
            staged = stage_copy(state)
        except BaseException as e:  # reported through both futures (the upload's is the one counted)
            self.staging.set_exception(e)
            self.upload.set_exception(e)
            return
        del state
        self.staging.set_result(None)
        try:
            result = write(staged)
        except BaseException as e:
            del staged
            self.upload.set_exception(e)
            return
        del staged
        self.upload.set_result(result)


@dataclass
class _Pending:
    """An asynchronous save in flight."""

    step: int
    tmp: Path
    final: Path
    marker: dict
    upload: Any  # concurrent.futures.Future
    staging: Any  # Future or None
    t0: float
    blocking_s: float
    stager: Any = None  # a per-save stager to close once the save is written
    writer: Any = None
    committed_by_thread: bool = False  # rank 0's save thread committed it (or failed: the upload's error)


class Saver:
    """Writes, commits and retains the checkpoints of ``components`` in ``folder`` (all ranks call every
    method together). ``async_pg`` is the process group of background saves (None: synchronous only).
    ``replica_groups``: in a fault-tolerant job, how many replica groups it has; its full checkpoints then
    hold no data-loader state (each group saves its own: :mod:`trainer.checkpoint.replicas`)."""

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
        self.committed_steps: set[int] = set()  # full checkpoints committed (and checksummed) by this run
        self.resumed_steps: set[int] = set()  # the checkpoint this launch resumed from (verified on load)
        self.damaged_steps: set[int] = set()  # checkpoints the loader could not load: never deleted
        self.pending: _Pending | None = None
        self._stager = None  # the reused pinned-memory stager (async_with_pinned_mem on CUDA)
        self._staging_future = None
        self._writer_cls = None

    @property
    def pinned(self) -> bool:
        return self.cfg.async_mode == "async_with_pinned_mem" and self.components.use_cuda

    def due(self, step: int, last: bool = False) -> bool:
        """Whether ``step`` is a save step: every ``checkpoint.interval`` steps and the last step."""
        return last or step % self.cfg.interval == 0

    def maybe_save(self, step: int, last: bool = False, write: bool = True) -> None:
        """After every optimizer step: finish a background save that has completed; save at every
        ``checkpoint.interval`` steps and at the last step (unless not ``write``: another replica group
        writes the job's checkpoint of this step)."""
        if self.pending is not None:
            self._poll(block=self.due(step, last))
        if not write:
            return
        if last:
            # The last step's save is always full (a longer run continues from it exactly); the model-only
            # export is an addition under its own name, so no run overwrites another run's final save.
            self.save(step, kind="full", asynchronous=False)
            if self.cfg.last_save_model_only:
                self.save(step, kind="model_only", dtype=EXPORT_DTYPES[self.cfg.export_dtype], asynchronous=False,
                          final=True)
        elif self.due(step):
            self.save(step, kind="full", asynchronous=self.cfg.async_mode != "disabled")

    def finish(self) -> None:
        """End of training: wait for a background save and commit it."""
        if self.pending is not None:
            self._poll(block=True)
        if self._stager is not None:
            attempt("closing the checkpoint stager", self._stager.close)
            self._stager = None

    def save(self, step: int, kind: str = "full", dtype: torch.dtype | None = None, asynchronous: bool = False,
             final: bool = False) -> bool:
        """Save ``step`` (all ranks). Returns whether it was committed (a synchronous save) or started (an
        asynchronous one). Failures are counted and raise :class:`CheckpointError` once
        ``checkpoint.max_failed_saves`` happen in a row."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        final_save = final
        final = self.folder / step_dirname(step, final=final_save)
        tmp = self.folder / step_dirname(step, TMP_SUFFIX, final=final_save)
        if kind == DATA_ONLY:
            return self._save_data(step, tmp, final, t0)
        model_only = kind != "full"
        self.wait_staging()
        state = self.components.snapshot(step, self.comm.rank, model_only, dtype)
        # Every rank counts its entries at their global sizes; ranks of one pipeline stage count the same
        # ones, so the sum over ranks divided by the ranks per stage is the whole checkpoint.
        nbytes = self.comm.sum([estimate_checkpoint_bytes(state)])[0] * self.components.pp_degree // self.comm.world
        reasons = self.comm.agree(self._prepare(step, tmp, nbytes))
        if reasons:
            return self._failed(step, tmp, reasons, refused=True)
        marker = self._marker(step, kind, dtype, nbytes)
        sidecar = None  # (file name, bytes) of the data-loader state, on rank 0
        if not model_only and self.replica_groups is not None:
            marker["replica_groups"] = self.replica_groups  # their data states: <folder>/replica_<id>/step-N
        elif not model_only:
            sidecar, error = self._dataloader_state(marker, tmp if not asynchronous else None)
            reasons = self.comm.agree(error)
            if reasons:
                return self._failed(step, tmp, reasons, refused=False)
        writer = self._writer(tmp, step)
        if asynchronous:
            return self._start_async(step, tmp, final, marker, state, writer, t0, sidecar)
        _, error = attempt("checkpoint save", dcp.save, state, storage_writer=writer, process_group=self.comm.pg)
        del state
        return self._finish_save(step, tmp, final, marker, error, t0, time.perf_counter() - t0, writer)

    def _save_data(self, step: int, tmp: Path, final: Path, t0: float) -> bool:
        """A data-only checkpoint (a replica group's part of the data stream): the merged loader state of
        this group's ranks and the commit marker."""
        reasons = self.comm.agree(self._prepare(step, tmp, 0))
        if reasons:
            return self._failed(step, tmp, reasons, refused=True)
        marker = self._marker(step, DATA_ONLY, None, 0)
        _, error = self._dataloader_state(marker, tmp)
        reasons = self.comm.agree(error)
        if reasons:
            return self._failed(step, tmp, reasons, refused=False)
        return self._finish_save(step, tmp, final, marker, None, t0, time.perf_counter() - t0)

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
        if self._writer_cls is None:
            self._writer_cls = _make_writer_class()
        fail = step in self.cfg.drill_fail_save_steps and self.comm.rank == self.comm.world - 1
        delay = self.cfg.drill_save_delay_s if self.comm.rank == 0 else 0.0
        return self._writer_cls(str(tmp), delay_s=delay, fail=fail, checksum=self.cfg.checksum,
                                thread_count=self.cfg.save_threads)

    # ----------------------------------------------------------------------------------------------
    # Background saves
    # ----------------------------------------------------------------------------------------------

    def _start_async(self, step: int, tmp: Path, final: Path, marker: dict, state: dict, writer, t0: float,
                     sidecar: tuple[str, bytes] | None) -> bool:
        started, error = attempt("async checkpoint save", self._async_save, state, writer, tmp, final, marker,
                                 sidecar, t0)
        reasons = self.comm.agree(error)
        blocking_s = time.perf_counter() - t0
        if started is not None and started[3] is not None:
            started[3](blocking_s)  # the save's thread may commit from now on
        if reasons:
            return self._failed(step, tmp, reasons, refused=False)
        upload, staging, stager, release = started
        self.pending = _Pending(step, tmp, final, marker, upload, staging, t0, blocking_s,
                                stager if stager is not self._stager else None, writer,
                                committed_by_thread=release is not None)
        return True

    def _async_save(self, state: dict, writer, tmp: Path, final: Path, marker: dict,
                    sidecar: tuple[str, bytes] | None, t0: float):
        """Start the background save: (upload future, staging future, per-save stager to close or None,
        a function to call with the blocking time once the call is over, or None)."""
        import torch.distributed.checkpoint as dcp

        if self.pinned:
            return (*self._pinned_async_save(state, writer, tmp, sidecar), None)
        comm = Collectives(self.async_pg)
        call_over = threading.Event()
        timing: dict[str, float] = {}

        def write(staged: dict):
            # DCP first: every rank takes part in its collectives whatever happens to rank 0's sidecar. DCP
            # raises on every rank when one failed, so every rank that gets past it takes part in the gather.
            result = dcp.save(staged, storage_writer=writer, process_group=self.async_pg)
            error = None
            if sidecar is not None:
                try:
                    write_sidecar(tmp, sidecar)
                except OSError as e:
                    error = f"data-loader state: {e}"
            gathered = comm.gather(writer.sums)
            if comm.rank == 0 and error is None:
                call_over.wait()
                try:
                    self._commit(tmp, final, marker, gathered, t0, timing["blocking_s"])
                except ERRORS as e:
                    raise CheckpointError(f"commit failed: {format_exception(e)}") from e
            if error is not None:
                raise OSError(error)
            return result

        def release(blocking_s: float) -> None:
            timing["blocking_s"] = blocking_s
            call_over.set()

        job = BackgroundSave(state, write)
        self._staging_future = job.staging
        return job.upload, job.staging, None, release

    def _pinned_async_save(self, state: dict, writer, tmp: Path, sidecar: tuple[str, bytes] | None):
        """CUDA with async_with_pinned_mem: DCP's async_save with the staging API's reused pinned buffers,
        copied with non-blocking copies on a side stream in DCP's background thread."""
        import torch.distributed.checkpoint as dcp

        if sidecar is not None:
            write_sidecar(tmp, sidecar)
        kwargs: dict[str, Any] = {"storage_writer": writer, "process_group": self.async_pg}
        stager = self._pinned_stager()
        if stager is not None and "async_stager" in inspect.signature(dcp.async_save).parameters:
            kwargs["async_stager"] = stager
        result = dcp.async_save(state, **kwargs)
        if hasattr(result, "upload_completion"):  # AsyncSaveResponse: staging runs in the background too
            self._staging_future = result.staging_completion
            return result.upload_completion, result.staging_completion, kwargs.get("async_stager")
        return result, None, kwargs.get("async_stager")

    def _pinned_stager(self):
        """The staging API's stager (torch >= 2.9) with pinned buffers reused from save to save, or None
        (DCP's default staging) where this torch lacks it."""
        if self._stager is None:
            try:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                self._stager = DefaultStager(StagingOptions(
                    use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                    use_non_blocking_copy=True))
            except (ImportError, TypeError, AssertionError, RuntimeError) as e:  # another torch version
                logger.warning("checkpoint staging API unavailable (%s); using DCP's default staging", e)
                return None
        return self._stager

    def wait_staging(self) -> None:
        """Wait until a background save has copied the state it reads (before the optimizer changes it)."""
        fut = self._staging_future
        if fut is not None:
            self._staging_future = None
            try:
                fut.result()
            except ERRORS:
                pass  # reported with the upload's result

    def _poll(self, block: bool) -> None:
        """Finish the background save if it is done on every rank (or wait for it when ``block``)."""
        p = self.pending
        if block:
            try:
                p.upload.result()
            except ERRORS:
                pass  # reported below, once every rank is done
        if self.comm.sum([int(p.upload.done())])[0] < self.comm.world:
            return
        self.pending = None
        _, error = attempt("background checkpoint save", p.upload.result)
        if p.stager is not None:
            attempt("closing a checkpoint stager", p.stager.close)
        self._finish_save(p.step, p.tmp, p.final, p.marker, error, p.t0, p.blocking_s, p.writer,
                          committed=p.committed_by_thread)

    # ----------------------------------------------------------------------------------------------
    # Outcome
    # ----------------------------------------------------------------------------------------------

    def _finish_save(self, step: int, tmp: Path, final: Path, marker: dict, error: str | None, t0: float,
                     blocking_s: float, writer: Any = None, committed: bool = False) -> bool:
        """After DCP wrote (or failed to write) ``tmp``: rank 0 gathers the checksums every rank computed
        while writing and commits when its own save succeeded (DCP's coordinator succeeds only if every
        rank did), unless the save's thread did (``committed``), then all ranks agree on the outcome."""
        if not committed:
            gathered = self.comm.gather(getattr(writer, "sums", None) or {})
            if error is None and self.comm.rank == 0:
                _, error = attempt("checkpoint commit", self._commit, tmp, final, marker, gathered, t0, blocking_s)
                error = error and f"commit failed: {error}"
        reasons = self.comm.agree(error)
        if reasons:
            return self._failed(step, tmp, reasons, refused=False)
        self.consecutive_failures = 0
        self.saves += 1
        if marker["kind"] in RESUMABLE_KINDS:
            self.committed_steps.add(step)
        if self.comm.rank == 0 and marker["kind"] == DATA_ONLY:
            logger.info("this replica group's data state of %s saved -> %s", final.name, final)
            self._retain(step)
        elif self.comm.rank == 0:
            logger.info("checkpoint %s saved: %s%s in %.2f s (training blocked %.2f s) -> %s",
                        final.name, human_bytes(marker.get("bytes", 0)),
                        "" if marker["kind"] == "full" else f", {marker['kind']} {marker['dtype']}",
                        time.perf_counter() - t0, blocking_s, final)
            self._retain(step)
        return True

    def _commit(self, tmp: Path, final: Path, marker: dict, gathered: list, t0: float, blocking_s: float) -> None:
        """Rank 0: the commit marker (every rank's checksums) written last, then the rename."""
        sums = {name: entry for part in gathered for name, entry in part.items()}
        marker["save_seconds"] = round(time.perf_counter() - t0, 3)
        marker["blocking_seconds"] = round(blocking_s, 3)
        commit(tmp, final, marker, sums, self.cfg.checksum)

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
        if k <= 0 or not self.committed_steps - self.resumed_steps:
            return
        infos = [c for c in scan_folder(self.folder) if not c.final and not c.leftover
                 and c.complete and c.step <= step and c.step not in self.damaged_steps]
        full = [c for c in infos if c.kind in RESUMABLE_KINDS]
        if len(full) <= k:
            return
        keep_from = full[-k].step
        for c in infos:
            if c.step < keep_from:
                shutil.rmtree(c.path, ignore_errors=True)
                logger.info("checkpoint %s deleted (keep_latest_k=%d)", c.path.name, k)

    def _failed(self, step: int, tmp: Path, reasons: list[str], refused: bool) -> bool:
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
                "checkpoint step-%d %s: %s. Failed saves: %d in this run, %d in a row (checkpoint.max_failed_saves"
                "=%d). Latest complete checkpoint: %s", step, "refused" if refused else "FAILED", " | ".join(causes),
                self.failures, self.consecutive_failures, self.cfg.max_failed_saves, latest[-1] if latest else "none")
        if self.consecutive_failures >= self.cfg.max_failed_saves:
            raise CheckpointError(
                f"stopping after {self.consecutive_failures} failed checkpoint save(s) in a row "
                f"(checkpoint.max_failed_saves={self.cfg.max_failed_saves}); last: step-{step}: {reasons[0]}")
        return False
