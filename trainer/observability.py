"""Observability of a training run: profiler traces, CUDA memory snapshots, a hang watchdog, the run
summary and optional Weights & Biases logging (user guide: docs/observability.md).

``Trainer.train`` uses it like this::

    with Observability(trainer) as obs:   # starts profiler, memory history, watchdog; summary at the end
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

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.profiler import ProfilerAction, record_function


logger = logging.getLogger("trainer")

_PROCESS_START = time.time()  # about when this process imported the trainer (start-up time in the summary)

WATCHDOG_EXIT_CODE = 124  # like timeout(1): the run was stopped because it made no progress
WATCHDOG_FOLDER = "watchdog"  # <dump_folder>/watchdog/rank<r>_stacks.txt
MEMORY_HISTORY_MAX_ENTRIES = 100_000  # allocation events kept for memory snapshots (as torchtitan)
MEMORY_VIZ = "https://pytorch.org/memory_viz"


# --------------------------------------------------------------------------------------------------
# Flight recorder (recent collectives per rank)
# --------------------------------------------------------------------------------------------------


_ENV_SET_HERE: set[str] = set()


def comm_traces_folder(config) -> Path:
    return Path(config.job.dump_folder) / config.comm.save_traces_folder


def setup_flight_recorder(config) -> None:
    """Environment for the collective flight recorder; must run before the process group is created.

    ``comm.trace_buf_size`` entries per rank; NCCL dumps them itself on a collective timeout (to
    ``<dump_folder>/<comm.save_traces_folder>/<prefix><rank>``), and the watchdog dumps them on a hang.
    Variables the user already set are left alone.
    """
    size = config.comm.trace_buf_size
    if size <= 0:
        return
    # torch >= 2.9 names; the older TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE still
    # work but warn. A user's own setting of either name is respected, never overridden.
    values = {"TORCH_FR_BUFFER_SIZE": (str(size), "TORCH_NCCL_TRACE_BUFFER_SIZE"),
              "TORCH_FR_DUMP_TEMP_FILE": (str(comm_traces_folder(config) / config.comm.save_traces_file_prefix),
                                          "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")}
    for name, (value, old_name) in values.items():
        ours = name in _ENV_SET_HERE  # set by an earlier trainer in this process (tests): update it
        if ours or not (name in os.environ or old_name in os.environ):
            os.environ[name] = value
            _ENV_SET_HERE.add(name)
    if torch.cuda.is_available():
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        try:  # NCCL writes there on its own, so the folder must exist beforehand
            comm_traces_folder(config).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            logger.warning("cannot create %s for flight-recorder dumps: %s", comm_traces_folder(config), e)


def dump_flight_recorder(folder: Path, prefix: str, rank: int, extra_folder: Path | None = None) -> list[Path]:
    """Write this rank's flight-recorder buffer(s); returns the files written (none where unavailable).

    ``<folder>/<prefix><rank>`` holds the pickle that ``torchfrtrace <folder>`` reads: NCCL's recorder on
    GPU builds (``_dump_nccl_trace``), otherwise the generic one (gloo; ``_dump_fr_trace``). On GPU builds
    the generic recorder (the CPU/gloo collectives) is also written as JSON to ``extra_folder``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return []
    c10d = torch._C._distributed_c10d
    nccl = getattr(c10d, "_dump_nccl_trace", None) if torch.cuda.is_available() else None
    generic = getattr(c10d, "_dump_fr_trace", None)
    written = []
    main_dump = nccl or generic
    if main_dump is not None:
        path = folder / f"{prefix}{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        path.write_bytes(main_dump())
        written.append(path)
    generic_json = getattr(c10d, "_dump_fr_trace_json", None)
    if nccl is not None and generic_json is not None and extra_folder is not None:
        path = extra_folder / f"rank{rank}_gloo_flight_recorder.json"
        extra_folder.mkdir(parents=True, exist_ok=True)
        path.write_bytes(generic_json())
        written.append(path)
    return written


# --------------------------------------------------------------------------------------------------
# Profiler
# --------------------------------------------------------------------------------------------------


