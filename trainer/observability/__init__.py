"""Observability of a training run: profiler traces, CUDA memory snapshots, a hang watchdog, the run
summary and optional Weights & Biases logging (user guide: docs/observability.md).

``Trainer.train`` uses it like this::

    with Observability(trainer.observed_run()) as obs:   # profiler, memory history, watchdog; summary at the end
        for step in ...:
            with obs.step(step):           # hang drill; CUDA out-of-memory -> memory snapshot, re-raised
                out = trainer.train_step(step)
            ...
            with obs.checkpoint():         # "checkpoint" profiler range; the watchdog allows a slow save
                trainer.checkpointer.maybe_save(step)
            obs.step_done(step)            # watchdog heartbeat, profiler step, scheduled memory snapshot

Everything here is best effort: a failure to write a trace, a snapshot or the summary is logged as a
warning and never stops training. Only the watchdog ends a run (on purpose).
"""

from trainer.observability.flight_recorder import comm_traces_folder, dump_flight_recorder, setup_flight_recorder
from trainer.observability.profiling import MEMORY_VIZ, MemorySnapshots, Profiler, dump_cuda_snapshot
from trainer.observability.session import Observability, ObservedRun, format_duration, summary_line
from trainer.observability.sinks import WandbWriter, build_wandb_writer
from trainer.observability.watchdog import WATCHDOG_EXIT_CODE, WATCHDOG_FOLDER, Watchdog, stall_for_drill

__all__ = [
    "MEMORY_VIZ", "WATCHDOG_EXIT_CODE", "WATCHDOG_FOLDER", "MemorySnapshots", "Observability", "ObservedRun", "Profiler",
    "WandbWriter",
    "Watchdog", "build_wandb_writer", "comm_traces_folder", "dump_cuda_snapshot", "dump_flight_recorder",
    "format_duration", "setup_flight_recorder", "stall_for_drill", "summary_line",
]
