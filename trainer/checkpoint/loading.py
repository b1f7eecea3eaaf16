"""The resume policy: which checkpoint a run starts from, and what happens when one cannot be loaded.

A run resumes from the newest usable checkpoint of the dump folder (or ``checkpoint.load_step``), else
starts from ``checkpoint.initial_load_path`` (a checkpoint, or a Hugging Face folder). Rank 0 decides
which checkpoints to try (it scans the folder and reports what it finds); every rank then restores the
candidate with no collectives besides DCP's own (:mod:`trainer.checkpoint.restore`, verifying the
checksums of its share of the files from the bytes it reads), and all ranks agree on the outcome: on
damage (a checksum mismatch, a missing file, a read error) the previous checkpoint is loaded over it, on
a checkpoint that does not fit this run's config the run stops with the cause and a way out. When the
folder holds checkpoints and none can be loaded the run stops (exit 3) listing each with its reason,
unless ``checkpoint.start_fresh_if_unloadable`` says to start from scratch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
import traceback
from pathlib import Path

from trainer.checkpoint.agree import ERRORS, Collectives, attempt, format_exception
from trainer.checkpoint.integrity import share, verify_files
from trainer.checkpoint.layout import (
    DCP_METADATA,
    MARKER,
    CheckpointInfo,
    inspect_checkpoint,
    scan_folder,
    step_list,
)
from trainer.checkpoint.config import STATE_KEYS
from trainer.checkpoint.replicas import ReplicaGroup
from trainer.checkpoint.restore import (
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    Restorer,
    model_shapes,
    verifies,
)
from trainer.checkpoint.state import Components
from trainer.errors import CheckpointError, ConfigError
from trainer.models.hf import load_hf_weights

logger = logging.getLogger("trainer")


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
        self.restorer = Restorer(cfg, folder, components, comm, replica)

    def load(self, resume: bool) -> None:
        """Resume from the folder's latest complete checkpoint (or ``load_step``) when ``resume``, else or
        when there is none start from ``initial_load_path`` if set."""
        cfg = self.cfg
        if self.components.pp_degree > 1 and (resume or cfg.initial_load_path):
            # Each rank holds only its pipeline stages: compare the checkpoint with the whole model, so that
            # every rank takes the same decision (a rank refusing alone would leave the others waiting in
            # DCP's collectives). All ranks call this, before anything else of the load.
            parts = self.comm.gather(model_shapes(self.components.model_state()))
            self.restorer.whole_model_shapes = self.comm.broadcast(
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
                        f"in {self.folder}; complete ones: {step_list(c for c in complete if not c.final) or 'none'}")
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
            report = self.restorer.restore(c.path, c.marker, model_only=c.kind != "full",
                                           exclude=set(self.cfg.exclude_from_loading),
                                           verify=not self.cfg.start_fresh_if_unloadable)
            return report, None, False
        except IncompatibleCheckpoint as e:
            return {}, str(e), True
        except CorruptCheckpoint as e:
            return {}, f"CORRUPT: {c.path.name}/{e}", False
        except ERRORS as e:
            logger.debug("loading %s failed:\n%s", c.path, traceback.format_exc())
            return {}, format_exception(e), False

    def _verify(self, c: CheckpointInfo) -> str | None:
        """Before reading: this rank's share of ``c``'s files re-hashed against the marker's checksums; the
        reason if one fails (all ranks then agree on it before anything is read into the model). Only with
        checkpoint.start_fresh_if_unloadable, which needs the model untouched by a corrupt checkpoint;
        otherwise the files are verified from the bytes the load reads (:meth:`Restorer.restore`)."""
        if not verifies(self.cfg, c.marker) or not self.cfg.start_fresh_if_unloadable:
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
                self.restorer.restore(chosen.path, chosen.marker, model_only=True, exclude=set(),
                                      restore_train_state=False, verify=not self.cfg.start_fresh_if_unloadable)
            except IncompatibleCheckpoint as e:  # weights of another model: said as such, not as an exception type
                error = str(e)
            except CorruptCheckpoint as e:
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
