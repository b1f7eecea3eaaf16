"""Loading: resume from the newest usable checkpoint of the dump folder, or start from
``checkpoint.initial_load_path`` (a checkpoint, or a Hugging Face folder).

Rank 0 decides which checkpoints to try (it scans the folder and reports what it finds); every rank
then loads with no collectives besides DCP's own, verifying the checksums of its share of the
checkpoint's files from the bytes DCP reads (:func:`trainer.checkpoint.integrity.verifying_filesystem`; no
second read), and all ranks agree on the outcome before anything but the tensors DCP reads in place is
restored: on damage (a checksum mismatch, a missing file, a read error) the previous checkpoint is loaded
over it, on a checkpoint that does not
fit this run's config the run stops with the cause and a way out. When the folder holds checkpoints and
none can be loaded the run stops (exit 3) listing each with its reason, unless
``checkpoint.start_fresh_if_unloadable`` says to start from scratch.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import shutil
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.agree import ERRORS, Collectives, attempt, format_exception
from trainer.checkpoint.integrity import check_digest, share, verify_files, verifying_filesystem
from trainer.checkpoint.layout import (
    DCP_METADATA,
    MARKER,
    CheckpointInfo,
    inspect_checkpoint,
    scan_folder,
)
from trainer.checkpoint.config import STATE_KEYS
from trainer.checkpoint.replicas import ReplicaGroup, group_data_state, job_data_state, read_data_state
from trainer.checkpoint.state import (
    Components,
    TrainState,
    load_loader_global_state,
    read_loader_file,
    unpickle_bytes,
)
from trainer.errors import CheckpointError, ConfigError
from trainer.models.hf import load_hf_weights
from trainer.parallel import clean_fqn

logger = logging.getLogger("trainer")


class _Corrupt(Exception):
    """A checkpoint's files do not match the checksums of its commit marker (found while loading it)."""


class _Incompatible(Exception):
    """A checkpoint was read but does not fit this run's config (not damage: older ones would not fit
    either)."""