class Profiler:
    """torch.profiler over windows of steps; writes one Chrome/Perfetto trace per rank per window.

    Windows end at every multiple of ``profile_freq``: steps ``N-active+1 .. N`` are recorded (after
    ``warmup`` steps) and written to ``<folder>/iteration_<N>/rank<r>_trace.json``. The trace's
    ``ProfilerStep#<s>`` ranges carry the training step number ``s``, also after a resume.
    """

    def __init__(self, cfg, folder: Path, rank: int, first_step: int, use_cuda: bool):
        self.enabled = cfg.enable_profiling
        self.freq, self.warmup, self.active = cfg.profile_freq, cfg.profiler_warmup, cfg.profiler_active
        self.folder, self.rank, self.first_step, self.use_cuda = folder, rank, first_step, use_cuda
        self.prof: torch.profiler.profile | None = None
        self.written: list[Path] = []
        self.last_done = first_step - 1  # the last completed step
        self.stopping = self.failed = False

    def schedule(self, step: int) -> ProfilerAction:
        """The profiler's action during training step ``step`` (1-based)."""
        r = (step - 1) % self.freq + 1  # 1 .. freq; freq is the last step of a window
        if r > self.freq - self.active:
            return ProfilerAction.RECORD_AND_SAVE if r == self.freq else ProfilerAction.RECORD
        if r > self.freq - self.active - self.warmup:
            return ProfilerAction.WARMUP
        return ProfilerAction.NONE

    def start(self) -> None:
        if not self.enabled:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.use_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        warnings.filterwarnings("ignore", message="Profiler clears events at the end of each cycle")
        prof = torch.profiler.profile(activities=activities, schedule=self.schedule, on_trace_ready=self._save,
                                      record_shapes=True)
        # Count profiler steps in training steps, so ProfilerStep#<n> is step n also after a resume.
        prof.step_num = self.first_step
        prof.current_action = self.schedule(self.first_step)
        if hasattr(prof, "_prev_schedule_action"):  # torch >= 2.13
            prof._prev_schedule_action = prof.current_action
        prof.__enter__()
        self.prof = prof
        if self.rank == 0:
            first = -(-self.first_step // self.freq) * self.freq
            logger.info("profiling: steps %d..%d of every %d (first window ends at step %d; %d warmup step(s)) "
                        "-> %s/iteration_<step>/rank<r>_trace.json", first - self.active + 1, first, self.freq,
                        first, self.warmup, self.folder)

    def step(self, step: int) -> None:
        """After training step ``step`` (and its logging and checkpoint)."""
        self.last_done = step
        if self.prof is not None:
            self.prof.step()

    def stop(self, failed: bool = False) -> None:
        """End profiling. A window cut short is written if it recorded a completed step, or on failure
        (then it ends with the failing step)."""
        if self.prof is not None:
            prof, self.prof = self.prof, None
            self.stopping, self.failed = True, failed
            prof.__exit__(None, None, None)

    def _save(self, prof) -> None:
        name = str(prof.step_num - 1)  # step() has already moved on to the next step
        if self.stopping:
            if self.failed:  # the window ends with the step that failed
                name = f"{prof.step_num}_exit"
            elif self.schedule(self.last_done) in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE):
                name = str(self.last_done)
            else:
                return  # the window had only just begun (its first step never ran): nothing to keep
        path = self.folder / f"iteration_{name}" / f"rank{self.rank}_trace.json"
        t0 = time.perf_counter()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
        except Exception as e:  # a full disk must not end the run
            logger.warning("profiler: could not write %s: %s", path, e)
            return
        self.written.append(path)
        if self.rank == 0:
            logger.info("profiler: trace of step %s written to %s (%.1f s; one file per rank; open in "
                        "https://ui.perfetto.dev)", name, path.parent, time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------------
# CUDA memory snapshots
# --------------------------------------------------------------------------------------------------


def dump_cuda_snapshot(path: Path) -> None:
    """Write the caching allocator's state (and allocation history, if recorded) as a pickle."""
    torch.cuda.memory._dump_snapshot(str(path))


class MemorySnapshots:
    """CUDA memory history, dumped every ``profile_freq`` steps and on out-of-memory.

    Files: ``<folder>/iteration_<step>/rank<r>_memory_snapshot.pickle`` and, on out-of-memory,
    ``<folder>/iteration_<step>_exit/rank<r>_memory_snapshot.pickle``; drag one onto
    https://pytorch.org/memory_viz to see it.
    """

    def __init__(self, cfg, folder: Path, rank: int, use_cuda: bool):
        self.folder, self.rank, self.freq, self.use_cuda = folder, rank, cfg.profile_freq, use_cuda
        self.requested = cfg.enable_memory_snapshot
        self.recording = False
        self.written: list[Path] = []
        if self.requested and not use_cuda:
            logger.warning("profiling.enable_memory_snapshot: CUDA memory snapshots need a GPU; skipped on this "
                           "%s run", "CPU" if not torch.cuda.is_available() else "non-CUDA")

    def start(self) -> None:
        if self.requested and self.use_cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_MAX_ENTRIES)
            self.recording = True
            if self.rank == 0:
                logger.info("memory snapshots: every %d steps and on out-of-memory -> %s/iteration_<step>/"
                            "rank<r>_memory_snapshot.pickle (view at %s)", self.freq, self.folder, MEMORY_VIZ)

    def stop(self) -> None:
        if self.recording:
            self.recording = False
            try:
                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception as e:  # pragma: no cover - cleanup only
                logger.debug("stopping the memory history: %s", e)

    def dump(self, name: str) -> Path | None:
        path = self.folder / name / f"rank{self.rank}_memory_snapshot.pickle"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            dump_cuda_snapshot(path)
        except Exception as e:
            logger.warning("memory snapshot: could not write %s: %s", path, e)
            return None
        self.written.append(path)
        return path

    def maybe_dump(self, step: int) -> None:
        if self.recording and step % self.freq == 0:
            path = self.dump(f"iteration_{step}")
            if path is not None and self.rank == 0:
                logger.info("memory snapshot of step %d written to %s (view at %s)", step, path.parent, MEMORY_VIZ)

    def on_oom(self, step: int) -> Path | None:
        """After a CUDA out-of-memory error: dump the allocator state (with history if recorded)."""
        if not self.use_cuda:
            return None
        path = self.dump(f"iteration_{step}_exit")
        if path is not None:
            hint = "" if self.recording else " (no allocation history: set profiling.enable_memory_snapshot for it)"
            logger.error("rank %d: CUDA out of memory at step %d; memory snapshot written to %s%s; view it at %s",
                         self.rank, step, path, hint, MEMORY_VIZ)
        return path


