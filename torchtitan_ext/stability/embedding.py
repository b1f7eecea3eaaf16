"""GLM-130B embedding-gradient shrink: ``e <- alpha * e + (1 - alpha) * e.detach()``.

Written as ``e.detach() + alpha * (e - e.detach())``: the same function and gradient (``alpha`` times the
incoming gradient), but the forward value is bitwise ``e`` (the difference is exactly zero), so a run with
the shrink computes exactly the same losses as one without until the first optimizer update.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainer.callbacks import Callback


def shrink_embedding_grad(e: torch.Tensor, alpha: float) -> torch.Tensor:
    """Identity in the forward pass; scales the gradient flowing back into ``e`` by ``alpha``.

    Works for plain tensors and DTensors (elementwise ops with a Python scalar keep any placement).
    """
    if alpha == 1.0:
        return e
    d = e.detach()
    return d + (e - d) * alpha


class AlphaSchedule:
    """alpha_start up to step ``first``, linear to ``alpha`` at step ``last``, ``alpha`` afterwards; with no
    range, ``alpha`` at every step."""

    def __init__(self, alpha: float, alpha_start: float = 1.0, steps: list[int] | None = None):
        steps = list(steps or [])
        self.alpha, self.alpha_start, self.steps = alpha, alpha_start, steps

    def __call__(self, step: int) -> float:
        if not self.steps:
            return self.alpha
        first, last = self.steps
        if step <= first:
            return self.alpha_start
        if step >= last:
            return self.alpha
        return self.alpha_start + (self.alpha - self.alpha_start) * (step - first) / (last - first)


class EmbeddingGradShrink(Callback):
    """Registers a forward hook on each model part's ``tok_embeddings`` (pipeline stages without an
    embedding get none) and moves alpha along its schedule at the start of every step."""

    name = "embedding_grad_shrink"

    def __init__(self, schedule: AlphaSchedule, enabled: bool = True):
        self.schedule = schedule
        self.enabled = enabled
        self.alpha = schedule(0) if enabled else 1.0
        self.handles: list[Any] = []

    def attach(self, modules: list[nn.Module]) -> int:
        """Hook every module that has a ``tok_embeddings``; returns how many were hooked."""
        for m in modules:
            emb = getattr(m, "tok_embeddings", None)
            if emb is not None:
                self.handles.append(emb.register_forward_hook(self._hook))
        return len(self.handles)

    def _hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        # Runs after the tensor-parallel output hooks, so ``output`` is whatever the rest of the model sees
        # (a local sequence shard, or a DTensor when the plan keeps DTensor outputs).
        if not torch.is_grad_enabled():
            return output
        return shrink_embedding_grad(output, self.alpha)

    def on_model_built(self, run) -> None:
        if self.enabled:
            self.attach(run.model_parts)

    def on_batches(self, run, step: int, batches: list[dict]) -> list[dict]:
        if self.enabled:
            self.alpha = self.schedule(step)
        return batches

    def metrics(self, run, step: int) -> dict[str, Any]:
        return {"embedding_grad_alpha": self.alpha} if self.enabled else {}

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": float(self.alpha)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The schedule (from the config, possibly changed on resume) sets alpha again at the next step.
        if self.enabled and "alpha" in state:
            self.alpha = float(state["alpha"])
