"""Re-warm the learning rate after a checkpoint load (``stability.lr_rewarmup_steps_after_load``).

The LR schedule is a pure function of the step and the config, so lr, warmup and min_lr_factor can simply
be changed on the command line when resuming; this adds GLM-130B's linear re-warm from the resumed step.
"""

from __future__ import annotations

import logging
from typing import Any

from trainer.callbacks import Callback

logger = logging.getLogger("trainer")


class LRRewarmup(Callback):
    """On the first step of a run, if a checkpoint was loaded (``trainer.state.resumed_from_step`` is an
    int), sets ``trainer.lr_schedule.rewarmup_from``/``rewarmup_steps``. The checkpoint is loaded after the
    model is built, so this happens at the first step rather than in ``on_model_built``."""

    name = "lr_rewarmup"

    def __init__(self, steps: int):
        from trainer.config import ConfigError

        if steps < 0:
            raise ConfigError(f"stability.lr_rewarmup_steps_after_load must be >= 0, got {steps}")
        self.steps = steps
        self._checked = False

    def on_batches(self, trainer, step: int, batches: list[dict]) -> list[dict]:
        if not self._checked:
            self._checked = True
            self.apply(trainer)
        return batches

    def apply(self, trainer) -> None:
        resumed = getattr(trainer.state, "resumed_from_step", None)
        if self.steps > 0 and resumed is not None:
            trainer.lr_schedule.rewarmup_from = int(resumed)
            trainer.lr_schedule.rewarmup_steps = self.steps
            logger.info("stability: re-warming the learning rate over steps %d-%d after resuming from step %d",
                        resumed + 1, resumed + self.steps, resumed)

    def metrics(self, trainer, step: int) -> dict[str, Any]:
        return {}
