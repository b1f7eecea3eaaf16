"""The Hugging Face side of the model registry: each model family's mapping to and from Hugging Face
checkpoints. Other layers (checkpoint loading) reach a family's adapter only through here."""

from __future__ import annotations

from trainer.models.config import MODEL_NAMES
from trainer.models.llama.hf_adapter import load_hf_into


def load_hf_weights(name: str, model_parts, path: str) -> list[str]:
    """Load a Hugging Face checkpoint folder into the model parts of model ``name`` (each rank reads only
    the slices it holds); returns the keys read."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(MODEL_NAMES)}")
    return load_hf_into(model_parts, path)  # every name is the Llama family for now
