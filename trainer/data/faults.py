"""Skipped documents during training: counted by kind, reported on log steps, and a stop above a fraction.

The counters live in the loader's state (each shard's ``stats``), so a resumed run continues them exactly.
On a log step every rank sums its shards' counters and the ranks add them up (one small all-reduce over
data-parallel ranks, on a step that synchronises anyway): the totals go to metrics.jsonl
(``data_skipped``, ``data_skipped_fraction``), to summary.json through the last record, and to the console
when they grew. Above ``data.max_skipped_fraction`` (once ``MIN_DOCUMENTS`` were read) the run stops with
a :class:`DataError` naming the sources and the kinds.
"""

from __future__ import annotations

import gzip
import logging

import torch
import torch.distributed as dist

from trainer.errors import DataError

logger = logging.getLogger("trainer")

KINDS = ("malformed", "empty", "undecodable", "missing_field")
MIN_DOCUMENTS = 100


def location(where: dict | None) -> str:
    """``file:line`` of a skipped document (line sources: the line counted up to its byte offset), else
    ``file row N``; "" when unknown."""
    if not where:
        return ""
    path, at = where.get("file", "?"), int(where.get("at", 0))
    if not where.get("bytes"):
        return f"{path} row {at}"
    try:
        opener = gzip.open if str(path).lower().endswith(".gz") else open
        with opener(path, "rb") as f:
            head = f.read(at)
        line = head.count(b"\n") + 1
        return f"{path}:{line}"
    except OSError:
        return f"{path} at byte {at}"


class SkipMonitor:
    def __init__(self, loader, config, dp_group, dp: int):
        self.loader = loader
        self.max_fraction = config.data.max_skipped_fraction
        self.text_field = config.data.text_field
        self.group = dp_group
        self.dp = dp
        self.reported = 0

    def record(self, is_logging_rank: bool) -> dict:
        """Fields for the log record (all ranks call it on log steps); raises DataError above the limit."""
        stats = getattr(self.loader, "stats", None)  # a property: this rank's shards' counters
        if not isinstance(stats, dict):
            return {}
        t = torch.tensor([int(stats.get(f"skipped_{k}", 0)) for k in KINDS] + [int(stats.get("documents", 0))],
                         dtype=torch.int64)
        if self.dp > 1:
            dist.all_reduce(t, group=self.group)  # a CPU tensor: gloo
        counts = dict(zip(KINDS, (int(v) for v in t[:-1])))
        counts["malformed"] -= counts["missing_field"]  # the loader counts missing fields among the malformed
        skipped, used = sum(counts.values()), int(t[-1])
        fraction = skipped / max(skipped + used, 1)
        sources = ", ".join(s["source"] for s in stats.get("sources", [])) or "the training data"
        detail = ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in counts.items() if n)
        if skipped > self.reported and is_logging_rank:
            logger.warning("data: %d of %d documents skipped so far (%s) in %s", skipped, skipped + used, detail,
                           sources)
        self.reported = skipped
        if skipped + used >= MIN_DOCUMENTS and fraction > self.max_fraction:
            hint = (f"; is the text under another key than data.text_field={self.text_field!r}?"
                    if counts["missing_field"] else "")
            where = location(stats.get("last_skipped"))
            raise DataError(f"{skipped} of {skipped + used} documents read were skipped ({fraction:.1%} > "
                            f"data.max_skipped_fraction={self.max_fraction:g}): {detail} in {sources}"
                            f"{f'; the last one on this rank: {where}' if where else ''}{hint}; fix the data or "
                            f"raise data.max_skipped_fraction (`trainer data audit` counts them over all data)")
        return {"data_skipped": counts, "data_skipped_fraction": fraction} if skipped else {}
