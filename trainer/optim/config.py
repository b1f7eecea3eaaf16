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


@dataclass
class LossScale:
    """Dynamic loss scaling, on with training.mixed_precision_param = "float16" (torch.amp.GradScaler's names and
    defaults)."""

    init_scale: float = 2.0**16
    """The loss scale the run starts with (a resumed run takes the checkpoint's)."""
    growth_factor: float = 2.0
    """The scale is multiplied by this after growth_interval steps in a row without an overflow."""
    backoff_factor: float = 0.5
    """The scale is multiplied by this at a step whose gradients overflowed (that step's update is skipped)."""
    growth_interval: int = 2000
    """Steps in a row without an overflow before the scale grows by growth_factor."""


SECTION_DOC = {"optimizer": "AdamW settings.", "lr_scheduler": "Learning-rate warmup and decay.",
               "training.loss_scale": "Dynamic loss scaling of float16 training (see docs/stability.md)."}


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
    check_loss_scale(config)


def check_loss_scale(config) -> None:
    """float16 training's loss scaling: its keys, and what it does not combine with."""
    t, ls = config.training, config.training.loss_scale
    if ls.init_scale <= 0:
        raise ConfigError(f"training.loss_scale.init_scale must be > 0, got {ls.init_scale}")
    if ls.growth_factor <= 1:
        raise ConfigError(f"training.loss_scale.growth_factor must be > 1, got {ls.growth_factor}")
    if not 0 < ls.backoff_factor < 1:
        raise ConfigError(f"training.loss_scale.backoff_factor must be in (0, 1), got {ls.backoff_factor}")
    if ls.growth_interval < 1:
        raise ConfigError(f"training.loss_scale.growth_interval must be >= 1, got {ls.growth_interval}")
    if any(s < 1 for s in config.debug.overflow_at_steps) or config.debug.overflow_rank < 0:
        raise ConfigError(f"debug.overflow_at_steps must hold steps >= 1 and debug.overflow_rank must be >= 0, got "
                          f"{config.debug.overflow_at_steps} and {config.debug.overflow_rank}")
    fp16 = t.mixed_precision_param == "float16"
    if not fp16:
        given = sorted(k for k in config.explicit_keys if k.startswith("training.loss_scale."))
        if given:
            raise ConfigError(f"{given[0]} is set but training.mixed_precision_param is {t.mixed_precision_param!r}: "
                              "loss scaling is for float16 training only; remove the key or train in float16")
        if config.debug.overflow_at_steps:
            raise ConfigError("debug.overflow_at_steps drills float16's loss scaling: it needs "
                              "training.mixed_precision_param = \"float16\"")
    if t.mixed_precision_reduce == "float16" and not fp16:
        # Unscaled gradients are small: in float16 the smallest of them flush to zero, silently.
        raise ConfigError(f"training.mixed_precision_reduce = \"float16\" is safe only with float16 training, whose "
                          f"loss scale keeps gradients clear of float16's underflow and catches an overflow of the "
                          f"sum (training.mixed_precision_param is {t.mixed_precision_param!r}); use \"float32\"")
    if fp16 and config.fault_tolerance.enable:
        raise ConfigError("training.mixed_precision_param = \"float16\" with fault_tolerance.enable is not supported: "
                          "the replica groups do not agree on overflow skips and the loss scale; train in bfloat16")
