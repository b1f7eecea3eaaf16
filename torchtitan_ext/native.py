"""Build a plain, unsharded model from a native (DCP) checkpoint on one process, for the tools.

Used by ``trainer export``, ``trainer eval --checkpoint`` and ``trainer generate``. Finding and reading
checkpoints (and which model they hold) is in the core, :mod:`trainer.checkpoint.offline`; the names
re-exported here keep the tools' imports working.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.offline import CheckpointNotFound, find_checkpoint, find_run_config, load_checkpoint_state_dict
from trainer.tools.checkpoint_model import describe_checkpoint, save_native_checkpoint

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

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16") from None


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
    from trainer.models.llama.model import Transformer

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


def load_hf_model(path: str | Path, dtype="fp32", device="cpu") -> LoadedModel:
    """An HF Llama folder as our (unsharded, eval-mode) model plus its tokenizer."""
    from tokenizer import build_tokenizer
    from trainer.models.llama.hf_adapter import load_hf_state_dict, read_hf_args

    folder = Path(path)
    args = read_hf_args(folder)  # the one config.json reader (import, generate --hf, eval --hf)
    sd, _ = load_hf_state_dict(folder)
    model = build_model(args, sd, device=device, dtype=parse_dtype(dtype), source=str(folder))
    tokenizer = build_tokenizer(folder)
    return LoadedModel(model=model, tokenizer=tokenizer, args=args, config=None, checkpoint=folder,
                       context_length=args.max_seq_len)


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
        return load_hf_model(args.hf, dtype=dtype, device=device)
    return load_native(args.checkpoint, config_path=args.config, flavor=args.flavor,
                       tokenizer_path=args.tokenizer, step=args.step, dtype=dtype, device=device)
