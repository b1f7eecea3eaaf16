"""Console logging: timestamps and rank on every line; warnings said once."""

from __future__ import annotations

import logging
import os
import sys


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


def setup(level: int = logging.INFO) -> logging.Logger:
    rank = os.environ.get("RANK", "0")
    logger = logging.getLogger("trainer")
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s",
                                           datefmt="%Y-%m-%d %H:%M:%S"))
    handler.addFilter(_Once())
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger
