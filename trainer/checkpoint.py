"""Checkpoints: save and resume the whole training state with ``torch.distributed.checkpoint`` (DCP).

On disk, under ``<job.dump_folder>/<checkpoint.folder>/``::

    step-40/                  a committed checkpoint: complete, the only kind that is ever loaded
        .metadata             DCP metadata (global shapes, which file holds which shard)
        __0_0.distcp ...      DCP data, one file per writing rank
        dataloader.json       the merged (layout-free) data-loader state, written by rank 0
        checkpoint.json       the commit marker, written last: step, tokens, kind, files and their sizes
    step-60.tmp/              a save in progress, or one interrupted by a crash (ignored, removed on start)

What a checkpoint holds (the DCP entries; other tools load ``{"model": sd}`` from any of them):

* ``model``: the weights under their plain names (``tok_embeddings.weight``, ``layers.0.attention.wq.weight``
  ...), as DTensors where the run shards them, so a checkpoint loads under any other layout;
* ``optimizer``: AdamW state keyed by the same names (absent in model-only checkpoints);
* ``train_state``: step, tokens seen, skipped steps; ``callbacks``: the callbacks' state (pickled);
* ``lr_scheduler``: nothing to restore, the schedule is a pure function of the step; the step and the
  learning rate it gave are recorded so a resume can warn when the schedule has changed;
* ``rng.rank_<r>``: each rank's torch CPU (and CUDA) generator states;
* ``dataloader.json`` (a sidecar): the global data-loader state, which re-partitions over any number of
  data-parallel ranks.

A save is atomic: every rank writes into ``step-N.tmp``, the ranks agree (all-reduce) that all of them
succeeded, then rank 0 writes the marker and renames the folder to ``step-N``. Loading considers only
folders named ``step-N`` whose marker lists files that are all present with their recorded sizes.
Everything that can go wrong is said: short disk space (checked before each save), failed saves
(counted in the metrics, the run stops after ``checkpoint.max_failed_saves`` in a row), interrupted or
corrupt checkpoints (reported and skipped in favour of the previous one).

``python -m trainer.checkpoint list|inspect PATH`` (``trainer checkpoint ...``) reads the markers and
DCP metadata without a process group.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import inspect as _inspect
import io
import json
import logging
import math
import os
import re
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.parallel import clean_fqn

logger = logging.getLogger("trainer")

FORMAT_VERSION = 1
MARKER = "checkpoint.json"
DATALOADER_JSON = "dataloader.json"
DATALOADER_PT = "dataloader.pt"
DCP_METADATA = ".metadata"
TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".replaced"
_NAME_RE = re.compile(r"^step-(\d+)(\.tmp|\.replaced)?$")

# State entries a checkpoint holds; checkpoint.exclude_from_loading may name any of them.
STATE_KEYS = ("model", "optimizer", "lr_scheduler", "train_state", "callbacks", "dataloader", "rng")
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LOOKAHEAD_SAVES = 3  # warn when this many upcoming saves would not fit

try:  # DCP's CheckpointException derives from BaseException, not Exception
    from torch.distributed.checkpoint.api import CheckpointException as _DCPException
except ImportError:  # pragma: no cover
    _DCPException = Exception
_ERRORS = (Exception, _DCPException)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded and the run must stop (a non-zero exit)."""


class _Incompatible(Exception):
    """A checkpoint was read but does not fit this run's config (not damage: older ones would not fit
    either)."""


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    # Set by CheckpointManager.load() to the step a run resumed from (None: started fresh); not saved.
    resumed_from_step: int | None = None
    _skipped: int = 0
    _pending_skips: torch.Tensor | None = None  # skips decided on the device and not read yet

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was skipped. Reading it reads the device counter (log steps and saves only)."""
        if self._pending_skips is not None:
            self._skipped += int(self._pending_skips.item())
            self._pending_skips = None
        return self._skipped

    def add_skip(self, skip: bool | torch.Tensor) -> None:
        """Count a skip known on the host (bool) or decided on the device (0-d bool), without a host read."""
        if isinstance(skip, torch.Tensor):
            skip = skip.long()
            self._pending_skips = skip if self._pending_skips is None else self._pending_skips + skip
        else:
            self._skipped += int(skip)

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])
        self._skipped, self._pending_skips = int(sd["skipped_steps"]), None


# --------------------------------------------------------------------------------------------------
# Folder scanning and validation (no process group needed: also used by the command line)
# --------------------------------------------------------------------------------------------------


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    status: str  # "complete", "incomplete" (an interrupted save), "corrupt"
    reason: str = ""
    marker: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.marker.get("kind", "?")

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    @property
    def has_optimizer(self) -> bool:
        return self.complete and self.kind == "full"


def validate_checkpoint(path: Path) -> tuple[str, str, dict]:
    """(status, reason, marker) of a committed ``step-N`` folder: complete only when the commit marker is
    readable and every file it lists is present with its recorded size."""
    path = Path(path)
    marker_path = path / MARKER
    if not marker_path.is_file():
        what = "DCP metadata present" if (path / DCP_METADATA).exists() else "no DCP metadata"
        return "incomplete", f"no commit marker {MARKER} ({what}): not written by a finished save", {}
    try:
        marker = json.loads(marker_path.read_text())
    except (OSError, ValueError) as e:
        return "corrupt", f"commit marker unreadable: {e}", {}
    if not isinstance(marker, dict) or marker.get("format") != FORMAT_VERSION:
        return "corrupt", f"commit marker has an unknown format ({marker.get('format') if isinstance(marker, dict) else marker!r})", {}
    m = _NAME_RE.match(path.name)
    if m and int(m.group(1)) != marker.get("step"):
        return "corrupt", f"commit marker says step {marker.get('step')}, the folder is {path.name}", marker
    files = marker.get("files") or {}
    if DCP_METADATA not in files:
        return "corrupt", "commit marker lists no DCP metadata", marker
    for name, size in files.items():
        f = path / name
        try:
            actual = f.stat().st_size
        except OSError:
            return "corrupt", f"{name} is missing", marker
        if actual != size:
            return "corrupt", f"{name} has {actual} bytes, {size} were written (truncated or overwritten)", marker
    return "complete", "", marker


def scan_folder(folder: Path) -> list[CheckpointInfo]:
    """Every ``step-N``-like entry of a checkpoint folder, oldest first (committed ones validated)."""
    folder = Path(folder)
    out: list[CheckpointInfo] = []
    if not folder.is_dir():
        return out
    for entry in folder.iterdir():
        m = _NAME_RE.match(entry.name)
        if not m or not entry.is_dir():
            continue
        step = int(m.group(1))
        if m.group(2) == TMP_SUFFIX:
            out.append(CheckpointInfo(entry, step, "incomplete", "interrupted save (never committed)"))
        elif m.group(2) == OLD_SUFFIX:
            out.append(CheckpointInfo(entry, step, "incomplete", "left over from replacing a checkpoint"))
        else:
            status, reason, marker = validate_checkpoint(entry)
            out.append(CheckpointInfo(entry, step, status, reason, marker))
    out.sort(key=lambda c: (c.step, c.path.name))
    return out


def tree_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# --------------------------------------------------------------------------------------------------
# DCP plumbing
# --------------------------------------------------------------------------------------------------


def _global_nbytes(obj: Any) -> tuple[int, int]:
    """(bytes, tensor count) of the tensors in a (nested) state dict, at their global (unsharded) sizes:
    what the whole checkpoint holds, whichever rank writes it."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return math.prod(obj.shape) * obj.element_size(), 1
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size(), 1
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        total = count = 0
        for v in obj:
            b, c = _global_nbytes(v)
            total += b
            count += c
        return total, count
    if isinstance(obj, (bytes, bytearray)):
        return len(obj), 1
    return 0, 0


