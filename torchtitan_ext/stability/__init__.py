"""Stability toolkit: step-range skipping, spike and non-finite guards, embedding-gradient shrink, z-loss,
LR re-warm after resume and fault drills. See docs/stability.md.

Every tool is a :class:`trainer.callbacks.Callback`. All of them are always built (a disabled one does
nothing), so the callback state a checkpoint holds has the same keys whichever tools are enabled, and a
tool can be switched on when resuming.
"""

from __future__ import annotations

import importlib

# Submodules are imported on first use: the registry imports this package's config (for the [stability]
# section and its rules), which must stay light (no torch import for --help or config checks).
_EXPORTS = {
    "Stability": "config",
    "AlphaSchedule": "embedding", "EmbeddingGradShrink": "embedding", "shrink_embedding_grad": "embedding",
    "FaultInjection": "faults", "random_tokens_like": "faults",
    "RollingWindow": "guard", "StepGuard": "guard", "StopTraining": "guard", "stop_message": "guard",
    "LRRewarmup": "rewarmup",
    "SkipRanges": "skip", "normalize_ranges": "config", "check_config": "config",
    "ZLoss": "zloss", "logsumexp_last_dim": "zloss", "z_loss": "zloss",
}
__all__ = [*_EXPORTS, "build_stability_callbacks"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_stability_callbacks(config) -> list:
    """The toolkit's callbacks, in hook order: fault drills first (they replace the batch and the loss the
    others see), the step guard last (it decides after every other loss term is in)."""
    from torchtitan_ext.stability.embedding import AlphaSchedule, EmbeddingGradShrink
    from torchtitan_ext.stability.faults import FaultInjection
    from torchtitan_ext.stability.guard import StepGuard
    from torchtitan_ext.stability.rewarmup import LRRewarmup
    from torchtitan_ext.stability.skip import SkipRanges
    from torchtitan_ext.stability.zloss import ZLoss

    s = config.stability
    return [
        FaultInjection(config.debug.inject_bad_data_steps, config.debug.inject_nonfinite_loss_steps),
        LRRewarmup(s.lr_rewarmup_steps_after_load),
        SkipRanges(s.skip_steps),
        EmbeddingGradShrink(AlphaSchedule(s.embedding_grad_alpha, s.embedding_grad_alpha_start,
                                          s.embedding_grad_alpha_steps), enabled=s.embedding_grad_shrink),
        ZLoss(config.training.z_loss_weight),
        StepGuard(s, config),
    ]
