"""Llama-family transformer: configuration, flavors, model and FLOP accounting."""

from __future__ import annotations

import dataclasses
import importlib

from .args import LlamaModelArgs, RopeScaling
from .flavors import LLAMA_FLAVORS

# The torch-importing parts load on first use, so the launcher's pre-flight (flavor lookup) stays torch-free.
_LAZY = {"Transformer": ".model", "count_params": ".flops", "flops_per_token": ".flops", "model_num_params": ".flops"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "LlamaModelArgs",
    "RopeScaling",
    "LLAMA_FLAVORS",
    "Transformer",
    "build_llama",
    "count_params",
    "flops_per_token",
    "get_llama_args",
    "model_num_params",
]


def get_llama_args(
    flavor_or_args: str | LlamaModelArgs,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
) -> LlamaModelArgs:
    """A fresh copy of the flavor's (or the given) args with optional overrides.

    Raises ``ValueError`` naming the valid flavors for an unknown flavor name.
    """
    if isinstance(flavor_or_args, str):
        if flavor_or_args not in LLAMA_FLAVORS:
            raise ValueError(
                f"unknown llama flavor {flavor_or_args!r}; valid flavors: "
                + ", ".join(sorted(LLAMA_FLAVORS))
            )
        args = LLAMA_FLAVORS[flavor_or_args]
    elif isinstance(flavor_or_args, LlamaModelArgs):
        args = flavor_or_args
    else:
        raise TypeError(f"expected a flavor name or LlamaModelArgs, got {type(flavor_or_args)!r}")
    overrides = {}
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    if max_seq_len is not None:
        overrides["max_seq_len"] = max_seq_len
    return dataclasses.replace(args, **overrides)


def build_llama(
    flavor_or_args: str | LlamaModelArgs,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
) -> "Transformer":
    """Build a ``Transformer`` on the current default device (use ``torch.device("meta")`` as
    a context manager for a deferred build). ``vocab_size``/``max_seq_len`` override the
    flavor's values; ``vocab_size`` is required when the flavor leaves it at -1."""
    from .model import Transformer

    return Transformer(get_llama_args(flavor_or_args, vocab_size, max_seq_len))