def _metadata_entries(path: Path) -> dict[str, Any]:
    """``{flattened DCP key: its metadata}`` of a checkpoint (nothing but ``.metadata`` is read)."""
    from torch.distributed.checkpoint import FileSystemReader

    return dict(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _first(names: set[str], n: int = 5) -> str:
    shown = sorted(names)[:n]
    return ", ".join(shown) + (f", ... ({len(names)} in all)" if len(names) > n else f" ({len(names)})")


def model_shapes(model_sd: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """``{plain name: global shape}`` of a model state (DTensors report their global shape)."""
    return {clean_fqn(k): tuple(v.shape) for k, v in model_sd.items() if hasattr(v, "shape")}


def compare_model(shapes: dict[str, tuple[int, ...]], entries: dict[str, Any]) -> tuple[str | None, set[str]]:
    """(why a checkpoint's ``model`` entry does not fit the model or None, the names both hold at the same
    shape). ``shapes`` is the whole model's (:func:`model_shapes`; under pipeline parallelism gathered over
    the stages, so every rank decides the same). Both sides are compared under the names the loader uses
    (:func:`trainer.parallel.clean_fqn`, which also normalises checkpoints written under pipeline stages or
    wrappers), tensors by global shape. DCP alone would load the overlap and leave the rest as
    initialised, which trains on silently."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = {clean_fqn(k[len("model."):]): v for k, v in entries.items() if k.startswith("model.")}
    missing, unexpected = set(shapes) - set(saved), set(saved) - set(shapes)
    reshaped = sorted(f"{k} {tuple(saved[k].size)} -> {shape}" for k, shape in shapes.items()
                      if k in saved and isinstance(saved[k], TensorStorageMetadata)
                      and tuple(saved[k].size) != shape)
    shared = {k for k in shapes if k in saved and not any(r.startswith(k + " ") for r in reshaped)}
    if not (missing or unexpected or reshaped):
        return None, shared
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {_first(missing)}")
    if unexpected:
        parts.append(f"not in this model: {_first(unexpected)}")
    if reshaped:
        parts.append(f"other shapes (saved -> now): {', '.join(reshaped[:5])}"
                     + (f", ... ({len(reshaped)} in all)" if len(reshaped) > 5 else f" ({len(reshaped)})"))
    return ("its model weights do not match this model (was the model config changed, e.g. model.flavor, "
            "model.n_layers or model.dim?): " + "; ".join(parts) + ". Train with the model config it was saved "
            "with (its run's config.toml), start the new model in a new job.dump_folder, or set "
            "checkpoint.partial_model_load=true to load only the weights that match (optimizer starts fresh)"), shared


def _flat_optimizer(keys: set[str]) -> bool:
    """Whether a checkpoint's optimizer param_groups are keyed by parameter name (``optimizer.param_groups.
    <name>.lr``) rather than listed (``optimizer.param_groups.0.lr``)."""
    groups = [k[len("optimizer.param_groups."):] for k in keys if k.startswith("optimizer.param_groups.")]
    return any(not g.split(".", 1)[0].isdigit() for g in groups)


def _present(prefix: str, keys: set[str]) -> bool:
    return prefix in keys or any(k.startswith(prefix + ".") for k in keys)


class _Slice(io.RawIOBase):
    """The bytes [offset, offset + length) of a stream, as a stream of their own (one DCP item)."""

    def __init__(self, stream, offset: int, length: int):
        self.stream, self.offset, self.length = stream, offset, length
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = pos if whence == io.SEEK_SET else (self.pos + pos if whence == io.SEEK_CUR else self.length + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")[:max(0, self.length - self.pos)]
        if not len(view):
            return 0
        self.stream.seek(self.offset + self.pos)
        n = self.stream.readinto(view) or 0
        self.pos += n
        return n


def _read_into(item: _Slice, req, target) -> bool:
    """Read a whole stored tensor's bytes straight into ``target`` (a contiguous CPU tensor of the same dtype
    and shape), skipping ``torch.load``'s own buffer and the copy out of it. False, with nothing read into
    ``target``, when the item is not such a tensor (a shard of it, another dtype, another device)."""
    if target.device.type != "cpu" or not target.is_contiguous() or any(req.storage_offsets):
        return False
    item.seek(0)
    meta = torch.load(item, map_location="meta", weights_only=True)  # the zip's directory and header only
    if not isinstance(meta, torch.Tensor):
        return False
    offset = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    if (offset is None or meta.dtype != target.dtype
            or tuple(meta.shape) != tuple(target.shape) or tuple(req.lengths) != tuple(meta.shape)
            or not meta.is_contiguous() or meta.storage_offset() != 0):
        return False
    dst = memoryview(target.view(-1).view(torch.uint8).numpy())
    item.seek(offset)
    done = 0
    while done < len(dst):
        n = item.readinto(dst[done:])
        if not n:
            raise OSError(f"{item.length}-byte item ends before its {len(dst)}-byte tensor (the file is truncated)")
        done += n
    return True


def _read_item(stream, info, req, planner) -> None:
    """One DCP read request: bytes to the planner, a tensor read into its place in the live state."""
    from torch.distributed.checkpoint.planner import LoadItemType

    item = _Slice(stream, info.offset, info.length)
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(item.read()))
        return
    target = planner.resolve_tensor(req).detach()
    if not _read_into(item, req, target):
        item.seek(0)
        tensor = torch.load(item, map_location="cpu", weights_only=True)
        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
            if length < tensor.size(dim):
                tensor = tensor.narrow(dim, start, length)
        if tensor.size() != target.size():
            raise CheckpointError(f"{req.storage_index.fqn}: stored {tuple(tensor.size())}, expected "
                                  f"{tuple(target.size())}")
        target.copy_(tensor)
    planner.commit_tensor(req, target)


def _verifying_reader(path: Path, algo: str, names: set[str]):
    """A DCP ``FileSystemReader`` of ``path`` that reads each file's items in the order they lie on disk,
    whole tensors straight into the live state, and hashes the files of ``names`` from the bytes it reads.
    Returns (reader, ``{name: (size, digest)}``, filled as the files are closed)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.futures import Future

    class _Reader(FileSystemReader):
        def prepare_local_plan(self, plan):
            def where(item):
                info = self.storage_data[item.storage_index]
                return info.relative_path, info.offset

            return dataclasses.replace(plan, items=sorted(plan.items, key=where))

        def read_data(self, plan, planner):
            if any(self.storage_data[r.storage_index].transform_descriptors for r in plan.items):
                return super().read_data(plan, planner)  # compressed or otherwise transformed: DCP's own way
            by_file: dict[str, list] = {}
            for req in plan.items:
                by_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
            for name, reqs in by_file.items():
                with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                    for req in reqs:
                        _read_item(stream, self.storage_data[req.storage_index], req, planner)
            done: Future = Future()
            done.set_result(None)
            return done

    reader = _Reader(str(path))
    reader.fs, hashed = verifying_filesystem(reader.fs, algo, names)
    return reader, hashed