def estimate_checkpoint_bytes(state: dict) -> int:
    """Bytes a save of ``state`` writes: tensor data plus DCP's per-item framing and metadata."""
    data, items = _global_nbytes(state)
    return data + items * 3072 + (1 << 16)


def _pickle_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpickle_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _make_writer_class():
    from torch.distributed.checkpoint import FileSystemWriter

    class DrillWriter(FileSystemWriter):
        """FileSystemWriter plus the fault drills (checkpoint.drill_*): a slow save, a failing save."""

        def __init__(self, path, *, delay_s: float = 0.0, fail: bool = False, **kwargs):
            super().__init__(path, **kwargs)
            self._delay_s = delay_s
            self._fail = fail

        def write_data(self, plan, planner):
            if self._delay_s > 0:
                time.sleep(self._delay_s)
            if self._fail:
                raise OSError(f"fault drill: injected write failure (checkpoint.drill_fail_save_steps) in {self.path}")
            return super().write_data(plan, planner)

    return DrillWriter


def _metadata_keys(path: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata.keys())


def _present(prefix: str, keys: set[str]) -> bool:
    return prefix in keys or any(k.startswith(prefix + ".") for k in keys)


def _format_exception(e: BaseException) -> str:
    """One line per failing rank for DCP's CheckpointException, else ``Type: message``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, wrapped in sorted(failures.items()):
            exc = wrapped[0] if isinstance(wrapped, tuple) else getattr(wrapped, "exc", wrapped)
            parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        return "; ".join(parts)
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}".strip()


def merge_model_parts(parts: list) -> torch.nn.Module:
    """One module whose attribute tree joins several pipeline stages (each a copy of the model keeping
    some of its blocks), so parameters keep their full-model names: stage 0's ``layers.0`` and stage
    1's ``layers.3`` become ``layers.0`` and ``layers.3`` of the view. Shares, never copies, the stages'
    modules and parameters."""
    from torch import nn

    root = nn.Module()
    for part in parts:
        for name, param in part.named_parameters(recurse=False):
            if hasattr(root, name):
                raise CheckpointError(f"parameter {name} appears in two model parts")
            root.register_parameter(name, param)
    names: list[str] = []
    for part in parts:
        names += [n for n, _ in part.named_children() if n not in names]
    for name in names:
        children = [c for part in parts if (c := getattr(part, name, None)) is not None]
        if len(children) == 1:
            root.add_module(name, children[0])
        elif all(isinstance(c, nn.ModuleDict) for c in children):
            merged = nn.ModuleDict()
            for c in children:
                for key, module in c.items():
                    if key in merged:
                        raise CheckpointError(f"module {name}.{key} appears in two model parts")
                    merged[key] = module
            root.add_module(name, merged)
        else:
            root.add_module(name, merge_model_parts(children))
    return root


# --------------------------------------------------------------------------------------------------
# Data loader state (merged over data-parallel ranks so it loads under any layout)
# --------------------------------------------------------------------------------------------------


def _data_module():
    import trainer.data as data_mod

    return data_mod


def merge_loader_states(loader, states: list) -> Any:
    fn = getattr(loader, "merge_states", None) or getattr(_data_module(), "merge_states", None)
    if fn is None:
        raise CheckpointError("the data loader provides no merge_states(): its state cannot be checkpointed")
    return fn(states)


def load_loader_global_state(loader, global_state: Any) -> None:
    fn = getattr(loader, "load_global_state", None)
    if fn is not None:
        fn(global_state)
        return
    fn = getattr(_data_module(), "load_global_state", None)
    if fn is None:
        raise CheckpointError("the data loader provides no load_global_state(): its state cannot be restored")
    fn(loader, global_state)


# --------------------------------------------------------------------------------------------------
# The manager
# --------------------------------------------------------------------------------------------------


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


class CheckpointManager:
    """Saves, commits, retains and loads checkpoints for a :class:`trainer.train.Trainer`."""

    def __init__(self, config, trainer):
        self.config = config
        self.cfg = cfg = config.checkpoint
        self.trainer = trainer
        self.folder = Path(config.job.dump_folder) / cfg.folder
        self.enabled = cfg.enable
        self.initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.initialized else 0
        self.world = dist.get_world_size() if self.initialized else 1
        self.failures = 0  # failed saves in this run (metrics: checkpoint_failures)
        self.consecutive_failures = 0
        self.saves = 0
        self.seed_created = False
        self.loaded_step: int | None = None
        self.pending: _Pending | None = None
        self._stager = None
        self._staging_future = None
        self._warned_fit: int | None = None
        self._writer_cls = None
        self._merged = None

        unknown = [k for k in cfg.exclude_from_loading if k not in STATE_KEYS]
        if unknown:
            from trainer.config import ConfigError

            raise ConfigError(f"checkpoint.exclude_from_loading: unknown entries {unknown}; valid: {list(STATE_KEYS)}")
        if cfg.initial_load_in_hf and not cfg.initial_load_path:
            from trainer.config import ConfigError

            raise ConfigError("checkpoint.initial_load_in_hf needs checkpoint.initial_load_path (the Hugging Face folder)")

        self.async_mode = cfg.async_mode
        self.use_cuda = trainer.device.type == "cuda" if hasattr(trainer, "device") else torch.cuda.is_available()
        if self.async_mode == "async_with_pinned_mem" and not self.use_cuda:
            logger.info("checkpoint.async_mode async_with_pinned_mem: pinned memory needs CUDA; staging to "
                        "ordinary CPU memory on this machine")

        # Dedicated gloo groups: checkpoint coordination must not share a communicator with training
        # collectives (nor, for asynchronous saves, with the background writer thread), and writing a big
        # checkpoint may outlast the training collectives' short timeout.
        self.pg = self.async_pg = None
        if self.initialized and (cfg.enable or cfg.initial_load_path or cfg.create_seed_checkpoint):
            timeout = _dt.timedelta(seconds=cfg.timeout_seconds)
            self.pg = dist.new_group(backend="gloo", timeout=timeout)
            if self.async_mode != "disabled":
                self.async_pg = dist.new_group(backend="gloo", timeout=timeout)
        if self.enabled and self.async_mode == "async_with_pinned_mem" and self.use_cuda:
            # Asynchronous staging into reused pinned buffers: wait for the copy before the optimizer
            # changes the weights it reads.
            trainer.optimizer.register_step_pre_hook(lambda *_: self._wait_staging())

    # ----------------------------------------------------------------------------------------------
    # Collectives (all ranks call these in the same order)
    # ----------------------------------------------------------------------------------------------

    def _sum(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        if self.initialized and self.world > 1:
            dist.all_reduce(t, group=self.pg)
        return [int(v) for v in t.tolist()]

    def _broadcast(self, obj: Any) -> Any:
        if not (self.initialized and self.world > 1):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def _gather(self, obj: Any) -> list | None:
        if not (self.initialized and self.world > 1):
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.pg)
        return out

    # ----------------------------------------------------------------------------------------------
    # Metrics
    # ----------------------------------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """Fields for the step record (``checkpoint_failures``: failed saves in this run so far)."""
        return {"checkpoint_failures": self.failures} if self.enabled else {}

    # ----------------------------------------------------------------------------------------------
    # State dicts
    # ----------------------------------------------------------------------------------------------

    def _parts(self) -> list:
        return list(getattr(self.trainer, "model_parts", None) or [self.trainer.model])

    def _model(self):
        """The model, or a view of this rank's pipeline stages as one module with the original names
        (the optimizer spans all of them)."""
        if self._merged is None:
            parts = self._parts()
            self._merged = parts[0] if len(parts) == 1 else merge_model_parts(parts)
        return self._merged

    def _model_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        sd: dict = {}
        for part in self._parts():
            for k, v in get_model_state_dict(part).items():
                k = clean_fqn(k)
                if k in sd:
                    raise CheckpointError(f"parameter {k} appears in two model parts")
                sd[k] = v
        return sd

    def _set_model_state(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        parts = self._parts()
        if len(parts) == 1:
            set_model_state_dict(parts[0], sd)
            return
        for part in parts:
            names = {clean_fqn(k) for k in part.state_dict()}
            set_model_state_dict(part, {k: v for k, v in sd.items() if k in names},
                                 options=StateDictOptions(strict=True))

    def _optimizer_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self._model(), self.trainer.optimizer)

    def _rng_state(self) -> dict:
        rng = {"cpu": torch.get_rng_state()}
        if self.use_cuda:
            rng["cuda"] = torch.cuda.get_rng_state(self.trainer.device)
        return rng

    def _lr_at(self, step: int) -> float | None:
        sched = getattr(self.trainer, "lr_schedule", None)
        return float(sched.lr(step)) if sched is not None and step > 0 else None

    def _save_state(self, step: int, model_only: bool, dtype: torch.dtype | None) -> dict:
        t = self.trainer
        model = self._model_state()
        if dtype is not None:
            model = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.items()}
        state: dict[str, Any] = {"model": model, "train_state": t.state.state_dict()}
        if not model_only:
            state["optimizer"] = self._optimizer_state()
            # The schedule is a pure function of the step: nothing to restore. Recorded to detect changes.
            state["lr_scheduler"] = {"step": step, "lr": self._lr_at(step) or 0.0}
            state["callbacks"] = _pickle_bytes(t.callbacks.state_dict())
            state["rng"] = {f"rank_{self.rank}": self._rng_state()}
        return state

    # ----------------------------------------------------------------------------------------------
    # Disk space
    # ----------------------------------------------------------------------------------------------

    def _free_bytes(self) -> int:
        if self.cfg.drill_disk_bytes >= 0:
            used = tree_size(self.folder) if self.folder.exists() else 0
            return max(0, self.cfg.drill_disk_bytes - used)
        p = self.folder
        while not p.exists() and p != p.parent:
            p = p.parent
        return shutil.disk_usage(p).free

    def _committed(self) -> list[CheckpointInfo]:
        return [c for c in scan_folder(self.folder) if c.complete]

    def _space_needed(self, nbytes: int, saves: int, existing: int) -> int:
        """Extra bytes the next ``saves`` saves need at their peak (a new checkpoint is written before the
        oldest is deleted)."""
        k = self.cfg.keep_latest_k
        if k <= 0:
            return nbytes * saves
        return nbytes * max(1, min(existing + saves - 1, k) + 1 - existing)

    def _check_space(self, step: int, nbytes: int) -> str | None:
        """None when the save fits (warning if the next few may not); else the reason to refuse it."""
        free = self._free_bytes()
        need = int(nbytes * 1.02) + (1 << 20)
        if free < need:
            return (f"not enough disk space for checkpoint step-{step}: it needs about {human_bytes(need)} and "
                    f"{self.folder} has {human_bytes(free)} free. Free up space, lower checkpoint.keep_latest_k "
                    f"(now {self.cfg.keep_latest_k}) or set checkpoint.folder to a larger filesystem, then restart: "
                    f"the run resumes from the latest complete checkpoint")
        existing = len(self._committed()) if self.rank == 0 else 0
        fits = 0
        for n in range(1, _LOOKAHEAD_SAVES + 1):
            if self._space_needed(need, n, existing) <= free:
                fits = n
        if fits < _LOOKAHEAD_SAVES and self.rank == 0 and fits != self._warned_fit:
            self._warned_fit = fits
            logger.warning(
                "checkpoint disk space is running out: %s free in %s, each checkpoint takes about %s; only the "
                "next %d save(s) will fit (keep_latest_k=%d). Free up space or lower checkpoint.keep_latest_k",
                human_bytes(free), self.folder, human_bytes(need), fits, self.cfg.keep_latest_k)
        return None

    # ----------------------------------------------------------------------------------------------
    # Saving
    # ----------------------------------------------------------------------------------------------

    def maybe_save(self, step: int, last: bool = False) -> None:
        """Called after every optimizer step: finishes a background save that has completed, and saves
        at every ``checkpoint.interval`` steps and at the last step."""
        if not self.enabled:
            return
        if self.pending is not None:
            self._poll(block=last or step % self.cfg.interval == 0)
        if last:
            model_only = self.cfg.last_save_model_only
            dtype = EXPORT_DTYPES[self.cfg.export_dtype] if model_only else None
            self.save(step, kind="model_only" if model_only else "full", dtype=dtype, asynchronous=False)
        elif step % self.cfg.interval == 0:
            self.save(step, kind="full", asynchronous=self.async_mode != "disabled")

    def finish(self) -> None:
        """End of training: wait for a background save and commit it."""
        if self.pending is not None:
            self._poll(block=True)
        if self._stager is not None:
            try:
                self._stager.close()
            except _ERRORS as e:  # pragma: no cover - cleanup only
                logger.debug("closing the checkpoint stager: %s", e)
            self._stager = None

    def save(self, step: int, kind: str = "full", dtype: torch.dtype | None = None, asynchronous: bool = False) -> bool:
        """Save ``step`` (all ranks). Returns whether it was committed (a synchronous save) or started (an
        asynchronous one). Failures are counted and raise :class:`CheckpointError` once
        ``checkpoint.max_failed_saves`` happen in a row."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}{TMP_SUFFIX}"
        model_only = kind != "full"
        self._wait_staging()
        state = self._save_state(step, model_only, dtype)
        # Every rank counts its entries at their global sizes; ranks of one pipeline stage count the same
        # ones, so the sum over ranks divided by the ranks per stage is the whole checkpoint.
        pp = getattr(getattr(self.trainer, "dims", None), "pp", 1)
        nbytes = self._sum([estimate_checkpoint_bytes(state)])[0] * pp // self.world

        # Rank 0 clears a stale temporary folder of this step before anyone writes into it; the
        # all-reduce below is also the barrier that orders this.
        problem = None
        if self.rank == 0:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
            except OSError as e:
                problem = f"cannot prepare {tmp}: {e}"
        problem = problem or self._check_space(step, nbytes)
        if self._sum([int(problem is not None)])[0]:
            return self._failed(step, tmp, problem or "refused on another rank (see its log)", refused=True)

        marker = {
            "format": FORMAT_VERSION, "step": step, "kind": kind,
            "dtype": str(dtype).replace("torch.", "") if dtype is not None else "as trained",
            "tokens_seen": self.trainer.state.tokens_seen, "skipped_steps": self.trainer.state.skipped_steps,
            "lr": self._lr_at(step), "world_size": self.world,
            "layout": self.trainer.dims.describe() if hasattr(self.trainer, "dims") else "",
            "estimated_bytes": nbytes, "torch": torch.__version__,
        }
        local = None if model_only else self._write_dataloader_state(tmp, marker)
        if self._sum([int(local is not None)])[0]:
            return self._failed(step, tmp, local or "data-loader state failed on another rank", refused=False)

        writer = self._writer(tmp, step)
        if asynchronous:
            stager = None
            try:
                upload, staging, stager = self._async_save(state, writer)
            except _ERRORS as e:
                local = _format_exception(e)
                logger.debug("async checkpoint save failed:\n%s", traceback.format_exc())
            if self._sum([int(local is not None)])[0]:
                return self._failed(step, tmp, local or "failed on another rank", refused=False)
            self.pending = _Pending(step, tmp, final, marker, upload, staging, t0, time.perf_counter() - t0,
                                    stager if stager is not self._stager else None)
            return True
        try:
            dcp.save(state, storage_writer=writer, process_group=self.pg)
        except _ERRORS as e:
            local = _format_exception(e)
            logger.debug("checkpoint save failed:\n%s", traceback.format_exc())
        del state
        return self._finish_save(step, tmp, final, marker, local, t0, time.perf_counter() - t0)

    def _writer(self, tmp: Path, step: int):
        if self._writer_cls is None:
            self._writer_cls = _make_writer_class()
        fail = step in self.cfg.drill_fail_save_steps and self.rank == self.world - 1
        delay = self.cfg.drill_save_delay_s if self.rank == 0 else 0.0
        return self._writer_cls(str(tmp), delay_s=delay, fail=fail)

    def _async_save(self, state: dict, writer):
        import torch.distributed.checkpoint as dcp

        kwargs: dict[str, Any] = {"storage_writer": writer, "process_group": self.async_pg}
        params = _inspect.signature(dcp.async_save).parameters
        stager = self._make_stager()
        if stager is not None and "async_stager" in params:
            kwargs["async_stager"] = stager
        result = dcp.async_save(state, **kwargs)
        if hasattr(result, "upload_completion"):  # AsyncSaveResponse: staging runs in the background too
            self._staging_future = result.staging_completion
            return result.upload_completion, result.staging_completion, kwargs.get("async_stager")
        return result, None, kwargs.get("async_stager")

    def _make_stager(self):
        """The staging API (torch >= 2.9): reused pinned buffers and background copies on CUDA with
        async_with_pinned_mem; a plain synchronous copy to CPU memory otherwise."""
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError:
            return None
        pinned = self.async_mode == "async_with_pinned_mem" and self.use_cuda
        try:
            if pinned:
                if self._stager is None:
                    self._stager = DefaultStager(StagingOptions(
                        use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                        use_non_blocking_copy=True))
                return self._stager
            # A fresh stager per save: a plain copy to CPU memory, freed once the save is written.
            return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                use_async_staging=False, use_non_blocking_copy=False))
        except (TypeError, AssertionError, RuntimeError) as e:  # another torch version's options
            logger.warning("checkpoint staging API unavailable (%s); using DCP's default staging", e)
            return None

    def _wait_staging(self) -> None:
        fut = self._staging_future
        if fut is not None:
            self._staging_future = None
            try:
                fut.result()
            except _ERRORS:
                pass  # reported with the upload's result

    def _poll(self, block: bool) -> None:
        """Finish the background save if it is done on every rank (or wait for it when ``block``)."""
        p = self.pending
        if block:
            try:
                p.upload.result()
            except _ERRORS:
                pass
        done = self._sum([int(p.upload.done())])[0]
        if done < self.world:
            return
        self.pending = None
        local = None
        try:
            p.upload.result()
        except _ERRORS as e:
            local = _format_exception(e)
        if p.stager is not None:
            try:
                p.stager.close()
            except _ERRORS as e:  # pragma: no cover - cleanup only
                logger.debug("closing a checkpoint stager: %s", e)
        self._finish_save(p.step, p.tmp, p.final, p.marker, local, p.t0, p.blocking_s)

    def _finish_save(self, step: int, tmp: Path, final: Path, marker: dict, local: str | None, t0: float,
                     blocking_s: float) -> bool:
        """After DCP wrote (or failed to write) ``tmp``: rank 0 commits when its own save succeeded (DCP's
        coordinator succeeds only if every rank did), then all ranks agree on the outcome."""
        if local is None and self.rank == 0:
            try:
                marker["save_seconds"] = round(time.perf_counter() - t0, 3)
                marker["blocking_seconds"] = round(blocking_s, 3)
                self._commit(tmp, final, marker)
            except _ERRORS as e:
                local = f"commit failed: {_format_exception(e)}"
        if self._sum([int(local is not None)])[0]:
            return self._failed(step, tmp, local, refused=False)
        self.consecutive_failures = 0
        self.saves += 1
        if self.rank == 0:
            logger.info("checkpoint step-%d saved: %s%s in %.2f s (training blocked %.2f s) -> %s",
                        step, human_bytes(marker.get("bytes", 0)),
                        "" if marker["kind"] == "full" else f", {marker['kind']} {marker['dtype']}",
                        time.perf_counter() - t0, blocking_s, final)
            self._retain()
        return True

    def _write_dataloader_state(self, tmp: Path, marker: dict) -> str | None:
        """Gather the per-rank loader states, merge them (rank 0) and write the sidecar; the error, if any.
        Every rank takes part in the gather whatever happens locally."""
        local: Any = None
        error = None
        try:
            local = (int(getattr(self.trainer, "dp_rank", 0)), self.trainer.train_loader.state_dict())
        except _ERRORS as e:
            error = f"data-loader state: {_format_exception(e)}"
        gathered = self._gather(local)
        if self.rank != 0 or error is not None:
            return error
        try:
            if any(g is None for g in gathered):
                return "data-loader state: not available on another rank (see its log)"
            by_dp: dict[int, Any] = {}
            for dp_rank, sd in gathered:
                by_dp.setdefault(dp_rank, sd)
            states = [by_dp[r] for r in sorted(by_dp)]
            global_state = merge_loader_states(self.trainer.train_loader, states)
            tmp.mkdir(parents=True, exist_ok=True)
            try:
                data = json.dumps(global_state).encode()
                name = DATALOADER_JSON
            except (TypeError, ValueError):
                data = _pickle_bytes(global_state)
                name = DATALOADER_PT
            _write_file_atomic(tmp / name, data)
        except _ERRORS as e:
            logger.debug("data-loader state:\n%s", traceback.format_exc())
            return f"data-loader state: {_format_exception(e)}"
        marker["dataloader"] = name
        marker["dataloader_dp_ranks"] = len(states)
        return None

    def _commit(self, tmp: Path, final: Path, marker: dict) -> None:
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file() and p.name != MARKER}
        if DCP_METADATA not in files:
            raise CheckpointError(f"{tmp} has no DCP metadata after the save")
        marker["files"] = files
        marker["bytes"] = sum(files.values())
        marker["saved_at"] = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
        _write_file_atomic(tmp / MARKER, json.dumps(marker, indent=1).encode())
        _fsync_dir(tmp)
        old = None
        if final.exists():  # the same step saved again (e.g. a resumed run passing it once more)
            old = final.with_name(final.name + OLD_SUFFIX)
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _retain(self) -> None:
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        committed = self._committed()
        if len(committed) <= k:
            return
        keep_from = committed[-k].step
        for c in scan_folder(self.folder):
            if c.step < keep_from and not c.path.name.endswith(TMP_SUFFIX):
                shutil.rmtree(c.path, ignore_errors=True)
                logger.info("checkpoint %s deleted (keep_latest_k=%d)", c.path.name, k)

    def _failed(self, step: int, tmp: Path, reason: str | None, refused: bool) -> bool:
        """A failed (or refused) save, agreed by all ranks: report it, clean up, count it, maybe stop."""
        reasons = self._gather(reason)
        self.failures += 1
        self.consecutive_failures += 1
        if self.rank == 0:
            causes = sorted({r for r in reasons if r})
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
            except OSError as e:
                causes.append(f"(could not remove {tmp}: {e})")
            latest = [c.path.name for c in self._committed()]
            logger.error(
                "checkpoint step-%d %s: %s. Failed saves: %d in this run, %d in a row (checkpoint.max_failed_saves"
                "=%d). Latest complete checkpoint: %s", step, "refused" if refused else "FAILED", " | ".join(causes),
                self.failures, self.consecutive_failures, self.cfg.max_failed_saves, latest[-1] if latest else "none")
        if self.consecutive_failures >= self.cfg.max_failed_saves:
            first = next((r for r in reasons if r), reason) if reasons else reason
            raise CheckpointError(
                f"stopping after {self.consecutive_failures} failed checkpoint save(s) in a row "
                f"(checkpoint.max_failed_saves={self.cfg.max_failed_saves}); last: step-{step}: {first}")
        return False

    # ----------------------------------------------------------------------------------------------
    # Loading
    # ----------------------------------------------------------------------------------------------

    def load(self) -> None:
        """Resume from the dump folder's latest complete checkpoint (or ``load_step``), else start from
        ``initial_load_path`` if set; ``create_seed_checkpoint`` saves step 0 instead."""
        cfg = self.cfg
        if cfg.create_seed_checkpoint:
            self._create_seed()
            return
        candidates: list[CheckpointInfo] = []
        if self.enabled:
            candidates = self._broadcast(self._choose_candidates() if self.rank == 0 else None)
            if isinstance(candidates, str):  # an error decided by rank 0
                raise CheckpointError(candidates)
        elif cfg.load_step >= 0 and self.rank == 0:
            logger.warning("checkpoint.load_step=%d is ignored: checkpoint.enable is false", cfg.load_step)
        if candidates:
            if cfg.initial_load_path and self.rank == 0:
                logger.info("checkpoint.initial_load_path is ignored: %s holds checkpoints to resume from",
                            self.folder)
            self._load_first(candidates, explicit=cfg.load_step >= 0)
        elif cfg.initial_load_path:
            self._initial_load()
        if self.enabled and self.rank == 0:
            self._report_space()

    def _choose_candidates(self) -> list[CheckpointInfo] | str:
        """Rank 0: report what the folder holds and order the checkpoints to try (newest usable first)."""
        infos = scan_folder(self.folder)
        for c in infos:
            if c.status == "incomplete" and c.path.name.endswith((TMP_SUFFIX, OLD_SUFFIX)):
                logger.warning("checkpoint %s is incomplete (%s): ignored and removed", c.path.name, c.reason)
                shutil.rmtree(c.path, ignore_errors=True)
            elif not c.complete:
                logger.error("checkpoint %s is %s (%s): skipped", c.path.name, c.status.upper(), c.reason)
        complete = [c for c in infos if c.complete]
        if self.cfg.load_step >= 0:
            chosen = [c for c in complete if c.step == self.cfg.load_step]
            if not chosen:
                return (f"checkpoint.load_step={self.cfg.load_step}: no complete checkpoint step-{self.cfg.load_step} "
                        f"in {self.folder}; complete ones: {[c.step for c in complete] or 'none'}")
            return chosen
        if not complete:
            return []
        complete.reverse()  # newest first
        newest = complete[0]
        steps = self.config.training.steps
        if newest.kind != "full" and 0 < newest.step < steps:
            full = [c for c in complete if c.kind == "full"]
            if not full:
                return (f"the newest checkpoint {newest.path} holds only model weights ({newest.kind}), so training "
                        f"cannot continue exactly from it, and no earlier checkpoint has optimizer state. Continue "
                        f"from its weights with a new job.dump_folder and checkpoint.initial_load_path={newest.path} "
                        f"(optimizer restarts), or keep full final saves with checkpoint.last_save_model_only=false")
            logger.warning("checkpoint %s holds only model weights (a final export, checkpoint.last_save_model_only); "
                           "resuming from %s, the newest one with optimizer state", newest.path.name, full[0].path.name)
            return full
        if newest.kind != "full":
            # A seed checkpoint (step 0) or a finished run's export: weights only, then fall back to full ones.
            return [newest] + [c for c in complete[1:] if c.kind == "full"]
        return [c for c in complete if c.kind == "full" or c.step == 0]

    def _load_first(self, candidates: list[CheckpointInfo], explicit: bool) -> None:
        errors = []
        for c in candidates:
            report: dict = {}
            incompatible = False
            try:
                report = self._load_checkpoint(c.path, c.marker, model_only=c.kind != "full",
                                               exclude=set(self.cfg.exclude_from_loading))
                local = None
            except _Incompatible as e:
                local, incompatible = str(e), True
            except _ERRORS as e:
                local = _format_exception(e)
                logger.debug("loading %s failed:\n%s", c.path, traceback.format_exc())
            failed, incompatible_ranks = self._sum([int(local is not None), int(incompatible)])
            if incompatible_ranks:
                reasons = self._gather(local)
                msg = " | ".join(sorted({r for r in (reasons or []) if r}))
                raise CheckpointError(f"checkpoint {c.path} does not fit this run's config: {msg}")
            if not failed:
                self.loaded_step = c.step
                if "train_state" in report.get("restored", ()) and self.trainer.state.step > 0:
                    self.trainer.state.resumed_from_step = self.trainer.state.step  # not for a seed
                self._report_load(c.path, c.marker, report)
                return
            reasons = self._gather(local)
            msg = " | ".join(sorted({r for r in (reasons or []) if r})) or "failed on another rank"
            errors.append(f"{c.path.name}: {msg}")
            if self.rank == 0:
                logger.error("checkpoint %s could not be loaded (%s)%s", c.path.name, msg,
                             "" if explicit else "; trying the previous one")
            if explicit:
                break
        raise CheckpointError("no checkpoint could be loaded: " + "; ".join(errors) +
                              ". Move the folder aside to start from scratch, or pick one with checkpoint.load_step")

    def _load_checkpoint(self, path: Path, marker: dict, model_only: bool, exclude: set[str],
                         restore_train_state: bool = True) -> dict:
        """Load one checkpoint into the trainer on this rank (no collectives besides DCP's own, so that a
        rank that fails here cannot leave the others waiting). Raises on any problem; everything is read
        before the trainer's non-tensor state is touched. Returns what was restored, for the report."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        t0 = time.perf_counter()
        t = self.trainer
        keys = _metadata_keys(path)
        want = set(STATE_KEYS) - exclude
        if model_only:
            want &= {"model", "train_state"}
        if not restore_train_state:
            want &= {"model", "optimizer"}
        state: dict[str, Any] = {}
        if "model" in want:
            if not _present("model", keys):
                raise CheckpointError(f"{path} has no 'model' entry")
            state["model"] = self._model_state()
        if "optimizer" in want:
            if not _present("optimizer", keys):
                raise CheckpointError(f"{path} has no optimizer state (a model-only checkpoint?)")
            state["optimizer"] = self._optimizer_state()
        if "train_state" in want and _present("train_state", keys):
            state["train_state"] = TrainState().state_dict()
        if "callbacks" in want and "callbacks" in keys:
            state["callbacks"] = b""
        if "lr_scheduler" in want and _present("lr_scheduler", keys):
            state["lr_scheduler"] = {"step": 0, "lr": 0.0}
        rng_key = f"rng.rank_{self.rank}"
        if "rng" in want and _present(rng_key, keys):
            state["rng"] = {f"rank_{self.rank}": {k: v for k, v in self._rng_state().items()
                                                  if f"{rng_key}.{k}" in keys}}
        if state:
            dcp.load(state, checkpoint_id=str(path), process_group=self.pg)

        # Everything was read: now apply it. A failure from here on means the checkpoint does not fit
        # this run (changed data, batch layout, callbacks), not that it is damaged.
        loader_state = None
        if "dataloader" in want and marker.get("dataloader"):
            f = path / marker["dataloader"]
            loader_state = json.loads(f.read_text()) if f.suffix == ".json" else _unpickle_bytes(f.read_bytes())
        callbacks_state = _unpickle_bytes(state["callbacks"]) if "callbacks" in state else None
        entry = "model"
        try:
            if "model" in state:
                self._set_model_state(state["model"])
            entry = "optimizer"
            if "optimizer" in state:
                set_optimizer_state_dict(self._model(), t.optimizer, state["optimizer"])
            else:
                t.optimizer.state.clear()  # fresh, never half-loaded by an earlier failed attempt
            entry = "train_state"
            if "train_state" in state:
                t.state.load_state_dict(state["train_state"])
            entry = "callbacks"
            if callbacks_state is not None:
                t.callbacks.load_state_dict(callbacks_state)
            entry = "dataloader"
            if loader_state is not None:
                load_loader_global_state(t.train_loader, loader_state)
        except _ERRORS as e:
            hint = f" (add '{entry}' to checkpoint.exclude_from_loading to start it afresh)" if entry in (
                "dataloader", "callbacks", "optimizer") else ""
            raise _Incompatible(f"restoring '{entry}': {_format_exception(e)}{hint}") from e
        if "rng" in state:
            rng = state["rng"][f"rank_{self.rank}"]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and self.use_cuda:
                torch.cuda.set_rng_state(rng["cuda"], t.device)
        restored = set(state) - {"rng"} | ({"dataloader"} if loader_state is not None else set())
        return {"restored": restored, "rng": "rng" in state, "seconds": time.perf_counter() - t0,
                "lr_scheduler": state.get("lr_scheduler")}

    def _report_load(self, path: Path, marker: dict, report: dict) -> None:
        """After all ranks loaded: one summary line (and the RNG count, an all-reduce)."""
        rng_ranks = self._sum([int(report.get("rng", False))])[0]
        if self.rank != 0:
            return
        t = self.trainer
        restored = report.get("restored", set())
        skipped = [k for k in STATE_KEYS if k not in restored and k != "rng"]
        if marker.get("kind", "full") == "full" and not rng_ranks:
            skipped.append("rng")
        logger.info("checkpoint %s loaded in %.2f s: step %d, %s tokens seen; RNG states restored on %d/%d ranks%s",
                    path, report.get("seconds", 0.0), t.state.step, f"{t.state.tokens_seen:,}", rng_ranks, self.world,
                    f"; not restored: {', '.join(skipped)}" if skipped else "")
        if 0 < rng_ranks < self.world:
            logger.warning("checkpoint %s was saved with %s ranks: RNG states restored on %d of %d ranks only",
                           path.name, marker.get("world_size", "?"), rng_ranks, self.world)
        if "lr_scheduler" in restored:
            self._check_schedule(marker, report.get("lr_scheduler"))

    def _check_schedule(self, marker: dict, saved: dict | None) -> None:
        step = int(marker.get("step", 0))
        old_lr = (saved or {}).get("lr", marker.get("lr"))
        new_lr = self._lr_at(step)
        if old_lr and new_lr is not None and not math.isclose(old_lr, new_lr, rel_tol=1e-9, abs_tol=0.0):
            logger.warning("the learning rate at step %d was %.6g in the saved run and is %.6g with this config "
                           "(optimizer.lr, lr_scheduler or training.steps changed): training continues on the new "
                           "schedule", step, old_lr, new_lr)

    def _initial_load(self) -> None:
        cfg = self.cfg
        path = Path(cfg.initial_load_path)
        if cfg.initial_load_in_hf:
            try:
                from torchtitan_ext.hf import load_hf_into
            except ImportError:
                from trainer.config import ConfigError

                raise ConfigError("checkpoint.initial_load_in_hf: loading Hugging Face weights needs "
                                  "torchtitan_ext.hf.load_hf_into, which this installation does not have yet") from None
            if not path.exists():
                from trainer.config import ConfigError

                raise ConfigError(f"checkpoint.initial_load_path: no such folder '{path}'")
            local = None
            try:
                load_hf_into(self._parts(), str(path))
            except _ERRORS as e:
                local = _format_exception(e)
                logger.debug("loading %s failed:\n%s", path, traceback.format_exc())
            if self._sum([int(local is not None)])[0]:
                reasons = self._gather(local)
                raise CheckpointError(f"checkpoint.initial_load_path {path} (Hugging Face) could not be loaded: "
                                      + " | ".join(sorted({r for r in (reasons or []) if r})))
            if self.rank == 0:
                logger.info("initial weights loaded from the Hugging Face checkpoint %s", path)
            return
        chosen = self._broadcast(self._resolve_initial(path) if self.rank == 0 else None)
        if isinstance(chosen, str):
            from trainer.config import ConfigError

            raise ConfigError(chosen)
        target, marker = chosen
        model_only = cfg.initial_load_model_only or marker.get("kind", "full") != "full"
        if not cfg.initial_load_model_only and model_only and self.rank == 0:
            logger.warning("checkpoint.initial_load_path %s holds only model weights: optimizer starts fresh", target)
        if model_only:
            self._load_initial_weights(Path(target), marker)
        else:
            self._load_first([CheckpointInfo(Path(target), int(marker.get("step", 0)), "complete", "", marker)],
                             explicit=True)

    def _load_initial_weights(self, target: Path, marker: dict) -> None:
        local = None
        try:
            self._load_checkpoint(target, marker, model_only=True, exclude=set(), restore_train_state=False)
        except _ERRORS as e:
            local = _format_exception(e)
            logger.debug("loading %s failed:\n%s", target, traceback.format_exc())
        if self._sum([int(local is not None)])[0]:
            reasons = self._gather(local)
            raise CheckpointError(f"checkpoint.initial_load_path {target} could not be loaded: "
                                  + " | ".join(sorted({r for r in (reasons or []) if r})))
        if self.rank == 0:
            logger.info("initial weights loaded from %s (model only: fresh optimizer, step 0)", target)

    def _resolve_initial(self, path: Path) -> tuple[str, dict] | str:
        """Rank 0: the checkpoint folder initial_load_path names (a step folder, or a folder of them)."""
        if not path.exists():
            return f"checkpoint.initial_load_path: no such folder '{path}'"
        if (path / DCP_METADATA).exists() or (path / MARKER).exists():
            status, reason, marker = validate_checkpoint(path)
            if status == "complete":
                return str(path), marker
            if (path / MARKER).exists() or not (path / DCP_METADATA).exists():
                return f"checkpoint.initial_load_path {path} is {status}: {reason}"
            # A DCP checkpoint written by another tool (no commit marker): DCP wrote its metadata last.
            logger.warning("checkpoint.initial_load_path %s has no commit marker (written by another tool?); "
                           "loading it as a model checkpoint", path)
            return str(path), {"kind": "model_only", "step": 0}
        complete = [c for c in scan_folder(path) if c.complete]
        if not complete:
            return f"checkpoint.initial_load_path: no complete checkpoint in '{path}'"
        return str(complete[-1].path), complete[-1].marker

    def _create_seed(self) -> None:
        from trainer.config import ConfigError

        if self.world != 1:
            raise ConfigError(f"checkpoint.create_seed_checkpoint runs on one process (NGPU=1), not {self.world}")
        if any(c.complete for c in scan_folder(self.folder)):
            raise ConfigError(f"checkpoint.create_seed_checkpoint: {self.folder} already holds checkpoints")
        self.enabled = True
        self.save(0, kind="seed", dtype=torch.float32, asynchronous=False)
        self.seed_created = True
        logger.info("seed checkpoint written to %s; start training runs with this dump folder (or point "
                    "checkpoint.initial_load_path at it)", self.folder / "step-0")

    def _report_space(self) -> None:
        """At start: the size of one checkpoint and whether the folder can hold the ones to keep."""
        num_params = getattr(self.trainer, "num_params", None)  # the whole model (all pipeline stages)
        if num_params:
            params = num_params * 4
        else:
            params = sum(math.prod(p.shape) * p.element_size() for p in self._model().parameters())
        nbytes = 3 * params + (1 << 20)  # float32 weights and AdamW's two moments
        try:
            free = self._free_bytes()
        except OSError as e:
            logger.warning("cannot measure free disk space for %s: %s", self.folder, e)
            return
        existing = len(self._committed())
        logger.info("checkpoints: about %s each, %s free in %s, every %d steps, keeping %s", human_bytes(nbytes),
                    human_bytes(free), self.folder, self.cfg.interval,
                    f"the latest {self.cfg.keep_latest_k}" if self.cfg.keep_latest_k else "all")
        needed = self._space_needed(nbytes, _LOOKAHEAD_SAVES, existing)
        if free < needed:
            self._warned_fit = sum(self._space_needed(nbytes, n, existing) <= free for n in range(1, _LOOKAHEAD_SAVES + 1))
            logger.warning("checkpoint disk space is short: %s free in %s but the next %d saves need about %s",
                           human_bytes(free), self.folder, _LOOKAHEAD_SAVES, human_bytes(needed))


# --------------------------------------------------------------------------------------------------
# Command line: trainer checkpoint list|inspect
# --------------------------------------------------------------------------------------------------


def _resolve_folder(path: Path) -> Path:
    """A checkpoint folder from a path that is one, or a dump folder holding one."""
    if any(_NAME_RE.match(p.name) for p in path.iterdir() if p.is_dir()):
        return path
    folder_name = "checkpoint"
    cfg = path / "config.toml"
    if cfg.is_file():
        try:
            import tomllib
        except ImportError:  # pragma: no cover - Python 3.10
            import tomli as tomllib
        try:
            folder_name = tomllib.loads(cfg.read_text()).get("checkpoint", {}).get("folder", folder_name)
        except (OSError, ValueError):
            pass
    return path / folder_name


def _list(args) -> int:
    path = Path(args.path)
    if not path.is_dir():
        print(f"error: no such folder: {path}", file=sys.stderr)
        return 1
    folder = _resolve_folder(path)
    infos = scan_folder(folder)
    rows = []
    for c in infos:
        m = c.marker
        size = m.get("bytes") if c.complete else tree_size(c.path)
        rows.append({"name": c.path.name, "step": c.step, "status": c.status, "kind": m.get("kind", "-"),
                     "tokens_seen": m.get("tokens_seen"), "bytes": size, "saved_at": m.get("saved_at", "-"),
                     "layout": m.get("layout", "-"), "reason": c.reason, "path": str(c.path)})
    if args.json:
        print(json.dumps({"folder": str(folder), "checkpoints": rows}, indent=1))
        return 0
    if not rows:
        print(f"no checkpoints in {folder}")
        return 0
    print(f"checkpoints in {folder}:")
    header = f"{'step':>8}  {'status':<10}  {'kind':<10}  {'tokens':>14}  {'size':>10}  saved at"
    print(header)
    for r in rows:
        tokens = f"{r['tokens_seen']:,}" if isinstance(r["tokens_seen"], int) else "-"
        line = (f"{r['step']:>8}  {r['status']:<10}  {r['kind']:<10}  {tokens:>14}  {human_bytes(r['bytes']):>10}  "
                f"{r['saved_at']}")
        if r["reason"]:
            line += f"  ({r['name']}: {r['reason']})"
        print(line)
    latest = [r for r in rows if r["status"] == "complete"]
    full = [r for r in latest if r["kind"] == "full"]
    if not latest:
        print("no complete checkpoint: a run would start from scratch")
    elif latest[-1]["kind"] == "full" or not full:
        print(f"a run with this dump folder resumes from step {latest[-1]['step']}")
    else:
        print(f"step {latest[-1]['step']} holds only weights ({latest[-1]['kind']}): a run with this dump folder "
              f"and more training.steps resumes from step {full[-1]['step']}, the newest with optimizer state")
    return 0


def _inspect_cmd(args) -> int:
    path = Path(args.path)
    if not path.is_dir():
        print(f"error: no such folder: {path}", file=sys.stderr)
        return 1
    if not _NAME_RE.match(path.name) and not (path / MARKER).exists() and not (path / DCP_METADATA).exists():
        infos = [c for c in scan_folder(_resolve_folder(path)) if c.complete]
        if not infos:
            print(f"error: no complete checkpoint under {path}", file=sys.stderr)
            return 1
        path = infos[-1].path
    status, reason, marker = validate_checkpoint(path)
    out: dict[str, Any] = {"path": str(path), "status": status, "reason": reason, "marker": marker}
    entries: dict[str, Any] = {}
    try:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        md = FileSystemReader(str(path)).read_metadata()
        for key, value in md.state_dict_metadata.items():
            if isinstance(value, TensorStorageMetadata):
                entries[key] = {"shape": list(value.size), "dtype": str(value.properties.dtype).replace("torch.", "")}
            else:
                entries[key] = {"object": True}
    except _ERRORS as e:
        out["metadata_error"] = _format_exception(e)
        if status == "complete":
            status = out["status"] = "corrupt"
            out["reason"] = f"DCP metadata unreadable: {out['metadata_error']}"
    groups: dict[str, dict[str, int]] = {}
    for key, v in entries.items():
        g = groups.setdefault(key.split(".", 1)[0], {"entries": 0, "tensors": 0, "elements": 0})
        g["entries"] += 1
        if "shape" in v:
            g["tensors"] += 1
            g["elements"] += math.prod(v["shape"])
    out["groups"] = groups
    if args.keys:
        out["entries"] = entries
    if args.json:
        print(json.dumps(out, indent=1))
        return 0 if status == "complete" else 1
    print(f"{path}: {status.upper()}" + (f" ({out['reason']})" if out["reason"] else ""))
    for k in ("step", "kind", "dtype", "tokens_seen", "skipped_steps", "lr", "layout", "world_size", "saved_at",
              "save_seconds", "torch", "dataloader"):
        if k in marker:
            print(f"  {k:<14} {marker[k]}")
    if "bytes" in marker:
        print(f"  {'size':<14} {human_bytes(marker['bytes'])} in {len(marker.get('files', {}))} files")
    if "metadata_error" in out:
        print(f"  DCP metadata unreadable: {out['metadata_error']}")
    for name, g in groups.items():
        extra = f", {g['elements']:,} elements" if g["tensors"] else ""
        print(f"  [{name}] {g['entries']} entries, {g['tensors']} tensors{extra}")
    if args.keys:
        for key, v in entries.items():
            print(f"    {key}  " + (f"{v['dtype']} {v['shape']}" if "shape" in v else "(object)"))
    return 0 if status == "complete" else 1


def main(argv: list[str] | None = None) -> int:
    """``trainer checkpoint list PATH`` / ``trainer checkpoint inspect PATH``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="trainer checkpoint", description="List and inspect checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="the checkpoints of a dump folder or checkpoint folder")
    p.add_argument("path", help="a job.dump_folder or its checkpoint folder")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("inspect", help="one checkpoint: its marker, completeness and contents")
    p.add_argument("path", help="a step-N folder (or a dump folder: its latest complete checkpoint)")
    p.add_argument("--keys", action="store_true", help="list every entry with its shape and dtype")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    try:
        return _list(args) if args.command == "list" else _inspect_cmd(args)
    except BrokenPipeError:  # pragma: no cover - e.g. piped into head
        return 0


if __name__ == "__main__":
    sys.exit(main())
