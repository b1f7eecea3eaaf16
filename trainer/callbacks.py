"""Optional behaviour attaches to the loop through these hooks, so the loop does not grow an ``if`` per
feature. Each callback may also carry state that checkpoints save and restore.

Hooks receive a :class:`RunView`: the parts of the run a callback may read or adjust, never the Trainer
itself, so what an extension can touch is written down here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from trainer import extensions

if TYPE_CHECKING:
    from trainer.config import JobConfig


@dataclass
class RunView:
    """What callbacks see of a run."""

    config: "JobConfig"
    model_parts: list[torch.nn.Module]  # the model, or this rank's pipeline stages
    model_args: Any  # the resolved architecture (trainer.models.llama.LlamaModelArgs)
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    lr_schedule: Any  # trainer.optim.optimizer.LRSchedule
    state: Any  # trainer.checkpoint.TrainState: step, tokens_seen, skipped_steps, resumed_from_step
    device: torch.device
    dims: Any  # trainer.parallel.dims.ParallelDims
    seed: int  # debug.seed (0 when unset)
    dp_rank: int  # this rank's data-parallel index
    accum_steps: int  # micro-batches per optimizer step
    pp_microbatches: int | None  # micro-batches per pipeline schedule step (None without pipelining)
    global_loss: Callable[[torch.Tensor], torch.Tensor]  # a rank's loss -> the mean over all ranks (collective)
    finish_checkpoints: Callable[[], None]  # wait until an in-flight asynchronous save has committed
    pp_schedule: Any = None  # the pipeline schedule over model_parts (None without pipelining)
    pp_has_first: bool = True  # this rank holds the first pipeline stage (always, without pipelining)
    pp_has_last: bool = True  # this rank holds the last pipeline stage (always, without pipelining)
    pp_group: Any = None  # the process group of this rank's pipeline (None without pipelining)
    loss_scaler: Any = None  # float16 training's trainer.optim.loss_scale.LossScaler (None otherwise)


class Callback:
    """Base class: every hook is optional."""

    name = "callback"

    def on_model_built(self, run: RunView) -> None:
        """After the model is parallelized and initialised (e.g. to register module hooks)."""

    def on_checkpoint_loaded(self, run: RunView, step: int) -> None:
        """After a checkpoint of ``step`` was loaded to resume the run (not for initial weights)."""

    def on_train_start(self, run: RunView) -> None:
        """Just before the first step of this process (after any resume)."""

    def on_batches(self, run: RunView, step: int, batches: list[dict]) -> list[dict]:
        """The step's micro-batches, drawn from the loader; may replace them (fault injection). Called first
        in every step, before the LR is set and before any compute, so also where per-step state starts."""
        return batches

    def extra_loss(self, run: RunView, logits: torch.Tensor, loss: torch.Tensor, tokens: int) -> torch.Tensor:
        """Add terms to a micro-batch's loss (already divided by the step's tokens)."""
        return loss

    def skip_before_forward(self, run: RunView, step: int) -> str | None:
        """Return a reason to skip this step before any compute, or None. The step's data has been drawn;
        no forward, backward or optimizer update runs, and its loss and grad norm are logged as NaN."""
        return None

    def should_skip(self, run: RunView, step: int, loss: torch.Tensor,
                    grad_norm: torch.Tensor) -> torch.Tensor | None:
        """After backward: a 0-d bool tensor on the device, true to skip this step's optimizer update, or
        None. ``loss`` is this rank's mean token loss, ``grad_norm`` the global gradient norm (both on the
        device). Decide on the device and never read a tensor on the host here: the loop hands the verdict
        to the optimizer as a tensor, and reports reasons at log steps through ``metrics``."""
        return None

    def metrics(self, run: RunView, step: int) -> dict[str, Any]:
        """Extra fields for the step's metrics record; called on log steps only, where reading device
        values is allowed (``skip_reason`` explains a skip decided by ``should_skip`` at this step)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class CallbackList:
    def __init__(self, callbacks: list[Callback]):
        self.callbacks = callbacks

    def append(self, callback: Callback) -> None:
        """Add one the core builds itself (float16's loss scaler), after the registered ones."""
        self.callbacks.append(callback)

    def _each(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(*args)

    def on_model_built(self, run):
        self._each("on_model_built", run)

    def on_checkpoint_loaded(self, run, step):
        self._each("on_checkpoint_loaded", run, step)

    def on_train_start(self, run):
        self._each("on_train_start", run)

    def on_batches(self, run, step, batches):
        for cb in self.callbacks:
            batches = cb.on_batches(run, step, batches)
        return batches

    def extra_loss(self, run, logits, loss, tokens):
        for cb in self.callbacks:
            loss = cb.extra_loss(run, logits, loss, tokens)
        return loss

    def skip_before_forward(self, run, step) -> str | None:
        reasons = [r for cb in self.callbacks if (r := cb.skip_before_forward(run, step))]
        return ", ".join(reasons) if reasons else None

    def should_skip(self, run, step, loss, grad_norm) -> torch.Tensor | None:
        skip = None
        for cb in self.callbacks:
            verdict = cb.should_skip(run, step, loss, grad_norm)
            if verdict is not None:
                skip = verdict if skip is None else skip | verdict
        return skip

    def metrics(self, run, step):
        out: dict[str, Any] = {}
        for cb in self.callbacks:
            out.update(cb.metrics(run, step))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {cb.name: cb.state_dict() for cb in self.callbacks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for cb in self.callbacks:
            if cb.name in state:
                cb.load_state_dict(state[cb.name])


def build_callbacks(config: "JobConfig") -> CallbackList:
    """The callbacks a config asks for, from every registered extension."""
    return CallbackList([cb for factory in extensions.callback_factories() for cb in factory(config)])