# --------------------------------------------------------------------------------------------------
# Watchdog
# --------------------------------------------------------------------------------------------------


def stall_for_drill(seconds: float) -> None:
    """The hang drill (debug.stall_at_step): this frame is what the stack dump of the stalled rank shows."""
    time.sleep(seconds)


class Watchdog:
    """Ends a run that stopped making progress, after writing where every thread of this rank was.

    A daemon thread checks the deadline that :meth:`heartbeat` moves forward. When it passes, the thread
    writes all threads' Python stacks to ``<folder>/rank<r>_stacks.txt`` (faulthandler), then the flight
    recorder, calls ``on_fire`` (the run summary), waits ``exit_grace_s`` so that the other ranks (whose
    deadlines pass at about the same time) can write theirs, and exits the process with ``exit_code``.
    Every rank runs one, so ranks blocked in a collective behind a stalled rank dump and exit too.

    Two fallbacks, both in C so they work while the main thread holds the GIL: faulthandler's own timer
    (armed ``backstop_grace_s`` after the deadline; exit code 1) and a stack dump to the same file when
    the process receives SIGTERM (torchrun sends it to the surviving ranks when one fails).
    """

    def __init__(self, timeout_s: float, folder: Path, rank: int, first_timeout_s: float | None = None,
                 poll_s: float | None = None, exit_code: int = WATCHDOG_EXIT_CODE,
                 exit_fn: Callable[[int], Any] = os._exit, on_fire: Callable[[str], Any] | None = None,
                 flight_recorder: Callable[[], list[Path]] | None = None, exit_grace_s: float = 3.0,
                 backstop_grace_s: float = 30.0, dump_on_sigterm: bool = True):
        self.timeout_s = float(timeout_s)
        self.first_timeout_s = float(max(first_timeout_s or 0, timeout_s))
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(0.05, self.timeout_s / 20))
        self.folder, self.rank = folder, rank
        self.path = folder / f"rank{rank}_stacks.txt"
        self.exit_code, self.exit_fn, self.on_fire = exit_code, exit_fn, on_fire
        self.flight_recorder = flight_recorder
        self.exit_grace_s, self.backstop_grace_s = exit_grace_s, backstop_grace_s
        self.backstop = backstop_grace_s > 0
        self.dump_on_sigterm = dump_on_sigterm and hasattr(faulthandler, "register")
        self.deadline = float("inf")
        self.last_progress = time.monotonic()
        self.step: int | None = None
        self.fired = False
        self.file = None
        self._armed = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # Main thread -----------------------------------------------------------------------------------

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a")  # appends: a restarted job keeps the dumps of the hang before
        if self.dump_on_sigterm:
            global _SIGTERM_DUMP_REGISTERED
            faulthandler.register(signal.SIGTERM, file=self.file, all_threads=True, chain=True)
            _SIGTERM_DUMP_REGISTERED = True
        now = time.monotonic()
        self.last_progress = now
        self.deadline = now + self.first_timeout_s
        if self.backstop:  # armed here too: the watchdog thread may never get the GIL to arm it
            self._armed = self.deadline
            faulthandler.dump_traceback_later(self.first_timeout_s + self.backstop_grace_s, exit=True, file=self.file)
        self._thread = threading.Thread(target=self._run, name="trainer-watchdog", daemon=True)
        self._thread.start()

    def heartbeat(self, step: int | None = None) -> None:
        """Progress: the next deadline is ``timeout_s`` from now."""
        now = time.monotonic()
        self.last_progress = now
        self.deadline = now + self.timeout_s
        if step is not None:
            self.step = step

    def allow(self, seconds: float) -> None:
        """Let the work that starts now take ``seconds`` longer than the timeout (e.g. a checkpoint save)."""
        self.deadline = max(self.deadline, time.monotonic() + self.timeout_s + seconds)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.backstop:
            with contextlib.suppress(Exception):
                faulthandler.cancel_dump_traceback_later()
        if self.dump_on_sigterm and self.file is not None:
            global _SIGTERM_DUMP_REGISTERED
            with contextlib.suppress(Exception):
                faulthandler.unregister(signal.SIGTERM)
            _SIGTERM_DUMP_REGISTERED = False
        if self.file is not None:
            empty = os.fstat(self.file.fileno()).st_size == 0
            self.file.close()
            self.file = None
            if empty and not self.fired:  # nothing ever happened: leave no empty files behind
                with contextlib.suppress(OSError):
                    self.path.unlink()
                with contextlib.suppress(OSError):
                    self.folder.rmdir()

    # Watchdog thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            if now < self.deadline:
                if self.backstop and self._armed != self.deadline:
                    self._armed = self.deadline
                    faulthandler.dump_traceback_later(self.deadline - now + self.backstop_grace_s, exit=True,
                                                      file=self.file)
                continue
            self._fire(now)
            return

    def _fire(self, now: float) -> None:
        self.fired = True
        if self.backstop:  # the C timer stays as a fallback for this thread getting stuck below (a full pipe)
            faulthandler.dump_traceback_later(self.exit_grace_s + 60, exit=True, file=self.file)
        waited = now - self.last_progress
        last = f"step {self.step}" if self.step is not None else "none yet"
        message = (f"watchdog: rank {self.rank}: no progress for {waited:.0f} s (limit {self.deadline - self.last_progress:.0f} s; "
                   f"last completed: {last}); Python stacks in {self.path}; exiting with code {self.exit_code}")
        try:
            self.file.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
            self.file.flush()
            faulthandler.dump_traceback(file=self.file, all_threads=True)
            self.file.flush()
        except Exception as e:  # pragma: no cover - keep going to the exit
            logger.error("watchdog: could not write the stacks: %s", e)
        if self.flight_recorder is not None:
            # In a helper thread: reading the recorder can block behind a wedged communicator.
            box: list = []
            helper = threading.Thread(target=lambda: box.append(_safe(self.flight_recorder)), daemon=True)
            helper.start()
            helper.join(timeout=15)
            if box and box[0]:
                message += f"; flight recorder in {', '.join(str(p) for p in box[0])}"
        logger.error(message)
        if self.on_fire is not None:
            _safe(lambda: self.on_fire(message))
        time.sleep(self.exit_grace_s)
        for h in logging.getLogger("trainer").handlers:
            with contextlib.suppress(Exception):
                h.flush()
        self.exit_fn(self.exit_code)


