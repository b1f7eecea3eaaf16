"""How the ranks agree on a checkpoint's fate: every save and load step ends with all ranks knowing
whether any of them failed, and why, so that they all take the same branch (commit or clean up, try
the previous checkpoint or stop) and none waits forever in a collective the others skipped.

Checkpoint coordination runs on its own gloo group: it must not share a communicator with training
collectives (nor with an asynchronous save's background thread), and writing a big checkpoint may
outlast the training collectives' short timeout.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("trainer")

try:  # DCP's CheckpointException derives from BaseException, not Exception
    from torch.distributed.checkpoint.api import CheckpointException as _DCPException
except ImportError:  # pragma: no cover
    _DCPException = Exception

# What a failing save or load raises; anything else (KeyboardInterrupt, SystemExit) passes through.
ERRORS = (Exception, _DCPException)


def format_exception(e: BaseException) -> str:
    """One line per failing rank for DCP's CheckpointException, else ``Type: message``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, wrapped in sorted(failures.items()):
            exc = wrapped[0] if isinstance(wrapped, tuple) else getattr(wrapped, "exc", wrapped)
            parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        return "; ".join(parts)
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}".strip()


def attempt(what: str, fn: Callable, *args: Any, **kwargs: Any) -> tuple[Any, str | None]:
    """``(fn(...), None)``, or ``(None, reason)`` when it raised: the one-line reason to share with the
    other ranks (the traceback goes to the debug log)."""
    try:
        return fn(*args, **kwargs), None
    except ERRORS as e:
        logger.debug("%s failed:\n%s", what, traceback.format_exc())
        return None, format_exception(e)


class Collectives:
    """The checkpoint's collectives over its process group ``pg`` (None: one process, no-ops). All ranks
    call them in the same order."""

    def __init__(self, pg: Any = None):
        self.pg = pg
        self.initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.initialized else 0
        self.world = dist.get_world_size() if self.initialized else 1

    @property
    def distributed(self) -> bool:
        return self.initialized and self.world > 1

    def sum(self, values: list[int]) -> list[int]:
        """Element-wise sum over ranks."""
        t = torch.tensor(values, dtype=torch.int64)
        if self.distributed:
            dist.all_reduce(t, group=self.pg)
        return [int(v) for v in t.tolist()]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank."""
        return self.sum([int(flag)])[0] > 0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a decision rank 0 took alone, e.g. which checkpoint to load)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def gather(self, obj: Any) -> list | None:
        """Every rank's ``obj``, in rank order, on rank 0; None elsewhere."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.pg)
        return out

    def agree(self, error: str | None) -> list[str]:
        """Whether a step failed on any rank: given this rank's error (None: it succeeded), the sorted
        distinct reasons of all failing ranks, the same list on every rank; empty when all succeeded.

        The common case (success) costs one small all-reduce; the reasons are exchanged only on failure.
        """
        if not self.any(error is not None):
            return []
        if self.distributed:
            errors: list = [None] * self.world
            dist.all_gather_object(errors, error, group=self.pg)
        else:
            errors = [error]
        return sorted({e for e in errors if e}) or ["failed on another rank (see its log)"]
