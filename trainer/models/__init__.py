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

# The flavor with no base shape: model.dim, n_layers and n_heads must be given ([model] shape keys).
CUSTOM_FLAVOR = "custom"

# [model] keys that override a flavor's field of the same name (-1 / None: keep the flavor's).
SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "multiple_of", "ffn_dim_multiplier",
              "rope_theta", "norm_eps", "tie_word_embeddings", "max_seq_len")

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
    "config_model_args",
    "get_model_args",
    "load_hf_weights",
    "model_config_keys",
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
    if flavor == CUSTOM_FLAVOR:
        return LlamaModelArgs(vocab_size=-1)
    key = _flavor_key(name, flavor)
    if key is not None:
        return get_llama_args(key)
    fewer = _FEWER_LAYERS.match(flavor)
    base = _flavor_key(name, fewer["base"]) if fewer else None
    if base is None:
        from .llama.flavors import TORCHTITAN_FLAVORS

        raise ValueError(
            f"unknown flavor {flavor!r} for model {name!r}; valid flavors: "
            + ", ".join(sorted(LLAMA_FLAVORS)) + f", {CUSTOM_FLAVOR} (or <flavor>_<N>l: the flavor with N layers)"
            + (f"; torchtitan's: {', '.join(TORCHTITAN_FLAVORS[name])}" if name in TORCHTITAN_FLAVORS else "")
        )
    return dataclasses.replace(get_llama_args(base), n_layers=int(fewer["layers"]))


def _is_set(value) -> bool:
    return value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value == -1)


def config_model_args(config) -> LlamaModelArgs:
    """The architecture a run's ``config`` describes: its flavor with the [model] shape keys applied
    (vocabulary and RoPE table length not resolved; see :func:`resolve_model_args`). Raises
    ``ConfigError`` naming the key to fix."""
    m = config.model
    try:
        base = get_model_args(m.name, m.flavor)
    except ValueError as e:
        raise ConfigError(f"model.flavor: {e}") from None
    if m.flavor == CUSTOM_FLAVOR:
        unset = [f"model.{k}" for k in ("dim", "n_layers", "n_heads") if not _is_set(getattr(m, k))]
        if unset:
            raise ConfigError(f"model.flavor = \"{CUSTOM_FLAVOR}\" needs {', '.join(unset)} (or choose a named flavor)")
    overrides = {k: getattr(m, k) for k in SHAPE_KEYS if _is_set(getattr(m, k))}
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "multiple_of", "max_seq_len"):
        if key in overrides and overrides[key] <= 0:
            raise ConfigError(f"model.{key} must be positive (or -1: the flavor's), got {overrides[key]}")
    for key in ("ffn_dim_multiplier", "rope_theta", "norm_eps"):
        if key in overrides and overrides[key] <= 0:
            raise ConfigError(f"model.{key} must be > 0 (or unset: the flavor's), got {overrides[key]}")
    if "n_heads" in overrides and "n_kv_heads" not in overrides:
        overrides["n_kv_heads"] = None  # as documented: n_heads alone means multi-head attention
    if "ffn_dim" not in overrides and ("multiple_of" in overrides or "ffn_dim_multiplier" in overrides):
        overrides["ffn_dim"] = None  # the rule asked for replaces a flavor's explicit size
    overrides["rope_scaling"] = _rope_scaling(m, base.rope_scaling)
    try:
        return dataclasses.replace(base, **overrides)
    except ValueError as e:
        raise ConfigError(f"[model] shape: {e} (model.dim, n_heads, n_kv_heads)") from None


def _rope_scaling(m, base: RopeScaling | None) -> RopeScaling | None:
    """The flavor's Llama 3.1 RoPE scaling with the model.rope_scaling_* keys applied."""
    factor = m.rope_scaling_factor
    keys = {"rope_scaling_low_freq_factor": ("low_freq_factor", m.rope_scaling_low_freq_factor),
            "rope_scaling_high_freq_factor": ("high_freq_factor", m.rope_scaling_high_freq_factor),
            "rope_scaling_original_max_position_embeddings":
                ("original_max_position_embeddings", m.rope_scaling_original_max_position_embeddings)}
    given = {field: value for field, value in keys.values() if _is_set(value)}
    if factor == 0 or (factor is None and base is None):
        if given:
            raise ConfigError(f"model.{next(k for k, (f, _) in keys.items() if f in given)} is set but the "
                              "model has no RoPE scaling: set model.rope_scaling_factor too")
        return None
    if factor is not None and factor < 0:
        raise ConfigError(f"model.rope_scaling_factor must be >= 0 (0: no scaling), got {factor}")
    start = base if base is not None else RopeScaling()
    if factor is not None:
        given["factor"] = factor
    try:
        return dataclasses.replace(start, **given)
    except ValueError as e:
        raise ConfigError(f"model.rope_scaling_*: {e}") from None


def model_config_keys(args: LlamaModelArgs) -> dict:
    """The [model] keys (flavor custom) that describe ``args`` exactly: what ``trainer import`` prints."""
    keys = {"flavor": CUSTOM_FLAVOR, "vocab_size": args.vocab_size, "dim": args.dim, "n_layers": args.n_layers,
            "n_heads": args.n_heads, "n_kv_heads": args.num_kv_heads, "ffn_dim": args.ffn_hidden_dim,
            "rope_theta": float(args.rope_theta), "norm_eps": float(args.norm_eps),
            "tie_word_embeddings": bool(args.tie_word_embeddings), "max_seq_len": args.max_seq_len}
    s = args.rope_scaling
    keys["rope_scaling_factor"] = 0.0 if s is None else float(s.factor)
    if s is not None:
        keys.update(rope_scaling_low_freq_factor=float(s.low_freq_factor),
                    rope_scaling_high_freq_factor=float(s.high_freq_factor),
                    rope_scaling_original_max_position_embeddings=int(s.original_max_position_embeddings))
    return keys


def resolve_model_args(config, tokenizer_vocab: int | None) -> LlamaModelArgs:
    """The model a run's ``config`` (a JobConfig) trains: its flavor with the [model] shape keys applied
    (:func:`config_model_args`), RoPE table at ``training.seq_len``, embedding sized for the tokenizer.

    Rows: model.vocab_size if set, else the flavor's published vocabulary, else the tokenizer's
    vocabulary rounded up to a multiple of 64 (faster matmuls). ``tokenizer_vocab`` None skips the check
    that the tokenizer fits (dry runs and plans of presets whose tokenizer file is not on this machine).
    Raises ``ConfigError`` naming the key to fix.
    """
    flavor_args = config_model_args(config)
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


def load_hf_weights(name: str, model_parts, path: str) -> list[str]:
    """Load a Hugging Face checkpoint folder into the model parts of model ``name`` through its family's
    adapter (each rank reads only the slices it holds); returns the keys read. The one way other layers
    (checkpoint loading) reach a model family's Hugging Face mapping."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(MODEL_NAMES)}")
    from .llama.hf_adapter import load_hf_into  # torch: not imported by the pre-flight's config checks

    return load_hf_into(model_parts, path)