_SIGTERM_DUMP_REGISTERED = False


def _reset_in_forked_child() -> None:
    """Forked children (data-loader workers) do not append their stacks to the parent's file on SIGTERM.
    (faulthandler's timer thread does not survive a fork, so there is nothing to cancel.)"""
    if _SIGTERM_DUMP_REGISTERED:
        with contextlib.suppress(Exception):
            faulthandler.unregister(signal.SIGTERM)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_forked_child)


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:
        logger.warning("watchdog: %s", e)
        return None


# --------------------------------------------------------------------------------------------------
# Weights & Biases (optional)
# --------------------------------------------------------------------------------------------------


class WandbWriter:
    """A metrics sink that mirrors each step record to Weights & Biases.

    Project, entity, run name and mode come from the usual variables (WANDB_PROJECT, default
    "llm-trainer"; WANDB_ENTITY; WANDB_NAME, default the dump folder's name; WANDB_MODE=offline). The run
    id is kept in ``<dump_folder>/wandb/run_id``, so a resumed job continues the same W&B run.
    """

    def __init__(self, wandb_module, config, dump_folder: Path):
        self.wandb = wandb_module
        folder = dump_folder / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "run_id"
        run_id = os.environ.get("WANDB_RUN_ID") or (id_file.read_text().strip() if id_file.exists() else "")
        if not run_id:
            run_id = f"{int(time.time()):x}{os.getpid():x}"
        id_file.write_text(run_id)
        self.run = wandb_module.init(
            project=os.environ.get("WANDB_PROJECT", "llm-trainer"),
            name=os.environ.get("WANDB_NAME") or dump_folder.resolve().name,
            dir=str(dump_folder), config=config.to_dict(), id=run_id, resume="allow",
        )
        self.broken = False

    def write(self, record: dict[str, Any]) -> None:
        if self.broken:
            return
        values = {k: (float(v) if isinstance(v, bool) else v) for k, v in record.items()
                  if k != "step" and isinstance(v, (int, float)) and v is not None}
        try:
            self.wandb.log(values, step=record["step"])
        except Exception as e:
            self.broken = True
            logger.warning("wandb: logging failed, no more W&B records this run: %s", e)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run.finish()


