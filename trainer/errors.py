"""Errors a user can cause, and the exit code each one ends the process with.

A user's mistake (config, data, checkpoint, tokenizer, disk, signal) is raised as one of these and printed
as one line naming the cause and the fix; anything else is a bug and keeps its traceback. This module
imports nothing, so every layer can raise these without import cycles.

| code | error |
| ---- | ----- |
| 1    | a bug (an unexpected exception; traceback printed) |
| 2    | ConfigError: a configuration or command-line mistake |
| 3    | CheckpointError / StopTraining: a checkpoint that cannot be saved or loaded; a guard stopped the run |
| 4    | DataError: data that cannot be trained on; too many skipped documents (data.max_skipped_fraction) |
| 5    | OutputError: the dump folder cannot be written (disk full, read-only, a file where a folder should be) |
| 6    | another live run holds the dump folder (its run.lock; trainer/runlock.py) |
| 7    | PeerLost: another rank or node of the job stopped or hung (a collective timed out or lost its peer, the rendezvous closed); the cause is on that rank's console; or a fault-tolerant job's lighthouse (TORCHFT_LIGHTHOUSE) does not answer |
| 124  | the hang watchdog stopped a run that made no progress (trainer/observability/watchdog.py; like timeout(1)) |
| 128+N | stopped by signal N after saving a checkpoint (143: SIGTERM, 130: SIGINT; trainer/preemption.py); Ctrl-C before the training loop: one line, 130 (trainer/interrupt.py) |
"""

from __future__ import annotations


class TrainerError(Exception):
    """Base of every user-facing error: printed as one line, process exits with ``exit_code``."""

    exit_code = 1
    label = "error"


class ConfigError(TrainerError, ValueError):
    """A configuration the user must fix; the message names the key and what would be valid."""

    exit_code = 2
    label = "config error"


class CheckpointError(TrainerError, RuntimeError):
    """A checkpoint could not be saved or loaded and the run must stop."""

    exit_code = 3
    label = "checkpoint error"


class StopTraining(TrainerError):
    """A stability guard ended the run after logging why (too many consecutive skipped steps, ...)."""

    exit_code = 3
    label = "stopped"


class DataError(TrainerError, RuntimeError):
    """Data that cannot be trained on (a shard with no usable documents, a file that changed, ...)."""

    exit_code = 4
    label = "data error"


class OutputError(TrainerError, OSError):
    """The run's outputs (dump folder: metrics, config, summary) cannot be written."""

    exit_code = 5
    label = "output error"


class PeerLost(TrainerError, RuntimeError):
    """This rank or node lost the rest of the job: a collective timed out or lost its peer, or the job's
    store or rendezvous closed. The cause is another rank's or node's (its console has it), not this one's."""

    exit_code = 7
    label = "error"


class DataStateError(DataError, ValueError):
    """A data-loader state that cannot be loaded into this loader (other data, shard count, rank layout)."""
