"""Dynamic loss scaling for float16 training (``training.mixed_precision_param = "float16"``).

float16 has five exponent bits: small gradients flush to zero and large ones overflow. The loss is multiplied
by a scale before backward, so that the gradients sit in float16's range, and the gradients are divided by it
again before anything reads them (clipping, the guards, the optimizer). A step whose gradients overflowed is
skipped and the scale backs off; after ``growth_interval`` clean steps it grows again. The arithmetic and
the defaults are torch.amp.GradScaler's.

Why not GradScaler itself: it looks for an overflow in the gradients each rank holds, and under FSDP2, TP
or pipeline parallelism a rank holds a shard or a stage, so the ranks could disagree on a skip and their
weights drift apart; and it applies its verdict by reading it on the host or through AMP's private
optimizer protocol (``found_inf``). Here the overflow flag comes from the global gradient norm (already reduced over the shards, TP
ranks and stages) and is all-reduced once more over every rank (HSDP's replicas, and any rank whose flag the
norm's reductions do not reach), and the verdict is the same explicit one every skip uses
(``SkipStepAdamW.step_or_skip``). Everything stays on the device; the scale is read on log steps and saves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainer.callbacks import Callback

if TYPE_CHECKING:
    from trainer.optim.config import LossScale

logger = logging.getLogger("trainer")


class LossScaler(Callback):
    """The loss scale and its bookkeeping; a callback for its state (checkpoints), its metrics
    (``loss_scale``, ``overflow_skipped``) and the overflow drill (``debug.overflow_at_steps``).

    Per step, in this order: backward on the loss times :attr:`scale` (``trainer/step.py``'s
    ``forward_backward`` and ``PipelineLoss``), :meth:`unscale_` after it, :meth:`found_overflow` on the global gradient norm, :meth:`update`
    after the optimizer step (``trainer/step.py: clip_and_step``)."""

    name = "loss_scaler"

    def __init__(self, cfg: LossScale, device: torch.device, *, rank: int = 0, overflow_at_steps: Iterable[int] = (),
                 overflow_rank: int = 0):
        self.growth_factor = cfg.growth_factor
        self.backoff_factor = cfg.backoff_factor
        self.growth_interval = cfg.growth_interval
        self.scale = torch.full((), cfg.init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int64, device=device)  # clean steps in a row
        self.overflows = torch.zeros((), dtype=torch.int64, device=device)  # steps skipped for an overflow
        self.found_inf: torch.Tensor | None = None  # this step's agreed flag (0-d bool), once found_overflow ran
        self.rank = rank
        self.overflow_at_steps = set(overflow_at_steps)
        self.overflow_rank = overflow_rank
        self._step = 0
        self._inject = False
        self._previous = self.scale.clone()  # the scale before the latest update (for the skip reason)
        self._last_overflow = torch.full((), -1, dtype=torch.int64, device=device)  # step of the latest overflow
        self._reported = 0  # overflows already reported in a log line

    # The step ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def unscale_(self, model_parts: list[torch.nn.Module]) -> None:
        """Divide every gradient by the scale, in place (the overflow drill first plants its infinity)."""
        grads = [p.grad for part in model_parts for p in part.parameters() if p.grad is not None]
        if self._inject:
            plant_overflow(grads)
        inv = {self.scale.device: self.scale.double().reciprocal().float()}  # as GradScaler: exact for 2**k
        # One kernel per gradient; a DTensor gradient divides its local shard. (CPU-offloaded gradients
        # take a CPU copy of the factor: a device scalar cannot multiply a CPU tensor.)
        for g in grads:
            if g.device not in inv:
                inv[g.device] = inv[self.scale.device].to(g.device)
            g.mul_(inv[g.device])

    def found_overflow(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """Whether this step's gradients overflowed, the same answer on every rank (a 0-d bool on the
        device). ``grad_norm`` is the global norm of the unscaled gradients: an inf or NaN anywhere makes it
        non-finite. A collective over every rank: each must call it."""
        found = (~torch.isfinite(grad_norm.detach().reshape(()))).to(self.scale.device, torch.float32)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        self.found_inf = found > 0
        return self.found_inf

    @torch.no_grad()
    def update(self) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps in a row (GradScaler's
        rule, a growth that would overflow the scale itself is not taken), on the device."""
        found = self.found_inf
        self._previous.copy_(self.scale)
        tracker = torch.where(found, 0, self.growth_tracker + 1)
        grow = tracker >= self.growth_interval
        grown = self.scale * self.growth_factor
        kept = torch.where(grow & torch.isfinite(grown), grown, self.scale)
        self.scale.copy_(torch.where(found, self.scale * self.backoff_factor, kept))
        self.growth_tracker.copy_(torch.where(grow, 0, tracker))
        self.overflows.add_(found.long())
        self._last_overflow.copy_(torch.where(found, self._step, self._last_overflow))

    # Callback hooks ---------------------------------------------------------------------------------

    def on_batches(self, run, step: int, batches: list[dict]) -> list[dict]:
        self._step = step
        self._inject = step in self.overflow_at_steps and self.rank == self.overflow_rank
        if self._inject:
            logger.warning("overflow drill: rank %d plants an infinity in its gradient at step %d", self.rank, step)
        return batches

    def metrics(self, run, step: int) -> dict[str, Any]:
        """On a log step: the scale after this step's update, the overflow-skipped steps so far, and the skip
        reason of an overflow at this step."""
        scale, overflows, last = float(self.scale), int(self.overflows), int(self._last_overflow)
        out: dict[str, Any] = {"loss_scale": scale, "overflow_skipped": overflows}
        if last == step:
            out["skip_reason"] = f"float16 gradient overflow: loss scale {float(self._previous):g} -> {scale:g}"
        if overflows > self._reported:
            new = overflows - self._reported
            since = "" if new == 1 else f" ({new} steps since the last log)"
            logger.info("step %d: float16 gradients overflowed%s: update skipped, loss scale now %g", last, since,
                        scale)
        self._reported = overflows
        return out

    def summary(self) -> dict[str, Any]:
        """The run summary's fields (summary.json)."""
        return {"loss_scale": float(self.scale), "overflow_skipped": int(self.overflows)}

    def state_dict(self) -> dict[str, Any]:
        # Python numbers: a float32 scale converts to a float exactly and back, so a resume is bitwise.
        return {"scale": float(self.scale), "growth_tracker": int(self.growth_tracker),
                "overflow_skipped": int(self.overflows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state["growth_tracker"]))
        self.overflows.fill_(int(state["overflow_skipped"]))
        self._previous.copy_(self.scale)
        self._reported = int(state["overflow_skipped"])


def plant_overflow(grads: list[torch.Tensor]) -> None:
    """The overflow drill: one infinity in this rank's own part of the first gradient that has one (after
    the gradients were reduced: only this rank sees it until the ranks agree)."""
    from torch.distributed.tensor import DTensor

    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        if local.numel():
            local[(0,) * local.ndim] = float("inf")
            return


def build_loss_scaler(config, device: torch.device, rank: int) -> LossScaler | None:
    """The run's loss scaler: float16 training only (None otherwise)."""
    t, d = config.training, config.debug
    if t.mixed_precision_param != "float16":
        return None
    ls: LossScale = t.loss_scale
    logger.info("float16 training: dynamic loss scaling from %g (x%g after %d clean steps, x%g after an overflow)",
                ls.init_scale, ls.growth_factor, ls.growth_interval, ls.backoff_factor)
    return LossScaler(ls, device, rank=rank, overflow_at_steps=d.overflow_at_steps, overflow_rank=d.overflow_rank)
