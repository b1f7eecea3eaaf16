"""AdamW (decay on 2-D weights, on 1-D ones too by choice) and the learning-rate schedule."""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging
import math

import torch

from trainer.torch_compat import takes_found_inf

if TYPE_CHECKING:
    from trainer.optim.config import LRScheduler, Optimizer

logger = logging.getLogger("trainer")


def build_optimizer(params: list[tuple[str, torch.nn.Parameter]], cfg: Optimizer) -> torch.optim.Optimizer:
    """AdamW over named parameters in two groups: matrices and embeddings (2-D), which decay, and norms and
    biases (1-D), which decay only with ``weight_decay_norms_and_biases`` (torchtitan's behaviour: every
    parameter decays). The two groups exist either way, so a checkpoint's groups fit whatever the key."""
    matrices = [p for _, p in params if p.requires_grad and p.ndim >= 2]
    vectors = [p for _, p in params if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": matrices, "weight_decay": cfg.weight_decay},
        {"params": vectors, "weight_decay": cfg.weight_decay if cfg.weight_decay_norms_and_biases else 0.0},
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
    """torchtitan's warmup-stable-decay schedule, step for step, as a pure function of the step.

    ``step`` is 1-based (the optimizer step about to be taken); torchtitan's LambdaLR evaluates its
    factor at ``step - 1``, and the arithmetic below is its: with T steps in the schedule
    (lr_scheduler.total_steps or training.steps), W = min(warmup_steps, T) warmup steps (clamped with a
    warning), D decay steps (round(T * decay_ratio), at most T - W; T - W without a ratio) and
    S = T + 1 - W - D stable steps (one more than the run needs: a virtual last step keeps the final lr
    above lr * min_lr_factor):

    - step <= W: lr * step / W
    - step <= W + S: lr
    - after: lr * (m + (1 - m) * shape(p)), p = (step - W - S) / D, m = min_lr_factor, shape linear 1 - p,
      sqrt 1 - sqrt(p), cosine (1 + cos(pi p)) / 2; our extra ``constant`` keeps lr.

    Past the schedule (p > 1, only when total_steps < training.steps) lr stays at lr * m, where
    torchtitan's formula would run past its end. Being a function of the step, a resumed run needs no
    scheduler state. ``rewarmup`` re-warms linearly over N steps after a checkpoint load (GLM-130B's remedy
    after a restart).
    """

    def __init__(self, cfg: LRScheduler, base_lr: float, total_steps: int):
        self.cfg = cfg
        self.base_lr = base_lr
        self.total_steps = cfg.total_steps if cfg.total_steps is not None else total_steps
        t = self.total_steps
        self.warmup = int(cfg.warmup_steps)
        if self.warmup > t:
            logger.warning("lr_scheduler.warmup_steps (%d) exceeds the schedule's %d steps: warming up over %d "
                           "steps instead (as torchtitan does)", self.warmup, t, t)
            self.warmup = t
        self.decay = t - self.warmup
        if cfg.decay_ratio is not None:
            self.decay = round(t * cfg.decay_ratio)
            if self.warmup + self.decay > t:
                logger.warning("lr_scheduler: warmup (%d) + decay (%d) steps exceed the schedule's %d steps: "
                               "decaying over %d steps", self.warmup, self.decay, t, t - self.warmup)
                self.decay = t - self.warmup
        self.stable = t + 1 - self.warmup - self.decay
        self.rewarmup_from: int | None = None
        self.rewarmup_steps = 0

    def factor(self, step: int) -> float:
        cfg = self.cfg
        if step <= self.warmup:
            f = float(step / self.warmup)
        elif step <= self.warmup + self.stable or cfg.decay_type == "constant" or self.decay == 0:
            f = 1.0
        else:
            progress = min(1.0, float(step - self.warmup - self.stable) / self.decay)
            if cfg.decay_type == "linear":
                shape = 1 - progress
            elif cfg.decay_type == "sqrt":
                shape = 1 - math.sqrt(progress)
            else:  # cosine
                shape = 0.5 * (1.0 + math.cos(math.pi * progress))
            f = cfg.min_lr_factor + (1 - cfg.min_lr_factor) * shape
        if self.rewarmup_from is not None and self.rewarmup_steps > 0:
            # 0 before the re-warm starts (skipped steps between the checkpoint and the first trained one)
            f *= min(1.0, max(0.0, (step - self.rewarmup_from) / self.rewarmup_steps))
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
    return takes_found_inf(optimizer)


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