def build_wandb_writer(config, dump_folder: Path) -> WandbWriter | None:
    """The W&B sink if ``metrics.enable_wandb`` and the package is installed; otherwise a clear warning."""
    if not config.metrics.enable_wandb:
        return None
    try:
        import wandb
    except ImportError:
        logger.warning("metrics.enable_wandb is set but the wandb package is not installed (pip install wandb); "
                       "continuing without Weights & Biases")
        return None
    try:
        return WandbWriter(wandb, config, dump_folder)
    except Exception as e:  # not logged in, no network, ...
        logger.warning("metrics.enable_wandb: could not start a W&B run (%s); continuing without it", e)
        return None


class _LastRecord:
    """Metrics sink that remembers the last step record (for the run summary)."""

    def __init__(self):
        self.record: dict[str, Any] | None = None

    def write(self, record: dict[str, Any]) -> None:
        self.record = record

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------------
# Run summary
# --------------------------------------------------------------------------------------------------


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


class Observability:
    """Profiler, memory snapshots, watchdog, W&B and the summary around ``Trainer.train``'s loop.

    ``trainer`` needs: config, rank, world_size, device, state (step, tokens_seen, skipped_steps), and
    optionally checkpointer (saves), metrics (add_sink), flops_per_token, throughput (peak),
    is_logging_rank.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        config = self.config = trainer.config
        self.rank = getattr(trainer, "rank", 0)
        self.world_size = getattr(trainer, "world_size", 1)
        self.is_logging_rank = getattr(trainer, "is_logging_rank", self.rank == 0)
        self.dump_folder = Path(config.job.dump_folder)
        use_cuda = trainer.device.type == "cuda"
        self.start_step = trainer.state.step
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
        self.tokens_start = self.tokens_first = trainer.state.tokens_seen
        self.oom_dumped = False
        self.summary: dict[str, Any] | None = None
        self._summary_lock = threading.Lock()

    # Loop hooks ------------------------------------------------------------------------------------

    def __enter__(self) -> "Observability":
        self.t_start = time.perf_counter()
        self.tokens_start = self.trainer.state.tokens_seen
        metrics = getattr(self.trainer, "metrics", None)
        if metrics is not None and hasattr(metrics, "add_sink") and self.is_logging_rank:
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
        """Around one training step: the hang drill, and a memory snapshot on CUDA out-of-memory."""
        self.current_step = step
        d = self.config.debug
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
            self.t_first, self.tokens_first = now, self.trainer.state.tokens_seen
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
        trainer, config = self.trainer, self.config
        state = trainer.state
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
        fpt = getattr(trainer, "flops_per_token", None)
        peak = getattr(getattr(trainer, "throughput", None), "peak", None)
        tflops = tps * fpt / 1e12 if tps is not None and fpt else None
        mfu = 100.0 * tflops / peak if tflops is not None and peak else None
        checkpointer = getattr(trainer, "checkpointer", None)
        saves = getattr(checkpointer, "saves", None) if getattr(checkpointer, "enabled", False) else None
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
            "checkpoint_failures": getattr(checkpointer, "failures", None) if saves is not None else None,
            "last_loss": last.get("loss"),
            "last_logged_step": last.get("step"),
            "world_size": self.world_size,
            "memory_gib": _memory_gib(trainer.device),
            "profiler_traces": [str(p) for p in self.profiler.written],
            "memory_snapshots": [str(p) for p in self.memory.written],
            "outputs": outputs,
        }
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
