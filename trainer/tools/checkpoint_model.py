"""The model a checkpoint holds, for the tools (``trainer export/eval/generate``): the run's config and
tokenizer found next to it, the architecture resolved, and writing a plain checkpoint for tests and imports.

Above the checkpoint package: it reads configs (trainer.config) and builds tokenizers.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.layout import DEFAULT_FOLDER, RUN_CONFIG, step_dirname
from trainer.checkpoint.offline import CheckpointNotFound, checkpoint_model_entries, find_checkpoint, find_run_config
from trainer.config import load_config, validate
from trainer.models.config import ModelMoE, config_model_args
from trainer.parallel import clean_fqn

# The keys of a run's config.toml the tools need. Only these are read, so that a config.toml written by an
# older or newer version of the trainer (keys added or renamed since) still loads.
RUN_CONFIG_KEYS = ("model.name", "model.flavor", "model.tokenizer_path", "model.vocab_size", "training.seq_len",
                   "checkpoint.folder", "model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads",
                   "model.ffn_dim", "model.multiple_of", "model.ffn_dim_multiplier", "model.rope_theta",
                   "model.rope_scaling_factor", "model.rope_scaling_low_freq_factor",
                   "model.rope_scaling_high_freq_factor", "model.rope_scaling_original_max_position_embeddings",
                   "model.norm_eps", "model.tie_word_embeddings", "model.max_seq_len", "model.no_rope_layer_interval",
                   "model.attention_chunk_size", "model.use_qk_norm", "model.attn_temperature_tuning",
                   "model.floor_scale", "model.attn_scale",
                   *(f"model.moe.{f.name}" for f in dataclasses.fields(ModelMoE)))


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
            *sections, name = key.split(".")
            table = data
            for section in sections:
                table = table.get(section) or {}
            value = table.get(name)
            if value is not None:
                argv += [f"--{key}={value}"]
    config = load_config(argv + overrides, env={})
    validate(config)
    return config


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
    base = config_model_args(config)  # the flavor with the run's [model] shape keys (ConfigError is a ValueError)
    context = max(base.max_seq_len, config.training.seq_len)
    args = dataclasses.replace(base, vocab_size=vocab, max_seq_len=context)
    return CheckpointDescription(step_dir=step_dir, config=config, config_path=cfg_path, tokenizer=tokenizer,
                                 tokenizer_path=tok_path, args=args, context_length=context)
