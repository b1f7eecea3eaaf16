"""Preemption and orphan workers.

SIGTERM (what Slurm and PBS send ahead of the kill, and what torchrun forwards when it is stopped) and
SIGINT (Ctrl-C) only set a flag. Every ``checkpoint.preemption_check_steps`` steps the ranks agree on it
(one all-reduce of one integer on the checkpoint's gloo group: no device synchronisation); when any rank
was signalled, every rank has finished the same step, a background save in flight is waited for, a full
checkpoint of that step is saved (unless the interval save just wrote it), summary.json says
``preempted`` and the process exits with 128 + the signal's number (143 for SIGTERM, 130 for SIGINT) and
one line. The latency from the signal to the save is at most ``preemption_check_steps`` steps plus the
save. A second signal while stopping is ignored; torchrun's agent kills the workers after its shutdown
timeout (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, which run_train.sh sets to 110 s).

Workers ask the kernel for SIGKILL when their parent (the torchrun agent) dies (``PR_SET_PDEATHSIG``), so
a ``kill -9`` of the agent leaves no worker training on, unseen, racing a restart.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from trainer.errors import TrainerError

if TYPE_CHECKING:
    from trainer.checkpoint.manager import CheckpointManager

logger = logging.getLogger("trainer")

PR_SET_PDEATHSIG = 1
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(TrainerError):
    """The run stopped on SIGTERM/SIGINT after saving; exit code 128 + the signal's number."""

    label = "preempted"
    summary_status = "preempted"

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def die_with_parent() -> None:
    """Under torchrun: SIGKILL this process when its parent (the agent) dies. Linux only; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if parent == 1 or os.getppid() != parent:  # the agent died before the request took effect
        os._exit(128 + int(signal.SIGKILL))


class PreemptionHandler:
    """Signal handlers for the training loop and the agreement on stopping."""

    def __init__(self, check_steps: int, group=None):
        self.check_steps = max(1, int(check_steps))
        self.group = group
        self.signum = 0
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        for sig in SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. an embedding application): signals stay as they are
                return

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum:
            return  # stopping already (torchrun forwards the signal the job also got)
        self.signum = signum
        logger.warning("received %s: the run finishes its step, agrees with the other ranks (every %d step(s)), "
                       "saves a checkpoint and stops", signal.Signals(signum).name, self.check_steps)

    def agreed(self, step: int) -> int:
        """On check steps: the signal any rank received (0: none). Every rank calls it at every step."""
        if step % self.check_steps:
            return 0
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.signum
        t = torch.tensor([self.signum], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())


def stop(checkpointer: CheckpointManager, step: int, signum: int) -> None:
    """All ranks: wait for a background save, save a full checkpoint of ``step`` and raise :class:`Preempted`."""
    name = signal.Signals(signum).name
    if not checkpointer.enabled:
        saved = "checkpoint.enable is false: nothing saved"
    elif checkpointer.save_for_preemption(step):
        saved = f"checkpoint step-{step} saved in {checkpointer.folder}; run the same command to resume from it"
    else:
        saved = f"the checkpoint of step {step} could not be saved (see the log)"
    raise Preempted(f"stopped by {name} after step {step}; {saved}", signum)
