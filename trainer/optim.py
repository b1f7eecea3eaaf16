"""AdamW with decay on 2-D weights only, and the learning-rate schedule."""

from __future__ import annotations

from typing import TYPE_CHECKING

import math

import torch

if TYPE_CHECKING:
    from trainer.config.sections import LRScheduler, Optimizer


def build_optimizer(params: list[tuple[str, torch.nn.Parameter]], cfg: Optimizer) -> torch.optim.Optimizer:
    """AdamW over named parameters; matrices and embeddings decay, norms (1-D) do not."""
    decay = [p for _, p in params if p.requires_grad and p.ndim >= 2]
    no_decay = [p for _, p in params if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    impl = cfg.implementation
    if impl == "fused":
        kwargs["fused"] = True
    elif impl == "foreach":
        kwargs["foreach"] = True
    else:
        kwargs["foreach"] = False
    return torch.optim.AdamW(groups, **kwargs)


class LRSchedule:
    """Linear warmup, an optional constant phase, then decay to ``lr * min_lr_factor``.

    A pure function of the step (1-based: the optimizer step about to be taken), so a resumed run needs
    no scheduler state and may change lr, warmup or min_lr_factor when it restarts. ``rewarmup`` re-warms
    linearly over N steps after a checkpoint load (GLM-130B's remedy after a restart).
    """

    def __init__(self, cfg: LRScheduler, base_lr: float, total_steps: int):
        self.cfg = cfg
        self.base_lr = base_lr
        self.total_steps = total_steps
        self.rewarmup_from: int | None = None
        self.rewarmup_steps = 0

    def factor(self, step: int) -> float:
        cfg = self.cfg
        warmup = cfg.warmup_steps
        if step <= warmup:
            f = step / warmup if warmup > 0 else 1.0
        else:
            decay_steps = self.total_steps - warmup
            if cfg.decay_ratio is not None:
                decay_steps = round(self.total_steps * cfg.decay_ratio)
            decay_start = self.total_steps - decay_steps
            if step <= decay_start or decay_steps <= 0 or cfg.decay_type == "constant":
                f = 1.0
            else:
                progress = min(1.0, (step - decay_start) / decay_steps)
                if cfg.decay_type == "linear":
                    shape = 1.0 - progress
                elif cfg.decay_type == "cosine":
                    shape = 0.5 * (1.0 + math.cos(math.pi * progress))
                else:  # sqrt
                    shape = 1.0 - math.sqrt(progress)
                f = cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * shape
        if self.rewarmup_from is not None and self.rewarmup_steps > 0:
            f *= min(1.0, (step - self.rewarmup_from) / self.rewarmup_steps)
        return f

    def lr(self, step: int) -> float:
        return self.base_lr * self.factor(step)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        lr = self.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr


def supports_device_skip(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``step_unless`` skips without a host read (fused AdamW takes the verdict as ``found_inf``)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor | None) -> None:
    """``optimizer.step()`` unless ``skip`` (a 0-d bool on the device) is true.

    Fused AdamW reads the verdict on the device through the AMP ``found_inf`` protocol: when it is set the
    kernel leaves parameters, moments and the step count untouched, so deciding costs no host
    synchronisation. Other implementations read the verdict on the host (the trainer says so at start-up).
    """
    if skip is None:
        optimizer.step()
    elif supports_device_skip(optimizer):
        optimizer.found_inf = skip.to(torch.float32)
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif not bool(skip):
        optimizer.step()
