"""Model registry. Only the Llama family exists for now."""

from __future__ import annotations

from .llama import LLAMA_FLAVORS, LlamaModelArgs, RopeScaling, build_llama, get_llama_args


def __getattr__(name: str):  # Transformer and the counts import torch: loaded on first use (pre-flight stays light)
    if name in ("Transformer", "count_params", "flops_per_token", "model_num_params"):
        from . import llama

        return getattr(llama, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# Model names accepted by get_model_args; all map to the one Llama implementation.
MODEL_NAMES = ("llama", "llama2", "llama3")

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
]


def get_model_args(name: str, flavor: str) -> LlamaModelArgs:
    """Args (a fresh copy) for model ``name`` and ``flavor``.

    ``flavor`` is a key of ``LLAMA_FLAVORS`` (e.g. ``"llama3_8b"``, ``"debugmodel"``); for
    ``name`` ``"llama2"``/``"llama3"`` the prefix may be omitted (``"8b"``). Raises
    ``ValueError`` naming the valid names/flavors otherwise.
    """
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(MODEL_NAMES)}")
    from .llama.flavors import TORCHTITAN_FLAVORS

    key = TORCHTITAN_FLAVORS.get(name, {}).get(flavor, flavor)  # torchtitan's names ("8B") too
    if key not in LLAMA_FLAVORS and name != "llama" and f"{name}_{flavor}" in LLAMA_FLAVORS:
        key = f"{name}_{flavor}"
    if key not in LLAMA_FLAVORS:
        raise ValueError(
            f"unknown flavor {flavor!r} for model {name!r}; valid flavors: "
            + ", ".join(sorted(LLAMA_FLAVORS))
            + (f" (torchtitan's: {', '.join(TORCHTITAN_FLAVORS[name])})" if name in TORCHTITAN_FLAVORS else "")
        )
    return get_llama_args(key)
