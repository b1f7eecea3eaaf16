"""Console logging: timestamps and rank on every line; warnings said once.

Every process logs to its stdout; the launcher shows rank 0's console only (``LOG_RANK=0,3 ./run_train.sh``
shows local ranks 0 and 3; see docs/observability.md). Python ``warnings`` (from torch and other libraries)
go through the same handler, so they too carry a timestamp and the rank and are shown once.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

FORMAT = "%(asctime)s [rank {rank}] %(levelname)s %(message)s"
DATEFMT = "%Y-%m-%d %H:%M:%S"


class _Once(logging.Filter):
    """Drop repeated warnings (same message) so a per-step warning does not flood a long run's log."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        key = record.getMessage()
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` replacement: one log line ("UserWarning: text (file.py:12)")."""
    logging.getLogger("trainer").warning("%s: %s (%s:%d)", category.__name__, str(message).strip(),
                                         os.path.basename(filename), lineno)


def setup(level: int = logging.INFO, capture_warnings: bool = True) -> logging.Logger:
    rank = os.environ.get("RANK", "0")
    logger = logging.getLogger("trainer")
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(FORMAT.format(rank=rank), datefmt=DATEFMT))
    handler.addFilter(_Once())
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    if capture_warnings:
        warnings.showwarning = _show_warning
    return logger
