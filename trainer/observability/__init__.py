"""Observability of a training run: profiler traces, CUDA memory snapshots, a hang watchdog, the run
summary and optional Weights & Biases logging (user guide: docs/observability.md).

``Trainer.train`` uses it like this::

    with Observability(trainer.observed_run()) as obs:   # starts profiler, memory history, watchdog; summary at the end
        for step in ...:
            with obs.step(step):           # crash and hang drills; CUDA out-of-memory -> memory snapshot
                out = trainer.train_step(step)
            ...
            with obs.checkpoint():         # "checkpoint" profiler range; the watchdog allows a slow save
                trainer.checkpointer.maybe_save(step)
            obs.step_done(step)            # watchdog heartbeat, profiler step, scheduled memory snapshot

The [metrics], [profiling] and [comm] sections and their rules are in config.py (torch-free); import
from the defining submodule (session.py, profiling.py, watchdog.py, flight_recorder.py, sinks.py).
failures.py says, in one line, why a rank failed when the cause is another rank or the disk
(``trainer.train.main`` reports it; the exit codes are in trainer/errors.py).

Everything here is best effort: a failure to write a trace, a snapshot or the summary is logged as a
warning and never stops training. Only the watchdog ends a run (on purpose).
"""
