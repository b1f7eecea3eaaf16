"""Skipping known step ranges (the GLM-130B / OPT workflow: restart before a spike, skip its data)."""

from __future__ import annotations

from typing import Any

from torchtitan_ext.stability.config import normalize_ranges
from trainer.callbacks import Callback


class SkipRanges(Callback):
    """Skips every step inside ``stability.skip_steps`` before any compute (the loop still draws the data
    and moves the LR schedule, so later steps are exactly those of a run without the skip)."""

    name = "skip_ranges"

    def __init__(self, ranges: list[list[int]]):
        self.ranges = normalize_ranges(ranges)
        self.skipped = 0  # range-skipped steps so far, over the whole run (checkpointed)

    def range_of(self, step: int) -> tuple[int, int] | None:
        for lo, hi in self.ranges:
            if lo <= step <= hi:
                return lo, hi
        return None

    def skip_before_forward(self, run, step: int) -> str | None:
        r = self.range_of(step)
        if r is None:
            return None
        self.skipped += 1
        return f"skip_steps {r[0]}-{r[1]}"

    def metrics(self, run, step: int) -> dict[str, Any]:
        return {"skipped_range_steps": self.skipped} if self.ranges or self.skipped else {}

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = int(state.get("skipped", 0))
