"""Re-warm the learning rate after a checkpoint load (``stability.lr_rewarmup_steps_after_load``).

The LR schedule is a pure function of the step and the config, so lr, warmup and min_lr_factor can simply
be changed on the command line when resuming; this adds GLM-130B's linear re-warm from the resumed step.
"""

from __future__ import annotations

import logging


from trainer.callbacks import Callback

logger = logging.getLogger("trainer")


class LRRewarmup(Callback):
    """After a checkpoint is loaded to resume the run, sets the LR schedule's ``rewarmup_from`` /
    ``rewarmup_steps`` so the learning rate climbs from 0 again (GLM-130B's remedy after a restart)."""

    name = "lr_rewarmup"

    def __init__(self, steps: int):
        self.steps = steps

    def on_checkpoint_loaded(self, run, step: int) -> None:
        if self.steps > 0:
            run.lr_schedule.rewarmup_from = int(step)
            run.lr_schedule.rewarmup_steps = self.steps
            logger.info("stability: re-warming the learning rate over steps %d-%d after resuming from step %d",
                        step + 1, step + self.steps, step)
