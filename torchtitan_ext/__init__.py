"""Capabilities beyond the torchtitan baseline, each attached to the loop through one narrow hook
(see trainer/callbacks.py)."""

from __future__ import annotations


def build_extensions(config) -> list:
    """The callbacks a config enables."""
    from torchtitan_ext.stability import build_stability_callbacks

    return build_stability_callbacks(config)
