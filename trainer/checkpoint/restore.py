"""Restoring one checkpoint into the run's components on this rank: which entries to read, whether the
saved model fits this one, the read itself (:mod:`trainer.checkpoint.reader`, verifying the checksums
from the bytes it reads), then the non-tensor state applied once everything was read.

What to do when a checkpoint cannot be restored (try the previous one, stop, start fresh) is the resume
policy's, in :mod:`trainer.checkpoint.loading`: here a damaged checkpoint raises
:class:`CorruptCheckpoint`, one that does not fit this run's config :class:`IncompatibleCheckpoint`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from trainer.checkpoint.agree import ERRORS, Collectives, format_exception
from trainer.checkpoint.config import STATE_KEYS
from trainer.checkpoint.integrity import check_digest, share, verify_files
from trainer.checkpoint.reader import checkpoint_entries, checkpoint_reader
from trainer.checkpoint.replicas import ReplicaGroup, group_data_state, job_data_state, read_data_state
from trainer.checkpoint.state import (
    Components,
    TrainState,
    load_loader_global_state,
    read_loader_file,
    unpickle_bytes,
)
from trainer.errors import CheckpointError
from trainer.parallel import clean_fqn

logger = logging.getLogger("trainer")


def verifies(cfg, marker: dict) -> bool:
    """Whether loading checks ``marker``'s checksums (checkpoint.verify_on_load, and it has some)."""
    return cfg.verify_on_load and marker.get("checksum", "none") != "none"


class CorruptCheckpoint(Exception):
    """A checkpoint's files do not match the checksums of its commit marker (found while loading it)."""


class IncompatibleCheckpoint(Exception):
    """A checkpoint was read but does not fit this run's config (not damage: older ones would not fit
    either)."""


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


class Restorer:
    """Restores one checkpoint at a time into ``components`` (see the module's docstring). ``folder`` is
    the run's checkpoint folder (a fault-tolerant job's replica groups keep their data states under it).
    ``whole_model_shapes``: the whole model's shapes, set when a rank holds only some pipeline stages, so that
    every rank decides the same about the fit."""

    def __init__(self, cfg, folder: Path, components: Components, comm: Collectives,
                 replica: ReplicaGroup | None = None):
        self.cfg = cfg
        self.folder = folder
        self.components = components
        self.comm = comm
        self.replica = replica  # a fault-tolerant job's replica group: its data state is in its own folder
        self.whole_model_shapes: dict | None = None
        self._optimizer_flat = False  # the form of the optimizer state being read (see _flat_optimizer)
        self._partial = False  # the model was loaded partially (checkpoint.partial_model_load)

    def restore(self, path: Path, marker: dict, model_only: bool, exclude: set[str], restore_train_state: bool = True,
                verify: bool = True) -> dict:
        """Load one checkpoint into the components on this rank (no collectives besides DCP's own, so that
        a rank that fails here cannot leave the others waiting). Raises on any problem; everything is read
        before the non-tensor state is touched. Returns what was restored, for the report. ``verify``: check
        the marker's checksums from the bytes read (False when the files were verified before reading)."""
        t0 = time.perf_counter()
        want = set(STATE_KEYS) - exclude
        if model_only:
            want &= {"model", "train_state"}
        if not restore_train_state:
            want &= {"model", "optimizer"}
        state = self._read(path, want, marker, verify)
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
                raise IncompatibleCheckpoint(str(e)) from None
        return read_loader_file(path / marker["dataloader"]) if marker.get("dataloader") else None

    def _read(self, path: Path, want: set[str], marker: dict, verify: bool) -> dict[str, Any]:
        """The DCP entries of ``want`` that ``path`` holds, read into this run's (sharded) state; with
        checksums (``marker``'s, when ``verify`` and verify_on_load) this rank's share of the files is verified
        from the bytes read, and :class:`CorruptCheckpoint` raised on a mismatch before anything else is
        restored."""
        import torch.distributed.checkpoint as dcp

        c = self.components
        entries = checkpoint_entries(path)
        keys = set(entries)
        state: dict[str, Any] = {}
        self._partial = False
        if "model" in want:
            if not _present("model", keys):
                raise CheckpointError(f"{path} has no 'model' entry")
            state["model"] = c.model_state()
            mismatch, shared = compare_model(self.whole_model_shapes or model_shapes(state["model"]), entries)
            if mismatch and not self.cfg.partial_model_load:
                raise IncompatibleCheckpoint(mismatch)  # not damage: every checkpoint of this run fails alike
            if mismatch:
                # Asked for by name: the shared weights only; the optimizer's moments belong to the old
                # model, so it starts fresh.
                self._partial = True
                total = len(self.whole_model_shapes or state["model"])
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
        verify = verify and verifies(self.cfg, marker)
        mine = share(list(marker.get("files") or {}), self.comm.rank, self.comm.world) if verify else []
        reader, hashed = checkpoint_reader(path, marker["checksum"] if verify else "none", set(mine))
        try:
            if state:
                dcp.load(state, checkpoint_id=str(path), storage_reader=reader, process_group=self.comm.pg)
        except ERRORS:
            bad = verify_files(path, marker, mine) if verify else None  # a damaged file can break the read
            if bad:
                raise CorruptCheckpoint(bad) from None
            raise
        for name in mine:
            if name in hashed:
                bad = check_digest(name, marker, *hashed[name])
            else:  # not opened by this rank's reads (another rank's shards, the sidecars): read it now
                bad = verify_files(path, marker, [name])
            if bad:
                raise CorruptCheckpoint(bad)
        return state

    def _apply(self, state: dict, callbacks_state: Any, loader_state: Any) -> None:
        """Restore what was read. A failure here means the checkpoint does not fit this run (changed data,
        batch layout, callbacks), not that it is damaged: raised as :class:`IncompatibleCheckpoint`."""
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
            raise IncompatibleCheckpoint(f"restoring '{entry}': {format_exception(e)}{hint}") from e
