"""Optional behaviour attaches to the loop through these hooks, so the loop does not grow an ``if`` per
feature. Each callback may also carry state that checkpoints save and restore."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer.config import JobConfig
    from trainer.train import Trainer


class Callback:
    """Base class: every hook is optional."""

    name = "callback"

    def on_model_built(self, trainer: "Trainer") -> None:
        """After the model is parallelized and initialised (e.g. to register module hooks)."""

    def on_batches(self, trainer: "Trainer", step: int, batches: list[dict]) -> list[dict]:
        """The step's micro-batches, drawn from the loader; may replace them (fault injection). Called first
        in every step, before the LR is set and before any compute, so also where per-step state starts."""
        return batches

    def extra_loss(self, trainer: "Trainer", logits: torch.Tensor, loss: torch.Tensor, tokens: int) -> torch.Tensor:
        """Add terms to a micro-batch's loss (already divided by the step's tokens)."""
        return loss

    def skip_before_forward(self, trainer: "Trainer", step: int) -> str | None:
        """Return a reason to skip this step before any compute, or None. The step's data has been drawn;
        no forward, backward or optimizer update runs, and its loss and grad norm are logged as NaN."""
        return None

    def should_skip(self, trainer: "Trainer", step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> str | None:
        """After backward: return a reason to skip this step's optimizer update, or None. ``loss`` is this
        rank's mean token loss, ``grad_norm`` the global gradient norm (both on the device)."""
        return None

    def metrics(self, trainer: "Trainer", step: int) -> dict[str, Any]:
        """Extra fields for the step's metrics record."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class CallbackList:
    def __init__(self, callbacks: list[Callback]):
        self.callbacks = callbacks

    def on_model_built(self, trainer):
        for cb in self.callbacks:
            cb.on_model_built(trainer)

    def on_batches(self, trainer, step, batches):
        for cb in self.callbacks:
            batches = cb.on_batches(trainer, step, batches)
        return batches

    def extra_loss(self, trainer, logits, loss, tokens):
        for cb in self.callbacks:
            loss = cb.extra_loss(trainer, logits, loss, tokens)
        return loss

    def skip_before_forward(self, trainer, step) -> str | None:
        reasons = [r for cb in self.callbacks if (r := cb.skip_before_forward(trainer, step))]
        return ", ".join(reasons) if reasons else None

    def should_skip(self, trainer, step, loss, grad_norm) -> tuple[bool, str | None]:
        reasons = [r for cb in self.callbacks if (r := cb.should_skip(trainer, step, loss, grad_norm))]
        return bool(reasons), ", ".join(reasons) if reasons else None

    def metrics(self, trainer, step):
        out: dict[str, Any] = {}
        for cb in self.callbacks:
            out.update(cb.metrics(trainer, step))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {cb.name: cb.state_dict() for cb in self.callbacks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for cb in self.callbacks:
            if cb.name in state:
                cb.load_state_dict(state[cb.name])


def build_callbacks(config: "JobConfig") -> CallbackList:
    """The callbacks a config asks for (the stability toolkit lives in torchtitan_ext)."""
    callbacks: list[Callback] = []
    try:
        from torchtitan_ext import build_extensions
    except ImportError:
        build_extensions = None
    if build_extensions is not None:
        callbacks += build_extensions(config)
    return CallbackList(callbacks)