class Loader:
    """Loads checkpoints of ``folder`` (or ``cfg.initial_load_path``) into ``components``."""

    def __init__(self, cfg, folder: Path, components: Components, comm: Collectives, training_steps: int,
                 model_name: str, replica: ReplicaGroup | None = None):
        self.cfg = cfg
        self.replica = replica  # a fault-tolerant job's replica group: its data state is in its own folder
        self.model_name = model_name  # whose Hugging Face mapping reads an initial_load_path HF folder
        self.folder = folder
        self.components = components
        self.comm = comm
        self.training_steps = training_steps
        self.loaded_step: int | None = None
        self.failed_steps: set[int] = set()  # checkpoints of the folder that failed verification or loading
        self._touched = False  # a failed load may have written into the model (DCP reads in place)
        self._optimizer_flat = False  # the form of the optimizer state being read (see _flat_optimizer)
        self._partial = False  # the model was loaded partially (checkpoint.partial_model_load)
        self._model_shapes: dict | None = None  # the whole model's shapes, when a rank holds only stages

    def load(self, resume: bool) -> None:
        """Resume from the folder's latest complete checkpoint (or ``load_step``) when ``resume``, else or
        when there is none start from ``initial_load_path`` if set."""
        cfg = self.cfg
        if self.components.pp_degree > 1 and (resume or cfg.initial_load_path):
            # Each rank holds only its pipeline stages: compare the checkpoint with the whole model, so that
            # every rank takes the same decision (a rank refusing alone would leave the others waiting in
            # DCP's collectives). All ranks call this, before anything else of the load.
            parts = self.comm.gather(model_shapes(self.components.model_state()))
            self._model_shapes = self.comm.broadcast(
                {k: v for part in parts for k, v in part.items()} if self.comm.rank == 0 else None)
        candidates: list[CheckpointInfo] = []
        if resume:
            candidates = self.comm.broadcast(self._choose_candidates() if self.comm.rank == 0 else None)
            if isinstance(candidates, str):  # an error decided by rank 0
                raise CheckpointError(candidates)
        elif cfg.load_step >= 0 and self.comm.rank == 0:
            logger.warning("checkpoint.load_step=%d is ignored: checkpoint.enable is false", cfg.load_step)
        if candidates:
            if cfg.initial_load_path and self.comm.rank == 0:
                logger.info("checkpoint.initial_load_path is ignored: %s holds checkpoints to resume from",
                            self.folder)
            self._load_first(candidates, explicit=cfg.load_step >= 0)
        elif cfg.initial_load_path:
            self._initial_load()

    # ----------------------------------------------------------------------------------------------
    # Resuming
    # ----------------------------------------------------------------------------------------------

    def _choose_candidates(self) -> list[CheckpointInfo] | str:
        """Rank 0: report what the folder holds and order the checkpoints to try (newest usable first)."""
        infos = scan_folder(self.folder)
        for c in infos:
            if c.status == "incomplete" and c.leftover:
                logger.warning("checkpoint %s is incomplete (%s): ignored and removed", c.path.name, c.reason)
                shutil.rmtree(c.path, ignore_errors=True)
            elif not c.complete:
                logger.error("checkpoint %s is %s (%s): skipped", c.path.name, c.status.upper(), c.reason)
        complete = [c for c in infos if c.complete]
        if self.cfg.load_step >= 0:
            chosen = [c for c in complete if c.step == self.cfg.load_step and not c.final]
            if not chosen:
                return (f"checkpoint.load_step={self.cfg.load_step}: no complete checkpoint step-{self.cfg.load_step} "
                        f"in {self.folder}; complete ones: {[c.step for c in complete] or 'none'}")
            return chosen
        if not complete:
            unusable = [c for c in infos if not c.leftover]
            return self._unloadable([f"{c.path.name}: {c.status} ({c.reason})" for c in unusable]) if unusable else []
        complete.reverse()  # newest first
        full = [c for c in complete if c.kind == "full"]
        newest = complete[0]
        if newest.kind != "full" and (not full or full[0].step < newest.step):
            if 0 < newest.step < self.training_steps:
                if not full:
                    return (f"the newest checkpoint {newest.path} holds only model weights ({newest.kind}), so "
                            f"training cannot continue exactly from it, and no earlier checkpoint has optimizer "
                            f"state. Continue from its weights with a new job.dump_folder and "
                            f"checkpoint.initial_load_path={newest.path} (optimizer restarts)")
                logger.warning("checkpoint %s holds only model weights (a final export); resuming from %s, the "
                               "newest one with optimizer state", newest.path.name, full[0].path.name)
                return full
            # A seed checkpoint (step 0) or a finished run's export: weights only, then fall back to full ones.
            return [newest] + full
        return [c for c in complete if (c.kind == "full" or c.step == 0) and not c.final]

    def _unloadable(self, reasons: list[str]) -> list | str:
        """Rank 0: the folder holds checkpoints and none can be loaded: the error listing each, or (with
        checkpoint.start_fresh_if_unloadable) a loud warning and no candidates."""
        listing = "; ".join(reasons)
        if not self.cfg.start_fresh_if_unloadable:
            return (f"{self.folder} holds checkpoints but none can be loaded: {listing}. Nothing was changed. Fix or "
                    f"move them aside, pick one with checkpoint.load_step, or set "
                    f"checkpoint.start_fresh_if_unloadable=true to start from scratch next to them")
        logger.warning("STARTING FROM SCRATCH (checkpoint.start_fresh_if_unloadable): no checkpoint in %s can be "
                       "loaded: %s. They are left in place; saves of the same steps move them aside", self.folder,
                       listing)
        return []

    def _try_load(self, c: CheckpointInfo) -> tuple[dict, str | None, bool]:
        """(report, error, whether the error means the checkpoint does not fit) of loading ``c`` here."""
        try:
            self._touched = True
            report = self._load_checkpoint(c.path, c.marker, model_only=c.kind != "full",
                                           exclude=set(self.cfg.exclude_from_loading))
            return report, None, False
        except _Incompatible as e:
            return {}, str(e), True
        except _Corrupt as e:
            return {}, f"CORRUPT: {c.path.name}/{e}", False
        except ERRORS as e:
            logger.debug("loading %s failed:\n%s", c.path, traceback.format_exc())
            return {}, format_exception(e), False

    def _verifies(self, marker: dict) -> bool:
        return self.cfg.verify_on_load and marker.get("checksum", "none") != "none"

    def _verify(self, c: CheckpointInfo) -> str | None:
        """Before reading: this rank's share of ``c``'s files re-hashed against the marker's checksums; the
        reason if one fails (all ranks then agree on it before anything is read into the model). Only with
        checkpoint.start_fresh_if_unloadable, which needs the model untouched by a corrupt checkpoint;
        otherwise the files are verified from the bytes the load reads (:meth:`_read`)."""
        if not self._verifies(c.marker) or not self.cfg.start_fresh_if_unloadable:
            return None
        mine = share(list(c.marker.get("files") or {}), self.comm.rank, self.comm.world)
        bad, error = attempt(f"verifying {c.path}", verify_files, c.path, c.marker, mine)
        bad = bad or error
        return f"CORRUPT: {c.path.name}/{bad}" if bad else None

    def _load_first(self, candidates: list[CheckpointInfo], explicit: bool) -> None:
        """Load the first candidate that every rank loads; damaged ones are skipped unless ``explicit``."""
        errors = []
        train_state = self.components.train_state
        for c in candidates:
            reasons = self.comm.agree(self._verify(c))
            if reasons:
                report, incompatible = {}, False
            else:
                report, error, incompatible = self._try_load(c)
                reasons = self.comm.agree(error)
            if reasons and self.comm.any(incompatible):
                raise CheckpointError(f"checkpoint {c.path} does not fit this run's config: {' | '.join(reasons)}")
            if not reasons:
                self.loaded_step = c.step
                if "train_state" in report.get("restored", ()) and train_state.step > 0:
                    train_state.resumed_from_step = train_state.step  # not for a seed
                self._report_load(c.path, c.marker, report)
                return
            msg = " | ".join(reasons)
            if not c.final:
                self.failed_steps.add(c.step)
            errors.append(f"{c.path.name}: {msg}")
            if self.comm.rank == 0:
                logger.error("checkpoint %s could not be loaded (%s)%s", c.path.name, msg,
                             "" if explicit else "; trying the previous one")
            if explicit:
                break
        # Starting from scratch needs the initial weights: not when a failed load wrote into them (with
        # that option checksums are checked before reading, so only a read error gets here).
        if explicit or (self.cfg.start_fresh_if_unloadable and self.comm.any(self._touched)):
            raise CheckpointError("no checkpoint could be loaded: " + "; ".join(errors) +
                                  ". Move the folder aside to start from scratch, or pick one with "
                                  "checkpoint.load_step")
        decided = self.comm.broadcast(self._unloadable(errors) if self.comm.rank == 0 else None)
        if isinstance(decided, str):
            raise CheckpointError(decided)

    # ----------------------------------------------------------------------------------------------
    # One checkpoint, on this rank
    # ----------------------------------------------------------------------------------------------

    def _load_checkpoint(self, path: Path, marker: dict, model_only: bool, exclude: set[str],
                         restore_train_state: bool = True) -> dict:
        """Load one checkpoint into the components on this rank (no collectives besides DCP's own, so that
        a rank that fails here cannot leave the others waiting). Raises on any problem; everything is read
        before the non-tensor state is touched. Returns what was restored, for the report."""
        t0 = time.perf_counter()
        want = set(STATE_KEYS) - exclude
        if model_only:
            want &= {"model", "train_state"}
        if not restore_train_state:
            want &= {"model", "optimizer"}
        state = self._read(path, want, marker)
        loader_state = self._data_state(path, marker) if "dataloader" in want else None
        callbacks_state = unpickle_bytes(state["callbacks"]) if "callbacks" in state else None
        # Everything was read: now apply it.
        self._apply(state, callbacks_state, loader_state)
        if "rng" in state:
            self.components.set_rng_state(state["rng"][f"rank_{self.comm.rank}"])
        restored = set(state) - {"rng"} | ({"dataloader"} if loader_state is not None else set())
        return {"restored": restored, "rng": "rng" in state, "seconds": time.perf_counter() - t0,
                "lr_scheduler": state.get("lr_scheduler")}

    def _data_state(self, path: Path, marker: dict) -> Any:
        """The data-loader state to restore with ``path`` (None: none). A fault-tolerant job's checkpoint
        holds none: a replica group takes its own newest at or before the step, a run without fault
        tolerance the union of every group's of that step (see :mod:`trainer.checkpoint.replicas`)."""
        step, groups = marker.get("step", 0), marker.get("replica_groups")
        if groups is not None and self.replica is not None:
            info = group_data_state(self.folder, self.replica.replica_id, step)
            if self.comm.rank == 0 and info is None:
                logger.warning("replica group %d has no data state at or before step %d in %s: its part of the "
                               "data stream starts from the beginning", self.replica.replica_id, step,
                               self.replica.folder(self.folder))
            elif self.comm.rank == 0 and info.step != step:
                logger.warning("replica group %d's newest data state is of step %d (the job's checkpoint is step "
                               "%d: the group was not training then): its part of the stream goes on from step %d's "
                               "position, so none of its documents is skipped", self.replica.replica_id, info.step,
                               step, info.step)
            return None if info is None else read_data_state(info)
        if groups is not None:
            try:
                return job_data_state(self.folder, step, int(groups))
            except CheckpointError as e:
                raise _Incompatible(str(e)) from None
        return read_loader_file(path / marker["dataloader"]) if marker.get("dataloader") else None

    def _read(self, path: Path, want: set[str], marker: dict | None = None) -> dict[str, Any]:
        """The DCP entries of ``want`` that ``path`` holds, read into this run's (sharded) state; with
        checksums (``marker``'s, when verify_on_load) this rank's share of the files is verified from the
        bytes DCP reads, and :class:`_Corrupt` raised on a mismatch before anything else is restored."""
        import torch.distributed.checkpoint as dcp

        c = self.components
        entries = _metadata_entries(path)
        keys = set(entries)
        state: dict[str, Any] = {}
        self._partial = False
        if "model" in want:
            if not _present("model", keys):
                raise CheckpointError(f"{path} has no 'model' entry")
            state["model"] = c.model_state()
            mismatch, shared = compare_model(self._model_shapes or model_shapes(state["model"]), entries)
            if mismatch and not self.cfg.partial_model_load:
                raise _Incompatible(mismatch)  # not damage: every checkpoint of this run would fail the same way
            if mismatch:
                # Asked for by name: the shared weights only; the optimizer's moments belong to the old
                # model, so it starts fresh.
                self._partial = True
                total = len(self._model_shapes or state["model"])
                state["model"] = {k: v for k, v in state["model"].items() if k in shared}
                want = want - {"optimizer"}
                if self.comm.rank == 0:
                    logger.warning("checkpoint.partial_model_load: %d of this model's %d weights loaded from %s, "
                                   "%d keep their initial values; optimizer starts fresh (%s)", len(shared), total,
                                   path.name, total - len(shared), mismatch.split(": ", 1)[1].split(". Train with")[0])
        if "optimizer" in want:
            if not _present("optimizer", keys):
                raise CheckpointError(f"{path} has no optimizer state (a model-only checkpoint?)")
            # Read in the form it was written: param_groups keyed by parameter name (pipeline-parallel saves)
            # or as a list of groups (the others, and every checkpoint written before).
            self._optimizer_flat = _flat_optimizer(keys)
            state["optimizer"] = c.optimizer_state(flat=self._optimizer_flat)
        if "train_state" in want and _present("train_state", keys):
            state["train_state"] = TrainState().state_dict()
        if "callbacks" in want and "callbacks" in keys:
            state["callbacks"] = b""
        if "lr_scheduler" in want and _present("lr_scheduler", keys):
            state["lr_scheduler"] = {"step": 0, "lr": 0.0}
        rng_key = f"rng.rank_{self.comm.rank}"
        if "rng" in want and _present(rng_key, keys):
            state["rng"] = {f"rank_{self.comm.rank}": {k: v for k, v in c.rng_state().items()
                                                       if f"{rng_key}.{k}" in keys}}
        verify = marker is not None and self._verifies(marker) and not self.cfg.start_fresh_if_unloadable
        mine = share(list(marker.get("files") or {}), self.comm.rank, self.comm.world) if verify else []
        reader, hashed = _verifying_reader(path, marker["checksum"] if verify else "none", set(mine))
        try:
            if state:
                dcp.load(state, checkpoint_id=str(path), storage_reader=reader, process_group=self.comm.pg)
        except ERRORS:
            bad = verify_files(path, marker, mine) if verify else None  # a damaged file can break the read
            if bad:
                raise _Corrupt(bad) from None
            raise
        for name in mine:
            if name in hashed:
                bad = check_digest(name, marker, *hashed[name])
            else:  # not opened by this rank's reads (another rank's shards, the sidecars): read it now
                bad = verify_files(path, marker, [name])
            if bad:
                raise _Corrupt(bad)
        return state

    def _apply(self, state: dict, callbacks_state: Any, loader_state: Any) -> None:
        """Restore what was read. A failure here means the checkpoint does not fit this run (changed data,
        batch layout, callbacks), not that it is damaged: raised as :class:`_Incompatible`."""
        c = self.components
        entry = "model"
        try:
            if "model" in state:
                c.set_model_state(state["model"], strict=not self._partial)
            entry = "optimizer"
            c.set_optimizer_state(state.get("optimizer"), flat=self._optimizer_flat)
            entry = "train_state"
            if "train_state" in state:
                c.train_state.load_state_dict(state["train_state"])
            entry = "callbacks"
            if callbacks_state is not None:
                c.callbacks.load_state_dict(callbacks_state)
            entry = "dataloader"
            if loader_state is not None:
                load_loader_global_state(c.data_loader, loader_state)
        except ERRORS as e:
            hint = f" (add '{entry}' to checkpoint.exclude_from_loading to start it afresh)" if entry in (
                "dataloader", "callbacks", "optimizer") else ""
            raise _Incompatible(f"restoring '{entry}': {format_exception(e)}{hint}") from e

    def _report_load(self, path: Path, marker: dict, report: dict) -> None:
        """After all ranks loaded: one summary line (and the RNG count, an all-reduce)."""
        rng_ranks = self.comm.sum([int(report.get("rng", False))])[0]
        if self.comm.rank != 0:
            return
        ts, world = self.components.train_state, self.comm.world
        restored = report.get("restored", set())
        skipped = [k for k in STATE_KEYS if k not in restored and k != "rng"]
        if marker.get("kind", "full") == "full" and not rng_ranks:
            skipped.append("rng")
        logger.info("checkpoint %s loaded in %.2f s: step %d, %s tokens seen; RNG states restored on %d/%d ranks%s",
                    path, report.get("seconds", 0.0), ts.step, f"{ts.tokens_seen:,}", rng_ranks, world,
                    f"; not restored: {', '.join(skipped)}" if skipped else "")
        if 0 < rng_ranks < world:
            logger.warning("checkpoint %s was saved with %s ranks: RNG states restored on %d of %d ranks only",
                           path.name, marker.get("world_size", "?"), rng_ranks, world)
        if "lr_scheduler" in restored:
            self._check_schedule(marker, report.get("lr_scheduler"))

    def _check_schedule(self, marker: dict, saved: dict | None) -> None:
        step = int(marker.get("step", 0))
        old_len, new_len = marker.get("lr_schedule_steps"), self.components.schedule_steps()
        if old_len is not None and new_len is not None and old_len != new_len:
            # Extending a finished run (training.steps 10 -> 20) lengthens a decaying schedule: the steps
            # after the checkpoint then differ from a run that was this long from the start.
            logger.warning("the LR schedule was %d steps long in the saved run and is %d steps now (training.steps "
                           "or lr_scheduler.total_steps changed): from step %d on the learning rate follows the "
                           "%d-step schedule; set lr_scheduler.total_steps = %d to keep the saved one",
                           old_len, new_len, step + 1, new_len, old_len)
            return
        old_lr = (saved or {}).get("lr", marker.get("lr"))
        new_lr = self.components.lr_at(step)
        if old_lr and new_lr is not None and not math.isclose(old_lr, new_lr, rel_tol=1e-9, abs_tol=0.0):
            logger.warning("the learning rate at step %d was %.6g in the saved run and is %.6g with this config "
                           "(optimizer.lr, lr_scheduler or training.steps changed): training continues on the new "
                           "schedule", step, old_lr, new_lr)

    # ----------------------------------------------------------------------------------------------
    # initial_load_path
    # ----------------------------------------------------------------------------------------------

    def _initial_load(self) -> None:
        cfg = self.cfg
        path = Path(cfg.initial_load_path)
        if cfg.initial_load_in_hf:
            self._load_hf(path)
            return
        chosen = self.comm.broadcast(self._resolve_initial(path) if self.comm.rank == 0 else None)
        if isinstance(chosen, str):
            raise ConfigError(chosen)
        model_only = cfg.initial_load_model_only or chosen.marker.get("kind", "full") != "full"
        if not cfg.initial_load_model_only and model_only and self.comm.rank == 0:
            logger.warning("checkpoint.initial_load_path %s holds only model weights: optimizer starts fresh",
                           chosen.path)
        if not model_only:
            self._load_first([chosen], explicit=True)
            return
        reasons = self.comm.agree(self._verify(chosen))
        if not reasons:
            error = None
            try:
                self._load_checkpoint(chosen.path, chosen.marker, model_only=True, exclude=set(),
                                      restore_train_state=False)
            except _Incompatible as e:  # weights of another model: said as such, not as an exception type
                error = str(e)
            except _Corrupt as e:
                error = f"CORRUPT: {chosen.path.name}/{e}"
            except ERRORS as e:
                logger.debug("loading %s failed:\n%s", chosen.path, traceback.format_exc())
                error = format_exception(e)
            reasons = self.comm.agree(error)
        if reasons:
            raise CheckpointError(f"checkpoint.initial_load_path {chosen.path} could not be loaded: "
                                  + " | ".join(reasons))
        if self.comm.rank == 0:
            logger.info("initial weights loaded from %s (model only: fresh optimizer, step 0)", chosen.path)

    def _load_hf(self, path: Path) -> None:
        """Weights from a Hugging Face folder; each rank reads the slices it holds."""
        if not path.exists():
            raise ConfigError(f"checkpoint.initial_load_path: no such folder '{path}'")
        _, error = attempt(f"loading {path}", load_hf_weights, self.model_name, self.components.model_parts,
                           str(path))
        reasons = self.comm.agree(error)
        if reasons:
            raise CheckpointError(f"checkpoint.initial_load_path {path} (Hugging Face) could not be loaded: "
                                  + " | ".join(reasons))
        if self.comm.rank == 0:
            logger.info("initial weights loaded from the Hugging Face checkpoint %s", path)

    def _resolve_initial(self, path: Path) -> CheckpointInfo | str:
        """Rank 0: the checkpoint initial_load_path names (a step folder, or a folder of them), or the error."""
        if not path.exists():
            return f"checkpoint.initial_load_path: no such folder '{path}'"
        if (path / DCP_METADATA).exists() or (path / MARKER).exists():
            info = inspect_checkpoint(path)
            if info.complete:
                return info
            if not info.unmarked:
                return f"checkpoint.initial_load_path {path} is {info.status}: {info.reason}"
            # A DCP checkpoint written by another tool (no commit marker): DCP wrote its metadata last.
            logger.warning("checkpoint.initial_load_path %s has no commit marker (written by another tool?); "
                           "loading it as a model checkpoint", path)
            return dataclasses.replace(info, step=0, marker={"kind": "model_only", "step": 0})
        complete = [c for c in scan_folder(path) if c.complete]
        if not complete:
            return f"checkpoint.initial_load_path: no complete checkpoint in '{path}'"
        return complete[-1]
