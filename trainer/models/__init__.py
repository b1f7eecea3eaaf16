"""Model registry. Only the Llama family exists for now.

:func:`resolve_model_args` is the one place a run's configuration becomes model arguments: training, dry
runs, ``trainer plan`` and ``trainer bench`` all call it. :func:`get_model_args` is the flavor lookup under
it (also used by the offline tools, which size the model from a checkpoint instead of the config).
"""

from __future__ import annotations

import dataclasses
import re

from trainer.errors import ConfigError

from .llama import LLAMA_FLAVORS, LlamaModelArgs, RopeScaling, build_llama, get_llama_args


def __getattr__(name: str):  # Transformer and the counts import torch: loaded on first use (pre-flight stays light)
    if name in ("Transformer", "count_params", "flops_per_token", "model_num_params"):
        from . import llama

        return getattr(llama, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# Model names accepted by get_model_args; all map to the one Llama implementation.
MODEL_NAMES = ("llama", "llama2", "llama3")

# "<flavor>_<N>l": the flavor's shapes with N layers (e.g. llama3_8b_4l), for benchmarks and tests of a big
# model's layers on a small machine.
_FEWER_LAYERS = re.compile(r"^(?P<base>.+)_(?P<layers>\d+)l$")

__all__ = [
    "LLAMA_FLAVORS",
    "MODEL_NAMES",
    "LlamaModelArgs",
    "RopeScaling",
    "Transformer",
    "build_llama",
    "count_params",
    "flops_per_token",
    "get_llama_args",
    "get_model_args",
    "model_num_params",
    "resolve_model_args",
]


def _flavor_key(name: str, flavor: str) -> str | None:
    """The key of ``LLAMA_FLAVORS`` that ``flavor`` names for model ``name`` (ours, or torchtitan's such
    as "8B"), or None."""
    from .llama.flavors import TORCHTITAN_FLAVORS

    flavor = TORCHTITAN_FLAVORS.get(name, {}).get(flavor, flavor)
    if flavor in LLAMA_FLAVORS:
        return flavor
    if name != "llama" and f"{name}_{flavor}" in LLAMA_FLAVORS:
        return f"{name}_{flavor}"
    return None


def get_model_args(name: str, flavor: str) -> LlamaModelArgs:
    """Args (a fresh copy; the flavor table is never changed) for model ``name`` and ``flavor``.

    ``flavor`` is a key of ``LLAMA_FLAVORS`` (e.g. ``"llama3_8b"``, ``"debugmodel"``); for
    ``name`` ``"llama2"``/``"llama3"`` the prefix may be omitted (``"8b"``). ``"<flavor>_<N>l"`` is the
    flavor with ``N`` layers. Raises ``ValueError`` naming the valid names/flavors otherwise.
    """
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(MODEL_NAMES)}")
    key = _flavor_key(name, flavor)
    if key is not None:
        return get_llama_args(key)
    fewer = _FEWER_LAYERS.match(flavor)
    base = _flavor_key(name, fewer["base"]) if fewer else None
    if base is None:
        from .llama.flavors import TORCHTITAN_FLAVORS

        raise ValueError(
            f"unknown flavor {flavor!r} for model {name!r}; valid flavors: "
            + ", ".join(sorted(LLAMA_FLAVORS)) + " (or <flavor>_<N>l: the flavor with N layers)"
            + (f"; torchtitan's: {', '.join(TORCHTITAN_FLAVORS[name])}" if name in TORCHTITAN_FLAVORS else "")
        )
    return dataclasses.replace(get_llama_args(base), n_layers=int(fewer["layers"]))


def resolve_model_args(config, tokenizer_vocab: int | None) -> LlamaModelArgs:
    """The model a run's ``config`` (a JobConfig) trains: its flavor, RoPE table at ``training.seq_len``,
    embedding sized for the tokenizer.

    Rows: model.vocab_size if set, else the flavor's published vocabulary, else the tokenizer's
    vocabulary rounded up to a multiple of 64 (faster matmuls). ``tokenizer_vocab`` None skips the check
    that the tokenizer fits (dry runs and plans of presets whose tokenizer file is not on this machine).
    Raises ``ConfigError`` naming the key to fix.
    """
    try:
        flavor_args = get_model_args(config.model.name, config.model.flavor)
    except ValueError as e:
        raise ConfigError(f"model.flavor: {e}") from None
    if config.model.vocab_size > 0:
        vocab, source = config.model.vocab_size, "model.vocab_size"
    elif flavor_args.vocab_size > 0:
        vocab, source = flavor_args.vocab_size, f"flavor {config.model.flavor}"
    elif tokenizer_vocab is not None:
        vocab, source = -(-tokenizer_vocab // 64) * 64, "tokenizer"
    else:
        raise ConfigError(f"model.flavor {config.model.flavor} takes its vocabulary size from the tokenizer; "
                          "set model.tokenizer_path or model.vocab_size")
    if tokenizer_vocab is not None and vocab < tokenizer_vocab:
        raise ConfigError(f"{source} gives {vocab} embedding rows but the tokenizer has {tokenizer_vocab} ids; "
                          "use a matching tokenizer (model.tokenizer_path) or raise model.vocab_size")
    return dataclasses.replace(flavor_args, vocab_size=vocab, max_seq_len=config.training.seq_len)
