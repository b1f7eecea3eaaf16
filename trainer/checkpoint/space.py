"""Disk space for checkpoints: refuse a save that cannot fit, warn while a few more still do.

A save that runs out of space half-way leaves a useless partial folder and may break the filesystem for
everything else the job writes, so each save is checked beforehand against its estimated size. At
start the size of one checkpoint and what the folder can hold are reported.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from trainer.checkpoint.layout import human_bytes, scan_folder, tree_size

logger = logging.getLogger("trainer")

LOOKAHEAD_SAVES = 3  # warn when this many upcoming saves would not fit


class DiskSpace:
    """The free space of the checkpoint folder's filesystem against the saves ahead (``cfg`` is the
    checkpoint config: keep_latest_k, interval, drill_disk_bytes)."""

    def __init__(self, cfg, folder: Path):
        self.cfg = cfg
        self.folder = folder
        self._warned_fit: int | None = None  # how many saves fitted when last warned (warn on change)

    def free_bytes(self) -> int:
        if self.cfg.drill_disk_bytes >= 0:
            used = tree_size(self.folder) if self.folder.exists() else 0
            return max(0, self.cfg.drill_disk_bytes - used)
        p = self.folder
        while not p.exists() and p != p.parent:
            p = p.parent
        return shutil.disk_usage(p).free

    def committed_count(self) -> int:
        return sum(c.complete for c in scan_folder(self.folder))

    def needed(self, nbytes: int, saves: int, existing: int) -> int:
        """Extra bytes the next ``saves`` saves need at their peak (a new checkpoint is written before the
        oldest is deleted)."""
        k = self.cfg.keep_latest_k
        if k <= 0:
            return nbytes * saves
        return nbytes * max(1, min(existing + saves - 1, k) + 1 - existing)

    def _saves_that_fit(self, nbytes: int, free: int, existing: int) -> int:
        return sum(self.needed(nbytes, n, existing) <= free for n in range(1, LOOKAHEAD_SAVES + 1))

    def check(self, step: int, nbytes: int, warn: bool) -> str | None:
        """None when a save of ``nbytes`` fits (warning, where ``warn``, if the next few may not); else
        the reason to refuse it."""
        free = self.free_bytes()
        need = int(nbytes * 1.02) + (1 << 20)
        if free < need:
            return (f"not enough disk space for checkpoint step-{step}: it needs about {human_bytes(need)} and "
                    f"{self.folder} has {human_bytes(free)} free. Free up space, lower checkpoint.keep_latest_k "
                    f"(now {self.cfg.keep_latest_k}) or set checkpoint.folder to a larger filesystem, then restart: "
                    f"the run resumes from the latest complete checkpoint")
        if not warn or free >= need * LOOKAHEAD_SAVES:  # the next saves fit whatever the folder holds
            return None
        fits = self._saves_that_fit(need, free, self.committed_count())
        if fits < LOOKAHEAD_SAVES and fits != self._warned_fit:
            self._warned_fit = fits
            logger.warning(
                "checkpoint disk space is running out: %s free in %s, each checkpoint takes about %s; only the "
                "next %d save(s) will fit (keep_latest_k=%d). Free up space or lower checkpoint.keep_latest_k",
                human_bytes(free), self.folder, human_bytes(need), fits, self.cfg.keep_latest_k)
        return None

    def report(self, nbytes: int) -> None:
        """At start: the size of one checkpoint and whether the folder can hold the ones to keep."""
        try:
            free = self.free_bytes()
        except OSError as e:
            logger.warning("cannot measure free disk space for %s: %s", self.folder, e)
            return
        existing = self.committed_count()
        logger.info("checkpoints: about %s each, %s free in %s, every %d steps, keeping %s", human_bytes(nbytes),
                    human_bytes(free), self.folder, self.cfg.interval,
                    f"the latest {self.cfg.keep_latest_k}" if self.cfg.keep_latest_k else "all")
        needed = self.needed(nbytes, LOOKAHEAD_SAVES, existing)
        if free < needed:
            self._warned_fit = self._saves_that_fit(nbytes, free, existing)
            logger.warning("checkpoint disk space is short: %s free in %s but the next %d saves need about %s",
                           human_bytes(free), self.folder, LOOKAHEAD_SAVES, human_bytes(needed))
