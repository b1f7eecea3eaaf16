"""The [optimizer] and [lr_scheduler] config sections and their rules (torch-free: the launcher's
pre-flight runs them). The string under each field is its documentation (``--help``, docs/config.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainer.errors import ConfigError


MUON_NS_COEFFICIENTS = [3.4445, -4.775, 2.0315]  # torch.optim.Muon's (Keller Jordan's quintic)


@dataclass
class Muon:
    """Muon's settings (optimizer.name = "Muon"), with torch.optim.Muon's names and defaults. Muon updates the 2-D
    weight matrices inside the transformer blocks (attention wq, wk, wv, wo; feed-forward w1, w2, w3); the token
    embedding, the output layer, the norms and any bias stay with AdamW ([optimizer]'s lr, beta1, beta2, eps,
    weight_decay), in the same optimizer."""

    lr: float | None = None
    """Muon's peak learning rate, scaled by the same schedule as optimizer.lr. None: optimizer.lr (Moonlight's
    recipe, with adjust_lr_fn = "match_rms_adamw"; with the default "original" adjustment Muon wants a larger
    lr, about 0.02 in Keller Jordan's runs)."""
    weight_decay: float | None = None
    """Decoupled weight decay of the Muon matrices (torch.optim.Muon: p *= 1 - lr * weight_decay). None:
    optimizer.weight_decay."""
    momentum: float = 0.95
    """Momentum of the gradient average that is orthogonalised."""
    nesterov: bool = True
    """Nesterov momentum: orthogonalise the gradient moved toward the momentum, not the momentum itself."""
    ns_coefficients: list[float] = field(default_factory=lambda: list(MUON_NS_COEFFICIENTS))
    """The three coefficients (a, b, c) of the quintic Newton-Schulz iteration."""
    eps: float = 1e-7
    """Floor of the matrix norm the update is divided by before the iterations."""
    ns_steps: int = 5
    """Newton-Schulz iterations per matrix and step (1 to 99)."""
    adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = None
    """Learning-rate scaling by matrix shape: None or "original" multiplies lr by sqrt(max(1, rows / cols))
    (Keller Jordan's); "match_rms_adamw" by 0.2 * sqrt(max(rows, cols)), so that Muon's update has AdamW's RMS
    and reuses AdamW's learning rate and weight decay (Moonlight, Kimi K2)."""
    ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the Newton-Schulz iterations. bfloat16 is torch.optim.Muon's (bitwise its result); float32 costs
    more (twice the bytes exchanged, slower matmuls) and is less sensitive to the last bits of the gradients,
    which sharded layouts sum in another order."""


@dataclass
class Optimizer:
    name: Literal["AdamW", "Muon"] = "AdamW"
    """Optimizer class. Muon: Muon for the 2-D weight matrices of the transformer blocks, AdamW with the keys
    below for the embedding, the output layer, norms and biases ([optimizer.muon]; docs/optimizers.md)."""
    lr: float = 8e-4
    """Peak learning rate (reached at the end of warmup); with name = "Muon", AdamW's part's (and Muon's unless
    optimizer.muon.lr is set)."""
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
    muon: Muon = field(default_factory=Muon)


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


SECTION_DOC = {"optimizer": "AdamW settings (with name = \"Muon\": AdamW's part).",
               "optimizer.muon": "Muon's settings, used with optimizer.name = \"Muon\", with torch.optim.Muon's names and "
                                 "defaults. Muon updates the 2-D weight matrices inside the transformer blocks "
                                 "(attention wq, wk, wv, wo; feed-forward w1, w2, w3); the token embedding, the output "
                                 "layer, the norms and any bias stay with AdamW ([optimizer]'s lr, beta1, beta2, eps, "
                                 "weight_decay), in the same optimizer (one state dict). See docs/optimizers.md.", "lr_scheduler": "Learning-rate warmup and decay.",
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
    check_muon(config)
    check_loss_scale(config)


def check_muon(config) -> None:
    """Muon's keys: their values, and that they are not set for another optimizer (no silent no-op keys)."""
    o, m = config.optimizer, config.optimizer.muon
    if o.name != "Muon":
        given = sorted(k for k in config.explicit_keys if k.startswith("optimizer.muon."))
        if given:
            raise ConfigError(f"{given[0]} is set but optimizer.name is {o.name!r}: Muon's keys apply to "
                              "optimizer.name = \"Muon\" only; remove the key or set optimizer.name = \"Muon\"")
        return
    if m.lr is not None and not m.lr > 0:
        raise ConfigError(f"optimizer.muon.lr must be > 0 or None (optimizer.lr), got {m.lr}")
    if m.weight_decay is not None and not m.weight_decay >= 0:
        raise ConfigError(f"optimizer.muon.weight_decay must be >= 0 or None (optimizer.weight_decay), got "
                          f"{m.weight_decay}")
    if not 0.0 <= m.momentum < 1.0:
        raise ConfigError(f"optimizer.muon.momentum must be in [0, 1), got {m.momentum}")
    if len(m.ns_coefficients) != 3:
        raise ConfigError(f"optimizer.muon.ns_coefficients must hold three numbers (a, b, c), got "
                          f"{m.ns_coefficients}")
    if not m.eps > 0:
        raise ConfigError(f"optimizer.muon.eps must be > 0, got {m.eps}")
    if not 1 <= m.ns_steps < 100:
        raise ConfigError(f"optimizer.muon.ns_steps must be in [1, 99], got {m.ns_steps}")
    if config.training.enable_cpu_offload:
        raise ConfigError("optimizer.name = \"Muon\" with training.enable_cpu_offload is not supported: Muon's "
                          "exchange of the sharded updates runs on the device; use AdamW or turn the offload off")


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
