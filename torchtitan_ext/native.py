"""Load a native (DCP) checkpoint into a plain, unsharded model on one process.

Used by ``trainer export``, ``trainer eval --checkpoint`` and ``trainer generate``.

A checkpoint is a DCP folder ``<dump_folder>/<checkpoint.folder>/step-N/`` whose state dict holds the
model weights under a top-level ``model`` entry (plain FQNs such as ``layers.0.attention.wq.weight``).
DCP reshards on load, so a checkpoint written by any parallel layout (FSDP, HSDP, TP, PP) loads here.
The architecture comes from the run's resolved ``<dump_folder>/config.toml`` (flavor, tokenizer), which
callers may override; the vocabulary size is taken from the checkpoint itself.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.parallel import clean_fqn

logger = logging.getLogger("trainer")

__all__ = [
    "CheckpointNotFound",
    "LoadedModel",
    "add_model_source_args",
    "find_checkpoint",
    "find_run_config",
    "load_native",
    "load_model_from_args",
    "parse_dtype",
    "save_native_checkpoint",
]

_STEP_DIR = re.compile(r"^step[-_](\d+)$")

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


class CheckpointNotFound(FileNotFoundError):
    """No usable checkpoint at the given path; the message says what was looked for."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16") from None


def _is_complete(step_dir: Path) -> bool:
    """The trainer commits a save with a marker (checkpoint.json) listing every file and its size; a
    folder written by another tool (plain ``dcp.save``) counts as complete when DCP's .metadata exists
    (DCP writes it last)."""
    if (step_dir / "checkpoint.json").is_file():
        try:
            from trainer.checkpoint import validate_checkpoint
        except ImportError:
            pass
        else:
            status, reason, _ = validate_checkpoint(step_dir)
            if status != "complete":
                logger.warning("checkpoint %s is %s: %s", step_dir, status, reason)
            return status == "complete"
    return (step_dir / ".metadata").is_file()


def _step_dirs(folder: Path) -> list[tuple[int, Path]]:
    out = []
    for child in folder.iterdir() if folder.is_dir() else []:
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir():
            out.append((int(m.group(1)), child))
    return sorted(out)


def find_checkpoint(path: str | Path, step: int | None = None) -> Path:
    """Resolve ``path`` to one complete DCP step folder.

    ``path`` may be a step folder (contains ``.metadata``), a checkpoint folder holding ``step-N``
    folders (the latest complete one is taken, or ``step``), or a dump folder with a ``checkpoint/``
    subfolder (or the folder named in its config.toml).
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointNotFound(f"checkpoint path does not exist: {p}")
    if _is_complete(p):
        return p
    if not p.is_dir():
        raise CheckpointNotFound(f"{p} is not a DCP checkpoint folder (no .metadata next to it)")
    candidates = [p]
    folder_name = "checkpoint"
    cfg = p / "config.toml"
    if cfg.is_file():
        try:
            folder_name = _load_config(cfg, []).checkpoint.folder
        except Exception:  # unreadable: fall back to the default name
            pass
    for name in dict.fromkeys((folder_name, "checkpoint")):
        candidates.append(p / name)
    for folder in candidates:
        steps = _step_dirs(folder)
        if not steps:
            continue
        if step is not None:
            match = [d for s, d in steps if s == step]
            if not match:
                raise CheckpointNotFound(
                    f"no step-{step} in {folder}; available: {', '.join(str(s) for s, _ in steps)}")
            if not _is_complete(match[0]):
                raise CheckpointNotFound(f"{match[0]} is incomplete (no .metadata): the save did not finish")
            return match[0]
        complete = [d for _, d in steps if _is_complete(d)]
        if complete:
            if len(complete) < len(steps):
                skipped = [d.name for _, d in steps if not _is_complete(d)]
                logger.warning("skipping incomplete checkpoint(s) without .metadata: %s", ", ".join(skipped))
            return complete[-1]
        raise CheckpointNotFound(
            f"{folder} has step folders ({', '.join(d.name for _, d in steps)}) but none is complete "
            "(no .metadata file)")
    raise CheckpointNotFound(
        f"no checkpoint found at {p}: expected a DCP step folder (with .metadata), a folder of step-N "
        "folders, or a dump folder containing checkpoint/step-N")


def find_run_config(step_dir: Path) -> Path | None:
    """The run's config.toml: next to the checkpoint folder's parent (the dump folder), or above."""
    for parent in list(step_dir.resolve().parents)[:3]:
        cfg = parent / "config.toml"
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


@dataclass
class LoadedModel:
    model: Any  # trainer.models.llama.Transformer, eval mode
    tokenizer: Any  # tokenizer.Tokenizer
    args: Any  # LlamaModelArgs of the built model
    config: Any | None  # the run's JobConfig (None when built from flags only)
    checkpoint: Path
    # Context length: the flavor's published max_seq_len, or the training seq_len if longer. An export's
    # config.json calls it max_position_embeddings; lm-eval uses it as max_length.
    context_length: int


# The keys of a run's config.toml the tools need. Only these are read, so that a config.toml written by an
# older or newer version of the trainer (keys added or renamed since) still loads.
RUN_CONFIG_KEYS = ("model.name", "model.flavor", "model.tokenizer_path", "model.vocab_size", "training.seq_len",
                   "checkpoint.folder")


def _load_config(config_path: Path | None, overrides: list[str]):
    """A JobConfig with the run's model/tokenizer keys (from its config.toml) and ``overrides`` applied."""
    import sys

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
class CheckpointInfo:
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
) -> CheckpointInfo:
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
    config = _load_config(cfg_path, overrides)
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
    return CheckpointInfo(step_dir=step_dir, config=config, config_path=cfg_path, tokenizer=tokenizer,
                          tokenizer_path=tok_path, args=args, context_length=context)


