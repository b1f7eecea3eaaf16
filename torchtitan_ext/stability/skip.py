"""Skipping known step ranges (the GLM-130B / OPT workflow: restart before a spike, skip its data)."""

from __future__ import annotations

from typing import Any

from trainer.callbacks import Callback


def normalize_ranges(ranges: list[list[int]], key: str = "stability.skip_steps") -> list[tuple[int, int]]:
    """Validate inclusive [first, last] ranges; returns them sorted and merged."""
    from trainer.config import ConfigError

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

    def skip_before_forward(self, trainer, step: int) -> str | None:
        r = self.range_of(step)
        if r is None:
            return None
        self.skipped += 1
        return f"skip_steps {r[0]}-{r[1]}"

    def metrics(self, trainer, step: int) -> dict[str, Any]:
        return {"skipped_range_steps": self.skipped} if self.ranges or self.skipped else {}

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = int(state.get("skipped", 0))
