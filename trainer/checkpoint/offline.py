"""Reading checkpoints in a single process without a process group: for ``trainer export/eval/generate``
and other tools.

A checkpoint is a DCP folder ``<dump_folder>/<checkpoint.folder>/step-N/`` whose state dict holds the
model weights under a top-level ``model`` entry (plain FQNs such as ``layers.0.attention.wq.weight``).
DCP reshards on load, so a checkpoint written by any parallel layout (FSDP, HSDP, TP, PP) loads here.
Besides the trainer's committed checkpoints, a finished plain ``dcp.save`` of another tool (DCP metadata,
no commit marker) is accepted. The architecture comes from the run's resolved
``<dump_folder>/config.toml`` (flavor, tokenizer), which callers may override; the vocabulary size is
taken from the checkpoint itself.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.layout import (
    DEFAULT_FOLDER,
    RUN_CONFIG,
    CheckpointInfo,
    checkpoint_folders,
    inspect_checkpoint,
    scan_folder,
    step_dirname,
)
from trainer.parallel import clean_fqn

logger = logging.getLogger("trainer")

# The keys of a run's config.toml the tools need. Only these are read, so that a config.toml written by an
# older or newer version of the trainer (keys added or renamed since) still loads.
RUN_CONFIG_KEYS = ("model.name", "model.flavor", "model.tokenizer_path", "model.vocab_size", "training.seq_len",
                   "checkpoint.folder")


class CheckpointNotFound(FileNotFoundError):
    """No usable checkpoint at the given path; the message says what was looked for."""


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
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointNotFound(f"checkpoint path does not exist: {p}")
    if _readable(inspect_checkpoint(p)):
        return p
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
                    f"no step-{step} in {folder}; available: {', '.join(str(c.step) for c in steps)}")
            if not _readable(match[0]):
                raise CheckpointNotFound(f"{match[0].path} is {match[0].status}: {match[0].reason}")
            return match[0].path
        readable = [c for c in steps if _readable(c)]
        if readable:
            if len(readable) < len(steps):
                skipped = [c.path.name for c in steps if not c.readable]
                logger.warning("skipping incomplete checkpoint(s) without .metadata: %s", ", ".join(skipped))
            return readable[-1].path
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


def save_native_checkpoint(state_dict: dict[str, torch.Tensor], dump_folder: str | Path, step: int,
                           config=None) -> Path:
    """Write ``{"model": state_dict}`` as ``<dump_folder>/checkpoint/step-<step>`` with plain DCP (single
    process, no commit marker) plus the run's ``config.toml`` when ``config`` (a JobConfig) is given.

    For tests and for turning weights from elsewhere (e.g. ``load_hf_state_dict``) into a checkpoint
    that ``trainer eval/generate/export`` and ``checkpoint.initial_load_path`` accept.
    """
    import torch.distributed.checkpoint as dcp

    dump = Path(dump_folder)
    dump.mkdir(parents=True, exist_ok=True)
    if config is not None:
        from trainer.config import to_toml

        (dump / RUN_CONFIG).write_text(to_toml(config))
    step_dir = dump / DEFAULT_FOLDER / step_dirname(step)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save({"model": dict(state_dict)}, storage_writer=dcp.FileSystemWriter(str(step_dir)))
    return step_dir


# --------------------------------------------------------------------------------------------------
# The model a checkpoint holds
# --------------------------------------------------------------------------------------------------


def load_run_config(config_path: Path | None, overrides: list[str]):
    """A JobConfig with the run's model/tokenizer keys (from its config.toml) and ``overrides`` applied."""
    from trainer.config import load_config

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    argv: list[str] = []
    if config_path is not None:
        try:
            data = tomllib.loads(Path(config_path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"cannot read the run config {config_path}: {e}") from None
        for key in RUN_CONFIG_KEYS:
            section, name = key.split(".")
            value = (data.get(section) or {}).get(name)
            if value is not None:
                argv += [f"--{key}={value}"]
    return load_config(argv + overrides, env={})


def _resolve_tokenizer_path(config, config_path: Path | None) -> str | None:
    path = config.model.tokenizer_path
    if not path:
        return None
    p = Path(path).expanduser()
    if p.exists() or p.is_absolute() or config_path is None:
        return str(p)
    # Relative to the directory training ran from, which we do not know: try next to the dump folder.
    for base in [config_path.parent, *config_path.parent.parents][:4]:
        if (base / p).exists():
            return str(base / p)
    return str(p)


@dataclass
class CheckpointDescription:
    """Everything needed to rebuild a checkpoint's model, without loading any weights."""

    step_dir: Path
    config: Any  # the run's JobConfig (with overrides applied)
    config_path: Path | None
    tokenizer: Any
    tokenizer_path: Path
    args: Any  # LlamaModelArgs, vocab from the checkpoint, max_seq_len = context length
    context_length: int


def describe_checkpoint(
    checkpoint: str | Path,
    *,
    config_path: str | Path | None = None,
    flavor: str | None = None,
    tokenizer_path: str | None = None,
    step: int | None = None,
) -> CheckpointDescription:
    """Locate the checkpoint and its run config; build the tokenizer and the model args.

    ``config_path`` defaults to the run's config.toml found above the checkpoint; ``flavor`` and
    ``tokenizer_path`` override it (without a config.toml ``flavor`` is required and the tokenizer
    defaults to the bundled debug tokenizer, as in training). The vocabulary size is the checkpoint's.
    """
    from tokenizer import DEBUG_TOKENIZER_PATH, build_tokenizer
    from trainer.models import get_model_args

    step_dir = find_checkpoint(checkpoint, step=step)
    cfg_path = Path(config_path) if config_path else find_run_config(step_dir)
    if cfg_path is None and flavor is None:
        raise CheckpointNotFound(
            f"no config.toml found above {step_dir}; pass the model flavor (--flavor) and tokenizer "
            "(--tokenizer) or the run's config (--config)")
    overrides = []
    if flavor:
        overrides += ["--model.flavor", flavor]
    if tokenizer_path:
        overrides += ["--model.tokenizer_path", tokenizer_path]
    config = load_run_config(cfg_path, overrides)
    tok_path = Path(_resolve_tokenizer_path(config, cfg_path) or DEBUG_TOKENIZER_PATH)
    tokenizer = build_tokenizer(tok_path)

    entries = checkpoint_model_entries(step_dir)
    emb = next((v for k, v in entries.items() if clean_fqn(k) == "model.tok_embeddings.weight"), None)
    if emb is None:
        raise CheckpointNotFound(f"{step_dir} has no tok_embeddings.weight in its model entry")
    vocab = int(emb.size[0])
    if vocab < tokenizer.vocab_size:
        raise ValueError(
            f"checkpoint vocabulary ({vocab} rows) is smaller than the tokenizer's ({tokenizer.vocab_size}) "
            f"from {tok_path}: wrong tokenizer?")
    try:
        base = get_model_args(config.model.name, config.model.flavor)
    except ValueError as e:
        raise ValueError(f"model flavor: {e}") from None
    context = max(base.max_seq_len, config.training.seq_len)
    args = dataclasses.replace(base, vocab_size=vocab, max_seq_len=context)
    return CheckpointDescription(step_dir=step_dir, config=config, config_path=cfg_path, tokenizer=tokenizer,
                                 tokenizer_path=tok_path, args=args, context_length=context)
