"""Reading checkpoints in a single process without a process group: for ``trainer export/eval/generate``
and other tools.

A checkpoint is a DCP folder ``<dump_folder>/<checkpoint.folder>/step-N/`` whose state dict holds the
model weights under a top-level ``model`` entry (plain FQNs such as ``layers.0.attention.wq.weight``).
DCP reshards on load, so a checkpoint written by any parallel layout (FSDP, HSDP, TP, PP) loads here.
Besides the trainer's committed checkpoints, a finished plain ``dcp.save`` of another tool (DCP metadata,
no commit marker) is accepted. Every checkpoint handed to a reader is verified first, as the trainer's
loader does (:func:`verify_checkpoint`: each file re-hashed against the checksum in its commit marker),
so no tool exports, evaluates or samples from damaged weights. The architecture comes from the run's resolved
``<dump_folder>/config.toml`` (flavor, tokenizer), which callers may override; the vocabulary size is
taken from the checkpoint itself.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.integrity import verify_files
from trainer.checkpoint.layout import (
    RUN_CONFIG,
    CheckpointInfo,
    checkpoint_folders,
    inspect_checkpoint,
    scan_folder,
    step_list,
)
from trainer.errors import CheckpointError
from trainer.parallel import clean_fqn

logger = logging.getLogger("trainer")

class CheckpointNotFound(FileNotFoundError):
    """No usable checkpoint at the given path; the message says what was looked for."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint whose files fail the checksums recorded in its commit marker (exit code 3)."""


def verify_checkpoint(info: CheckpointInfo) -> str | None:
    """Re-hash ``info``'s files against its commit marker, as the trainer does before loading (the same
    :func:`trainer.checkpoint.integrity.verify_files`). None when they match or there is nothing to check
    (another tool's DCP save has no marker), else the reason naming the first bad file."""
    if not info.complete or not info.marker.get("files"):
        return None
    return verify_files(info.path, info.marker)


def _verified(info: CheckpointInfo) -> Path:
    """``info``'s path once its checksums match; :class:`CheckpointCorrupt` otherwise."""
    bad = verify_checkpoint(info)
    if bad:
        raise CheckpointCorrupt(f"checkpoint {info.path} is CORRUPT: {bad}; nothing was read from it "
                                "(`trainer checkpoint verify` checks every checkpoint of a run)")
    return info.path


def _readable(info: CheckpointInfo) -> bool:
    """Whether DCP can load ``info`` (saying so when its commit marker shows damage)."""
    if info.status == "corrupt":
        logger.warning("checkpoint %s is %s: %s", info.path, info.status, info.reason)
    return info.readable


def find_checkpoint(path: str | Path, step: int | None = None) -> Path:
    """Resolve ``path`` to one complete DCP step folder.

    ``path`` may be a step folder (contains ``.metadata``), a checkpoint folder holding ``step-N``
    folders (the latest complete one is taken, or ``step``), or a dump folder with a ``checkpoint/``
    subfolder (or the folder named in its config.toml).

    The checkpoint returned has been verified (:func:`verify_checkpoint`). A named one (a step folder, or
    ``step``) that fails raises :class:`CheckpointCorrupt`; when choosing the latest, a damaged one is
    reported and the previous one taken, as a resuming run does (:class:`CheckpointCorrupt` if none passes).
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointNotFound(f"checkpoint path does not exist: {p}")
    info = inspect_checkpoint(p)
    if _readable(info):
        return _verified(info)
    if not p.is_dir():
        raise CheckpointNotFound(f"{p} is not a DCP checkpoint folder (no .metadata next to it)")
    for folder in checkpoint_folders(p):
        steps = [c for c in scan_folder(folder) if not c.leftover]
        if not steps:
            continue
        if step is not None:
            match = [c for c in steps if c.step == step]
            if not match:
                raise CheckpointNotFound(
                    f"no step-{step} in {folder}; available: {step_list(steps)}")
            if not _readable(match[0]):
                raise CheckpointNotFound(f"{match[0].path} is {match[0].status}: {match[0].reason}")
            return _verified(match[0])
        readable = [c for c in steps if _readable(c)]
        if readable:
            if len(readable) < len(steps):
                skipped = [c.path.name for c in steps if not c.readable]
                logger.warning("skipping incomplete checkpoint(s) without .metadata: %s", ", ".join(skipped))
            damaged = []
            for c in reversed(readable):  # newest first; the checksums of one checkpoint are read at a time
                bad = verify_checkpoint(c)
                if bad is None:
                    return c.path
                damaged.append(f"{c.path.name}: {bad}")
                logger.error("checkpoint %s is CORRUPT (%s): trying the previous one", c.path, bad)
            raise CheckpointCorrupt(f"no checkpoint in {folder} passes its checksums: {'; '.join(damaged)}")
        raise CheckpointNotFound(
            f"{folder} has step folders ({', '.join(c.path.name for c in steps)}) but none is complete "
            "(no .metadata file)")
    raise CheckpointNotFound(
        f"no checkpoint found at {p}: expected a DCP step folder (with .metadata), a folder of step-N "
        "folders, or a dump folder containing checkpoint/step-N")


def find_run_config(step_dir: Path) -> Path | None:
    """The run's config.toml: next to the checkpoint folder's parent (the dump folder), or above."""
    for parent in list(step_dir.resolve().parents)[:3]:
        cfg = parent / RUN_CONFIG
        if cfg.is_file():
            return cfg
    return None


def checkpoint_model_entries(step_dir: Path) -> dict[str, Any]:
    """``{flattened DCP key: TensorStorageMetadata}`` of the checkpoint's model weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
    entries = {k: v for k, v in metadata.state_dict_metadata.items()
               if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    if not entries:
        keys = sorted({k.split(".", 1)[0] for k in metadata.state_dict_metadata})
        raise CheckpointNotFound(
            f"{step_dir} holds no model weights (no 'model' entry; top-level entries: {', '.join(keys)})")
    return entries


def load_checkpoint_state_dict(step_dir: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model weights of a DCP checkpoint as a plain ``{fqn: tensor}`` dict on CPU.

    Tensors keep the checkpoint's dtype unless ``dtype`` is given. Works in a single process without a
    process group, whatever layout wrote the checkpoint.
    """
    import torch.distributed.checkpoint as dcp

    step_dir = Path(step_dir)
    entries = checkpoint_model_entries(step_dir)
    flat = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in entries.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(flat, storage_reader=dcp.FileSystemReader(str(step_dir)))
    out = {}
    for key, tensor in flat.items():
        out[clean_fqn(key[len("model."):])] = tensor if dtype is None else tensor.to(dtype)
    return out
