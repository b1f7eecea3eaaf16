"""The observability session around the loop (profiler, memory history, watchdog) and the run summary."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.profiler import record_function

from trainer.observability.flight_recorder import comm_traces_folder, dump_flight_recorder
from trainer.observability.profiling import MemorySnapshots, Profiler
from trainer.observability.sinks import _LastRecord, build_wandb_writer
from trainer.observability.watchdog import WATCHDOG_FOLDER, Watchdog, stall_for_drill

if TYPE_CHECKING:
    from trainer.checkpoint.manager import CheckpointManager
    from trainer.checkpoint.state import TrainState
    from trainer.config import JobConfig
    from trainer.metrics import MetricsWriter

logger = logging.getLogger("trainer")

_PROCESS_START = time.time()  # about when this process imported the trainer (start-up time in the summary)


def crash_for_drill(debug, rank: int, step: int) -> None:
    """debug.crash_at_step: SIGKILL this rank before the step, on torchrun's first attempt only."""
    d = debug
    if (d.crash_at_step and step == d.crash_at_step and rank == d.crash_rank
            and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0):
        logger.warning("debug.crash_at_step: rank %d kills itself (SIGKILL) before step %d (crash drill)", rank, step)
        os.kill(os.getpid(), signal.SIGKILL)


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def summary_line(s: dict[str, Any]) -> str:
    """The summary as one console line."""
    parts = [f"run summary: {s['status']}",
             f"step {s['step']}/{s['steps_total']} ({s['steps_this_run']} this run) in {format_duration(s['train_time_s'])}",
             f"{s['tokens_seen']:,} tokens"]
    if s.get("tps_mean") is not None:
        mfu = f", mfu {s['mfu_mean']:.1f}%" if s.get("mfu_mean") is not None else ""
        parts.append(f"{s['tps_mean']:,.0f} tps/device{mfu}")
    if s.get("last_loss") is not None:
        parts.append(f"last loss {s['last_loss']:.4f}")
    parts.append(f"{s['skipped_steps']} skipped step(s)")
    if s.get("checkpoints_saved") is not None:
        parts.append(f"{s['checkpoints_saved']} checkpoint(s) saved")
    outputs = s["outputs"]
    names = [Path(p).name + ("/" if Path(p).is_dir() else "") for k, p in outputs.items() if k != "dump_folder"]
    parts.append(f"outputs in {outputs['dump_folder']} ({', '.join(['summary.json'] + names)})")
    line = "; ".join(parts)
    if s.get("error"):
        line += f"\n  error: {s['error']}"
    return line


# --------------------------------------------------------------------------------------------------
# The whole
# --------------------------------------------------------------------------------------------------


@dataclass
class ObservedRun:
    """What the session reads of the run it watches."""

    config: JobConfig
    state: TrainState  # step, tokens_seen, skipped_steps: read live, for the summary
    device: torch.device
    rank: int = 0
    world_size: int = 1
    is_logging_rank: bool = True
    metrics: MetricsWriter | None = None  # gets the summary's last-record sink and W&B's
    flops_per_token: int | None = None  # with peak_tflops: the summary's mean TFLOPS and MFU
    peak_tflops: float | None = None
    checkpointer: CheckpointManager | None = None  # its saves and failures go into the summary
    extra_summary: Callable[[], dict[str, Any]] | None = None  # more fields (fault tolerance's)


