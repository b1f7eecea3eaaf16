"""The [optimizer] and [lr_scheduler] config sections and their rules (torch-free: the launcher's
pre-flight runs them). The string under each field is its documentation (``--help``, docs/config.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.errors import ConfigError


@dataclass
class Optimizer:
    name: Literal["AdamW"] = "AdamW"
    """Optimizer class."""
    lr: float = 8e-4
    """Peak learning rate (reached at the end of warmup)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to 2-D weights only (matrices and embeddings; not norms) unless
    weight_decay_norms_and_biases is set."""
    weight_decay_norms_and_biases: bool = False
    """Apply weight_decay to 1-D parameters too (RMSNorm weights, biases), as torchtitan does (it decays
    every parameter). Off: norms keep their scale (GPT-2/nanoGPT, Hugging Face's Trainer, OLMo)."""
    implementation: Literal["fused", "foreach", "for-loop"] = "fused"
    """AdamW kernel: fused (one kernel per step where the device supports it), foreach, or for-loop."""
    early_step_in_backward: bool = False
    """Refused unless false: stepping the optimizer inside backward is not implemented (it also rules out
    gradient clipping)."""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warmup from lr/warmup_steps to lr; longer than the schedule (total_steps) is clamped
    to it with a warning, as torchtitan does."""
    total_steps: int | None = None
    """Steps the schedule spans; None: training.steps. Lets a short run follow a long run's curve."""
    decay_ratio: float | None = None
    """Fraction of the schedule spent decaying at the end (warmup-stable-decay). None: decay over all
    steps after warmup."""
    decay_type: Literal["linear", "cosine", "sqrt", "constant"] = "linear"
    """Shape of the decay from lr to lr * min_lr_factor; constant keeps lr after warmup. The schedule is
    torchtitan's step for step: the decay ends one step past the schedule, so the last step's lr is just
    above lr * min_lr_factor."""
    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of optimizer.lr."""


SECTION_DOC = {"optimizer": "AdamW settings.", "lr_scheduler": "Learning-rate warmup and decay."}


def check_config(config) -> None:
    o, s = config.optimizer, config.lr_scheduler
    if o.weight_decay < 0:
        raise ConfigError(f"optimizer.weight_decay must be >= 0, got {o.weight_decay}")
    if o.eps <= 0:
        raise ConfigError(f"optimizer.eps must be > 0, got {o.eps}")
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(o, key) < 1.0:
            raise ConfigError(f"optimizer.{key} must be in [0, 1), got {getattr(o, key)}")
    if o.lr <= 0:
        raise ConfigError(f"optimizer.lr must be > 0, got {o.lr}")
    if s.warmup_steps < 0:
        raise ConfigError(f"lr_scheduler.warmup_steps must be >= 0, got {s.warmup_steps}")
    if not 0.0 <= s.min_lr_factor <= 1.0:
        raise ConfigError(f"lr_scheduler.min_lr_factor must be in [0, 1], got {s.min_lr_factor}")
    if s.decay_ratio is not None and not 0.0 <= s.decay_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.decay_ratio must be in [0, 1] or None, got {s.decay_ratio}")
    if s.total_steps is not None and s.total_steps < 1:
        raise ConfigError(f"lr_scheduler.total_steps must be None (training.steps) or >= 1, got {s.total_steps}")
