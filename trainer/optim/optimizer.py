"""AdamW (decay on 2-D weights, on 1-D ones too by choice) with an explicit skip, and the learning-rate
schedule."""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging
import math

import torch

if TYPE_CHECKING:
    from trainer.optim.config import LRScheduler, Optimizer

logger = logging.getLogger("trainer")


class SkipStepAdamW(torch.optim.AdamW):
    """AdamW whose step takes a skip verdict: ``step_or_skip(verdict)``, ``verdict`` a 0-d bool tensor.

    A skipped step leaves parameters, moments and the step count untouched. As in OLMo-core's
    SkipStepOptimizer the decision stays a tensor: the fused kernel takes it as its ``found_inf`` input (the
    input mixed-precision loss scaling feeds it, read on the device), so deciding costs no host
    synchronisation. The foreach and for-loop kernels have no such input: they read the verdict on the host
    (:attr:`skips_on_device` is False; the trainer says so at start-up). ``step`` and the state dict are
    AdamW's.
    """

    @property
    def skips_on_device(self) -> bool:
        """Whether a skip verdict is applied without reading it on the host (the fused kernel)."""
        return bool(self.defaults.get("fused"))

    def step_or_skip(self, skip: torch.Tensor | None) -> None:
        """``step()`` unless ``skip`` (a 0-d bool tensor on the device; None: never skip) is true.

        Through ``step`` itself, so its hooks run as they would for a plain step (a separate method: torch
        wraps each optimizer class's own ``step`` with the hooks, and an override calling AdamW's could
        run them twice)."""
        if skip is None:
            self.step()
        elif self.skips_on_device:
            # AdamW.step hands this attribute to the fused kernel, which then changes nothing if it is set.
            self.found_inf = skip.to(torch.float32)
            try:
                self.step()
            finally:
                del self.found_inf
        elif not bool(skip):  # the host read the non-fused kernels need
            self.step()


def adamw_groups(params: list[tuple[str, torch.nn.Parameter]], cfg: Optimizer) -> list[dict]:
    """AdamW's two parameter groups: matrices and embeddings (2-D), which decay, and norms and biases (1-D),
    which decay only with ``weight_decay_norms_and_biases`` (torchtitan's behaviour: every parameter decays).
    The two groups exist either way, so a checkpoint's groups fit whatever the key."""
    matrices = [p for _, p in params if p.requires_grad and p.ndim >= 2]
    vectors = [p for _, p in params if p.requires_grad and p.ndim < 2]
    return [
        {"params": matrices, "weight_decay": cfg.weight_decay},
        {"params": vectors, "weight_decay": cfg.weight_decay if cfg.weight_decay_norms_and_biases else 0.0},
    ]


def build_optimizer(params: list[tuple[str, torch.nn.Parameter]], cfg: Optimizer) -> torch.optim.Optimizer:
    """The run's optimizer over named parameters: AdamW (:func:`adamw_groups`), or with ``name = "Muon"``
    Muon on the transformer blocks' weight matrices and AdamW's two groups on the rest
    (``trainer/optim/muon.py``). Either has ``step_or_skip`` and ``skips_on_device``."""
    if cfg.name == "Muon":
        from trainer.optim.muon import build_muon
        from trainer.parallel import clean_fqn

        return build_muon([(clean_fqn(n), p) for n, p in params], cfg, lambda rest: adamw_groups(rest, cfg))
    groups = adamw_groups(params, cfg)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    impl = cfg.implementation
    if impl == "fused":
        kwargs["fused"] = True
    elif impl == "foreach":
        kwargs["foreach"] = True
    else:
        kwargs["foreach"] = False
    return SkipStepAdamW(groups, **kwargs)


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
        """Set every parameter group's lr for ``step``: its own peak lr (an optimizer's ``base_lrs``, e.g.
        Muon's and AdamW's; else ``base_lr``) times the schedule's factor. Returns ``base_lr``'s."""
        factor = self.factor(step)
        bases = getattr(optimizer, "base_lrs", None) or [self.base_lr] * len(optimizer.param_groups)
        for group, base in zip(optimizer.param_groups, bases, strict=True):
            group["lr"] = base * factor
        return self.base_lr * factor