class Observability:
    """Profiler, memory snapshots, watchdog, W&B and the summary around ``Trainer.train``'s loop."""

    def __init__(self, run: ObservedRun):
        self.run = run
        config = self.config = run.config
        self.rank = run.rank
        self.world_size = run.world_size
        self.is_logging_rank = run.is_logging_rank
        self.dump_folder = Path(config.job.dump_folder)
        use_cuda = run.device.type == "cuda"
        self.start_step = run.state.step
        self.profiler = Profiler(config.profiling, self.dump_folder / config.profiling.save_traces_folder,
                                 self.rank, self.start_step + 1, use_cuda)
        self.memory = MemorySnapshots(config.profiling,
                                      self.dump_folder / config.profiling.save_memory_snapshot_folder,
                                      self.rank, use_cuda)
        self.watchdog: Watchdog | None = None
        timeout = config.comm.watchdog_timeout_seconds
        if timeout > 0:
            self.watchdog = Watchdog(
                timeout, self.dump_folder / WATCHDOG_FOLDER, self.rank,
                first_timeout_s=config.comm.init_timeout_seconds,
                on_fire=lambda message: self.write_summary("hung", message),
                flight_recorder=lambda: dump_flight_recorder(
                    comm_traces_folder(config), config.comm.save_traces_file_prefix, self.rank,
                    extra_folder=self.dump_folder / WATCHDOG_FOLDER),
            )
        self.last_record = _LastRecord()
        self.current_step = self.start_step
        self.t_start = self.t_first = self.t_last = None
        self.tokens_start = self.tokens_first = run.state.tokens_seen
        self.oom_dumped = False
        self.summary: dict[str, Any] | None = None
        self._summary_lock = threading.Lock()

    # Loop hooks ------------------------------------------------------------------------------------

    def __enter__(self) -> "Observability":
        self.t_start = time.perf_counter()
        self.tokens_start = self.run.state.tokens_seen
        metrics = self.run.metrics
        if metrics is not None and self.is_logging_rank:
            metrics.add_sink(self.last_record)
            wandb_writer = build_wandb_writer(self.config, self.dump_folder)
            if wandb_writer is not None:
                metrics.add_sink(wandb_writer)
        for what, start in (("memory history", self.memory.start), ("profiler", self.profiler.start)):
            try:
                start()
            except Exception as e:
                logger.warning("%s could not start, continuing without it: %s", what, e)
        if self.watchdog is not None:
            self.watchdog.start()
        return self

    @contextlib.contextmanager
    def step(self, step: int):
        """Around one training step: the crash and hang drills, and a memory snapshot on CUDA out-of-memory."""
        self.current_step = step
        d = self.config.debug
        crash_for_drill(d, self.rank, step)
        if d.stall_at_step and step == d.stall_at_step and self.rank == d.stall_rank:
            logger.warning("debug.stall_at_step: rank %d stalls for %.0f s before step %d (hang drill)",
                           self.rank, d.stall_seconds, step)
            stall_for_drill(d.stall_seconds)
        try:
            yield
        except torch.cuda.OutOfMemoryError:
            self._on_oom(step)
            raise

    @contextlib.contextmanager
    def checkpoint(self):
        """Around checkpoint work: a "checkpoint" profiler range; the watchdog allows the save's timeout."""
        if self.watchdog is not None:
            self.watchdog.allow(self.config.checkpoint.timeout_seconds)
        try:
            with record_function("checkpoint"):
                yield
        finally:
            if self.watchdog is not None:
                self.watchdog.heartbeat()

    def step_done(self, step: int) -> None:
        """After a step and its logging and checkpoint: heartbeat, profiler step, memory snapshot."""
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first, self.tokens_first = now, self.run.state.tokens_seen
        self.t_last = now
        self.current_step = step
        if self.watchdog is not None:
            self.watchdog.heartbeat(step)
        self.memory.maybe_dump(step)
        self.profiler.step(step)  # may write a trace
        if self.watchdog is not None:
            self.watchdog.heartbeat(step)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.watchdog is not None:
            self.watchdog.stop()
        if exc_type is not None and issubclass(exc_type, torch.cuda.OutOfMemoryError):
            self._on_oom(self.current_step)
        stops = (("profiler", lambda: self.profiler.stop(failed=exc_type is not None)),
                 ("memory history", self.memory.stop))
        for what, stop in stops:
            try:
                stop()
            except Exception as e:
                logger.warning("stopping the %s: %s", what, e)
        if exc_type is None:
            self.write_summary("completed")
        elif getattr(exc, "summary_status", None):  # e.g. a preemption: stopped on purpose, after saving
            self.write_summary(exc.summary_status, str(exc))
        elif issubclass(exc_type, KeyboardInterrupt):
            self.write_summary("interrupted", "KeyboardInterrupt")
        else:
            self.write_summary("failed", f"{exc_type.__name__}: {exc}"[:2000])
        return False

    def _on_oom(self, step: int) -> None:
        if not self.oom_dumped:
            self.oom_dumped = True
            self.memory.on_oom(step)

    # Summary ---------------------------------------------------------------------------------------

    def build_summary(self, status: str, error: str | None = None) -> dict[str, Any]:
        run, config = self.run, self.config
        state = run.state
        now = time.perf_counter()
        t_start = self.t_start if self.t_start is not None else now
        tokens_run = state.tokens_seen - self.tokens_start
        # Mean speed after the first step (compilation and warm-up), unless there was only one step.
        if self.t_first is not None and self.t_last is not None and self.t_last > self.t_first:
            dt, tokens = self.t_last - self.t_first, state.tokens_seen - self.tokens_first
        elif self.t_last is not None and self.t_last > t_start:
            dt, tokens = self.t_last - t_start, tokens_run
        else:
            dt, tokens = 0.0, 0
        tps = tokens / self.world_size / dt if dt > 0 else None
        fpt, peak = run.flops_per_token, run.peak_tflops
        tflops = tps * fpt / 1e12 if tps is not None and fpt else None
        mfu = 100.0 * tflops / peak if tflops is not None and peak else None
        checkpointer = run.checkpointer
        saving = checkpointer is not None and checkpointer.enabled
        saves = checkpointer.saves if saving else None
        last = self.last_record.record or {}
        outputs: dict[str, str] = {"dump_folder": str(self.dump_folder.resolve())}
        candidates = {
            "config": self.dump_folder / "config.toml",
            "metrics": self.dump_folder / "metrics.jsonl",
            "tensorboard": self.dump_folder / config.metrics.save_tb_folder,
            "checkpoints": self.dump_folder / config.checkpoint.folder,
            "profile_traces": self.profiler.folder,
            "memory_snapshots": self.memory.folder,
            "watchdog": self.dump_folder / WATCHDOG_FOLDER,
            "comm_traces": comm_traces_folder(config),
        }
        for key, path in candidates.items():
            if _has_content(path):
                outputs[key] = str(path.resolve())
        summary = {
            "status": status,
            "error": error,
            "description": config.job.description,
            "step": state.step,
            "steps_total": config.training.steps,
            "start_step": self.start_step,
            "steps_this_run": state.step - self.start_step,
            "tokens_seen": state.tokens_seen,
            "tokens_this_run": tokens_run,
            "train_time_s": round(now - t_start, 3),
            "startup_s": round(time.time() - _PROCESS_START - (now - t_start), 3),
            "tps_mean": tps,
            "tflops_mean": tflops,
            "mfu_mean": mfu,
            "skipped_steps": state.skipped_steps,
            "checkpoints_saved": saves,
            "checkpoint_failures": checkpointer.failures if saving else None,
            "last_loss": last.get("loss"),
            "data_skipped": last.get("data_skipped", {}),
            "last_logged_step": last.get("step"),
            "world_size": self.world_size,
            "memory_gib": _memory_gib(run.device),
            "profiler_traces": [str(p) for p in self.profiler.written],
            "memory_snapshots": [str(p) for p in self.memory.written],
            "outputs": outputs,
        }
        if run.extra_summary is not None:
            summary.update(run.extra_summary())
        return summary

    def write_summary(self, status: str, error: str | None = None) -> dict[str, Any] | None:
        """Build the summary; rank 0 logs it and writes ``<dump_folder>/summary.json``. Once per run."""
        with self._summary_lock:
            if self.summary is not None:
                return self.summary
            try:
                self.summary = self.build_summary(status, error)
            except Exception as e:
                logger.warning("run summary failed: %s", e)
                return None
        if self.is_logging_rank:
            path = self.dump_folder / "summary.json"
            try:
                self.dump_folder.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".json.tmp")
                tmp.write_text(json.dumps(self.summary, indent=2) + "\n")
                os.replace(tmp, path)
            except OSError as e:
                logger.warning("could not write %s: %s", path, e)
            log = logger.info if status == "completed" else logger.error
            log(summary_line(self.summary))
        return self.summary


def _has_content(path: Path) -> bool:
    """A non-empty file, or a folder with one somewhere below it."""
    try:
        if path.is_file():
            return path.stat().st_size > 0
        return path.is_dir() and any(p.is_file() and p.stat().st_size > 0 for p in path.rglob("*"))
    except OSError:
        return False


def _memory_gib(device: torch.device) -> float | None:
    """Max reserved GPU memory of this rank, or its resident set size on CPU."""
    try:
        from trainer.metrics import memory_gib

        return round(memory_gib(device), 3)
    except Exception:  # pragma: no cover
        return None