def load_native(
    checkpoint: str | Path,
    *,
    config_path: str | Path | None = None,
    flavor: str | None = None,
    tokenizer_path: str | None = None,
    step: int | None = None,
    dtype: str | torch.dtype = "fp32",
    device: str | torch.device = "cpu",
    max_seq_len: int | None = None,
) -> LoadedModel:
    """Build the checkpoint's model (unsharded, eval mode) and tokenizer and load the weights.

    See :func:`describe_checkpoint` for how the model is identified. ``max_seq_len`` sets the RoPE
    table length (default: the context length, the larger of the flavor's and the training seq_len).
    """
    from trainer.models.llama import Transformer

    info = describe_checkpoint(checkpoint, config_path=config_path, flavor=flavor,
                               tokenizer_path=tokenizer_path, step=step)
    rope_len = max_seq_len or info.context_length
    args = dataclasses.replace(info.args, max_seq_len=rope_len)
    model = build_model(args, load_checkpoint_state_dict(info.step_dir), device=device,
                        dtype=parse_dtype(dtype), source=str(info.step_dir))
    logger.info("loaded %s %s (vocab %d) from %s", info.config.model.name, info.config.model.flavor,
                args.vocab_size, info.step_dir)
    return LoadedModel(model=model, tokenizer=info.tokenizer, args=args, config=info.config,
                       checkpoint=info.step_dir, context_length=info.context_length)


def build_model(args, state_dict: dict[str, torch.Tensor], *, device="cpu", dtype=torch.float32,
                source: str = "checkpoint"):
    """A ``Transformer(args)`` holding ``state_dict`` (native FQNs), in eval mode."""
    from trainer.models.llama import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.to(dtype)  # before filling: a bf16 model never holds a full fp32 copy
    expected = model.state_dict()
    tied = args.tie_word_embeddings
    missing = [k for k in expected if k not in state_dict and not (tied and k == "output.weight")]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        raise ValueError(
            f"{source} does not match the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''} (wrong --flavor?)")
    with torch.no_grad():
        for name, target in expected.items():
            if name not in state_dict:
                continue
            if tuple(state_dict[name].shape) != tuple(target.shape):
                raise ValueError(f"{source}: {name} has shape {tuple(state_dict[name].shape)}, the model "
                                 f"expects {tuple(target.shape)} (wrong --flavor?)")
            target.copy_(state_dict[name])
    model.rope_cache = model._compute_rope_cache(device=device)
    model.eval()
    return model


def add_model_source_args(parser, hf: bool = True) -> None:
    """The options naming a native checkpoint (and optionally an exported HF folder)."""
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--checkpoint", help="DCP step folder, a folder of step-N folders (latest complete "
                       "one is used), or a run's dump folder")
    if hf:
        group.add_argument("--hf", help="a Hugging Face Llama folder (config.json + safetensors), e.g. from "
                           "'trainer export'")
    parser.add_argument("--step", type=int, default=None, help="with --checkpoint: this step instead of the latest")
    parser.add_argument("--config", default=None, help="the run's config.toml (default: found above the checkpoint)")
    parser.add_argument("--flavor", default=None, help="override the model flavor of the run's config")
    parser.add_argument("--tokenizer", default=None, help="override the tokenizer path of the run's config")


def load_model_from_args(args, dtype: str = "fp32", device: str = "cpu") -> LoadedModel:
    """A native model from ``--checkpoint`` or, with ``--hf``, an HF folder imported into our model."""
    if getattr(args, "hf", None):
        from torchtitan_ext.hf import load_hf_model

        return load_hf_model(args.hf, dtype=dtype, device=device)
    return load_native(args.checkpoint, config_path=args.config, flavor=args.flavor,
                       tokenizer_path=args.tokenizer, step=args.step, dtype=dtype, device=device)


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

        (dump / "config.toml").write_text(to_toml(config))
    step_dir = dump / "checkpoint" / f"step-{step}"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save({"model": dict(state_dict)}, storage_writer=dcp.FileSystemWriter(str(step_dir)))
    return step_dir
