"""The [stability] config section and its rules.

Its z-loss and fault-drill keys were once in [training] and [debug] (torchtitan has no such keys); their
former names stay accepted as aliases (registered in torchtitan_ext/__init__.py).

Every field has a string under it: that string is the user documentation (``--help`` and docs/config.md
are generated from it). See docs/stability.md for how the tools fit together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainer.errors import ConfigError


@dataclass
class Stability:
    skip_steps: list[list[int]] = field(default_factory=list)
    """Inclusive step ranges whose optimizer update is skipped (their data is still drawn), e.g.
    [[10, 20], [25, 30]]; on the command line 10-20,25-30. Skipped steps run no forward or backward, the LR
    schedule moves on as if they had run, and later steps see the same data as without the skip. Ranges
    may be added or changed when resuming."""
    nonfinite_guard: bool = True
    """Skip the optimizer update of a step whose loss or gradient norm is NaN or infinite (weights and
    optimizer state stay untouched). Costs one device-to-host read of one small tensor per step."""
    max_consecutive_bad_steps: int = 10
    """Stop the run (non-zero exit, naming the last checkpoint before the bad streak) after this many
    consecutive steps skipped by the non-finite or spike guard; 0 never stops."""
    spike_guard: bool = False
    """Skip the optimizer update of a step whose loss or gradient norm exceeds the mean + spike_sigma x std
    of the previous spike_window steps (OLMo-core's skip-step rule; skipped steps' values enter the window
    too, non-finite ones never). Costs one small all-reduce and one device-to-host read per step."""
    spike_sigma: float = 6.0
    """Standard deviations above the rolling mean that count as a spike."""
    spike_window: int = 128
    """Steps in the rolling window of losses and gradient norms."""
    spike_min_history: int = 64
    """The spike guard only acts once the window holds at least this many steps (at least 2)."""
    spike_metric: Literal["both", "loss", "grad_norm"] = "both"
    """Which values the spike guard watches: both (either one spiking skips the step), loss, or grad_norm."""
    embedding_grad_shrink: bool = False
    """GLM-130B embedding-gradient shrink: the embedding output becomes alpha * e + (1 - alpha) * e.detach(),
    so the forward pass is unchanged and the embedding gradient is scaled by alpha."""
    embedding_grad_alpha: float = 0.1
    """alpha after the ramp of embedding_grad_alpha_steps (throughout when there is no ramp); in [0, 1]."""
    embedding_grad_alpha_start: float = 1.0
    """alpha up to the first step of embedding_grad_alpha_steps (unused without a ramp); in [0, 1]."""
    embedding_grad_alpha_steps: list[int] = field(default_factory=list)
    """[first, last]: alpha moves linearly from embedding_grad_alpha_start at step first to
    embedding_grad_alpha at step last. Empty: alpha is embedding_grad_alpha at every step."""
    lr_rewarmup_steps_after_load: int = 0
    """After resuming from a checkpoint, scale the learning rate up linearly from 0 over this many steps
    (GLM-130B's remedy after a restart); 0 disables."""
    z_loss_weight: float = 0.0
    """Weight of the z-loss (log of the softmax normaliser, squared) added to the loss; 0 disables."""
    inject_bad_data_steps: list[int] = field(default_factory=list)
    """Fault drill: replace the batch at these steps with uniformly random tokens."""
    inject_nonfinite_loss_steps: list[int] = field(default_factory=list)
    """Fault drill: force a non-finite loss at these steps."""


def normalize_ranges(ranges: list[list[int]], key: str = "stability.skip_steps") -> list[tuple[int, int]]:
    """Validate inclusive [first, last] ranges; returns them sorted and merged."""
    out = []
    for i, r in enumerate(ranges):
        if len(r) == 1:
            r = [r[0], r[0]]
        if len(r) != 2:
            raise ConfigError(f"{key}[{i}]: expected [first, last], got {r!r}")
        lo, hi = int(r[0]), int(r[1])
        if lo < 1 or hi < lo:
            raise ConfigError(f"{key}[{i}]: need 1 <= first <= last, got [{lo}, {hi}]")
        out.append((lo, hi))
    out.sort()
    merged: list[tuple[int, int]] = []
    for lo, hi in out:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def check_config(config, world_size: int | None = None) -> None:
    """The [stability] rules (registered with the core's config validation)."""
    s = config.stability
    if s.z_loss_weight < 0:
        raise ConfigError(f"stability.z_loss_weight must be >= 0, got {s.z_loss_weight}")
    normalize_ranges(s.skip_steps)
    if s.spike_guard:
        if s.spike_window < 2:
            raise ConfigError(f"stability.spike_window must be >= 2, got {s.spike_window}")
        if not 2 <= s.spike_min_history <= s.spike_window:
            raise ConfigError(f"stability.spike_min_history must be in [2, spike_window={s.spike_window}], "
                              f"got {s.spike_min_history}")
        if s.spike_sigma <= 0:
            raise ConfigError(f"stability.spike_sigma must be > 0, got {s.spike_sigma}")
    if s.max_consecutive_bad_steps < 0:
        raise ConfigError(f"stability.max_consecutive_bad_steps must be >= 0, got {s.max_consecutive_bad_steps}")
    for key in ("embedding_grad_alpha", "embedding_grad_alpha_start"):
        if not 0.0 <= getattr(s, key) <= 1.0:
            raise ConfigError(f"stability.{key} must be in [0, 1], got {getattr(s, key)}")
    steps = s.embedding_grad_alpha_steps
    if steps and (len(steps) != 2 or steps[0] < 0 or steps[1] < steps[0]):
        raise ConfigError(f"stability.embedding_grad_alpha_steps must be [] or [first, last] with "
                          f"0 <= first <= last, got {steps}")
    if s.lr_rewarmup_steps_after_load < 0:
        raise ConfigError(f"stability.lr_rewarmup_steps_after_load must be >= 0, got {s.lr_rewarmup_steps_after_load}")
