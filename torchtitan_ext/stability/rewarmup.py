"""Re-warm the learning rate after a checkpoint load (``stability.lr_rewarmup_steps_after_load``).

The LR schedule is a pure function of the step and the config, so lr, warmup and min_lr_factor can simply
be changed on the command line when resuming; this adds GLM-130B's linear re-warm from the first step the
resumed run actually trains: a restart usually skips the data of a spike right after the checkpoint
(``stability.skip_steps``), and a re-warm spent inside that range would leave the first trained step at the
full learning rate.
"""

from __future__ import annotations

import logging

from torchtitan_ext.stability.config import normalize_ranges
from trainer.callbacks import Callback

logger = logging.getLogger("trainer")


class LRRewarmup(Callback):
    """After a checkpoint is loaded to resume the run, sets the LR schedule's ``rewarmup_from`` /
    ``rewarmup_steps`` so the learning rate climbs from 0 again over the first ``steps`` trained steps
    (GLM-130B's remedy after a restart), starting after any skipped range that follows the checkpoint."""

    name = "lr_rewarmup"

    def __init__(self, steps: int, skip_ranges: list[list[int]] | None = None):
        self.steps = steps
        self.skip_ranges = normalize_ranges(skip_ranges or [])

    def first_trained_step(self, step: int) -> int:
        """The first step after ``step`` that no skipped range covers."""
        nxt = step + 1
        for lo, hi in self.skip_ranges:  # sorted and disjoint
            if lo <= nxt <= hi:
                nxt = hi + 1
        return nxt

    def on_checkpoint_loaded(self, run, step: int) -> None:
        if self.steps > 0:
            first = self.first_trained_step(int(step))
            run.lr_schedule.rewarmup_from = first - 1
            run.lr_schedule.rewarmup_steps = self.steps
            skipped = f" (steps {step + 1}-{first - 1} are skipped)" if first > step + 1 else ""
            logger.info("stability: re-warming the learning rate over steps %d-%d after resuming from step %d%s",
                        first, first + self.steps - 1, step, skipped)
