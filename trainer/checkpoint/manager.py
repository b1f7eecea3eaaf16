"""The checkpoint manager: one object the training loop talks to, over explicit stateful components.

Saving is in :mod:`trainer.checkpoint.saving`, loading in :mod:`trainer.checkpoint.loading`, the folder
layout in :mod:`trainer.checkpoint.layout`, and how ranks agree on an outcome in
:mod:`trainer.checkpoint.agree`. Everything that can go wrong is said: short disk space (checked before
each save), failed saves (counted in the metrics, the run stops after ``checkpoint.max_failed_saves`` in
a row), interrupted or corrupt checkpoints (reported and skipped in favour of the previous one).
"""

from __future__ import annotations

import datetime as _dt
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint.agree import Collectives
from trainer.checkpoint.layout import DATA_ONLY, scan_folder, step_dirname
from trainer.checkpoint.loading import Loader
from trainer.checkpoint.replicas import ReplicaGroup
from trainer.checkpoint.saving import Saver
from trainer.checkpoint.state import Components, TrainState
from trainer.errors import ConfigError

logger = logging.getLogger("trainer")


class CheckpointManager:
    """Saves, commits, retains and loads checkpoints of a training run.

    ``config`` is the run's JobConfig (its ``checkpoint`` section, ``job.dump_folder`` and
    ``training.steps`` are read). The state is given explicitly: ``model_parts`` (the model, or this
    rank's pipeline stages), the ``optimizer`` over all of them, ``lr_schedule`` (``lr(step)``), the
    training ``data_loader`` (``state_dict()``; merged over data-parallel ranks), the ``train_state``
    counters, ``callbacks`` (any ``state_dict()``/``load_state_dict()`` object), the ``device``, and where
    this rank sits: ``dp_rank``, ``pp_degree``, ``layout`` (a description for the marker) and
    ``num_params`` (the whole model, for the size estimate). ``replica``: this process's replica group in a
    fault-tolerant job (the checkpoint folder is then the job's, shared by its groups; see
    :mod:`trainer.checkpoint.replicas`).
    """

    def __init__(self, config, *, model_parts: list, optimizer: Any, train_state: TrainState, data_loader: Any,
                 callbacks: Any, device: torch.device, lr_schedule: Any = None, dp_rank: int = 0,
                 pp_degree: int = 1, layout: str = "", num_params: int | None = None,
                 replica: ReplicaGroup | None = None):
        self.cfg = cfg = config.checkpoint
        self.replica = replica
        self.folder = Path(replica.job_dump_folder if replica else config.job.dump_folder) / cfg.folder
        self.enabled = cfg.enable
        self.seed_created = False
        self.components = Components(
            model_parts=list(model_parts), optimizer=optimizer, train_state=train_state, data_loader=data_loader,
            callbacks=callbacks, device=device, lr_schedule=lr_schedule, dp_rank=dp_rank, pp_degree=pp_degree,
            layout=layout, num_params=num_params)
        if cfg.async_mode == "async_with_pinned_mem" and not self.components.use_cuda:
            logger.info("checkpoint.async_mode async_with_pinned_mem: pinned memory needs CUDA; the staging buffers "
                        "are ordinary CPU memory on this machine, still reused from save to save")
        pg, async_pg = self._new_groups()
        self.comm = Collectives(pg)
        self.saver = Saver(cfg, self.folder, self.components, self.comm, async_pg,
                           replica_groups=replica.group_size if replica else None)
        # A replica group's own part of the data stream, saved at the same steps (synchronously: it is small).
        self.data_saver = Saver(cfg, replica.folder(self.folder), self.components, self.comm) if replica else None
        self.loader = Loader(cfg, self.folder, self.components, self.comm, config.training.steps,
                             config.model.name, replica=replica)
        if self.enabled and cfg.async_mode != "disabled":
            # Background saves copy the state in the background (into reused buffers, or a fresh CPU copy):
            # wait for the copy before the optimizer changes the weights and moments it reads.
            optimizer.register_step_pre_hook(lambda *_: self.saver.wait_staging())

    def _new_groups(self) -> tuple[Any, Any]:
        """Dedicated gloo groups (every rank creates them, in the same order): one for coordination and
        DCP, one for background saves, with the checkpoint's own (long) timeout."""
        cfg = self.cfg
        if not (dist.is_available() and dist.is_initialized()):
            return None, None
        if not (cfg.enable or cfg.initial_load_path or cfg.create_seed_checkpoint):
            return None, None
        timeout = _dt.timedelta(seconds=cfg.timeout_seconds)
        pg = dist.new_group(backend="gloo", timeout=timeout)
        async_pg = dist.new_group(backend="gloo", timeout=timeout) if cfg.async_mode != "disabled" else None
        return pg, async_pg

    # What the loop, the benchmarks and the run summary read.
    @property
    def pending(self):
        """The background save whose outcome is not agreed yet, if any (its ``staging`` and ``upload``
        futures say how far its thread is)."""
        return self.saver.pending

    @property
    def saves(self) -> int:
        return self.saver.saves

    @property
    def failures(self) -> int:
        return self.saver.failures

    @property
    def consecutive_failures(self) -> int:
        return self.saver.consecutive_failures

    @property
    def loaded_step(self) -> int | None:
        """The step of the checkpoint this run resumed from (None: none loaded)."""
        return self.loader.loaded_step

    def metrics(self) -> dict[str, Any]:
        """Fields for the step record (``checkpoint_failures``: failed saves in this run so far)."""
        return {"checkpoint_failures": self.saver.failures} if self.enabled else {}

    def maybe_save(self, step: int, last: bool = False) -> None:
        """Called after every optimizer step: at every ``checkpoint.interval`` steps and at the last step,
        agrees on the outcome of the background save in flight (see :mod:`trainer.checkpoint.saving`)
        and saves."""
        if not self.enabled:
            return
        due = self.saver.due(step, last)
        if self.data_saver is not None and due:
            self.data_saver.save(step, kind=DATA_ONLY)
        self.saver.maybe_save(step, last, write=not due or self._writes_job_checkpoint())

    def _writes_job_checkpoint(self) -> bool:
        """Whether this process writes the full checkpoint of the step just taken: always, unless it is
        a replica group other than the lowest one taking part."""
        return self.replica is None or self.replica.saves_job_checkpoint()

    def save(self, step: int, kind: str = "full", dtype: torch.dtype | None = None, asynchronous: bool = False) -> bool:
        """Save ``step`` now (all ranks); see :meth:`Saver.save`."""
        return self.saver.save(step, kind=kind, dtype=dtype, asynchronous=asynchronous)

    def finish(self) -> None:
        """End of training: wait for a background save and commit it."""
        self.saver.finish()

    def save_for_preemption(self, step: int) -> bool:
        """Stopping on a signal (all ranks): wait for a background save, then save a full checkpoint of
        ``step`` unless this run has committed one already. True when ``step``'s checkpoint is committed."""
        self.finish()
        if self.data_saver is not None:
            if not self.data_saver.has_committed(step):
                self.data_saver.save(step, kind=DATA_ONLY)
            if not self._writes_job_checkpoint():
                return self.data_saver.has_committed(step)
        if not self.saver.has_committed(step):
            self.save(step, kind="full")
        return self.saver.has_committed(step)

    def load(self) -> None:
        """Resume from the dump folder's latest complete checkpoint (or ``load_step``), else start from
        ``initial_load_path`` if set; ``create_seed_checkpoint`` saves step 0 instead."""
        if self.cfg.create_seed_checkpoint:
            self._create_seed()
            return
        self.loader.load(resume=self.enabled)
        self.saver.note_loaded(self.loader.loaded_step, verified=self.cfg.verify_on_load,
                               damaged=self.loader.failed_steps)
        if self.enabled and self.comm.rank == 0:
            self.saver.space.report(self.components.full_checkpoint_bytes())

    def _create_seed(self) -> None:
        if any(c.complete for c in scan_folder(self.folder)):
            raise ConfigError(f"checkpoint.create_seed_checkpoint: {self.folder} already holds checkpoints")
        self.enabled = True
        self.saver.save(0, kind="seed", dtype=torch.float32, asynchronous=False)
        self.seed_created = True
        logger.info("seed checkpoint written to %s; start training runs with this dump folder (or point "
                    "checkpoint.initial_load_path at it)", self.folder / step_dirname(0))
