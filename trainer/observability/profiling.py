"""torch.profiler traces and CUDA memory snapshots, on the profiling.* schedule."""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerAction

from trainer.torch_compat import (
    dump_cuda_memory_snapshot,
    set_profiler_step,
    start_cuda_memory_history,
    stop_cuda_memory_history,
)

logger = logging.getLogger("trainer")

MEMORY_HISTORY_MAX_ENTRIES = 100_000  # allocation events kept for memory snapshots (as torchtitan)
MEMORY_VIZ = "https://pytorch.org/memory_viz"


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
        set_profiler_step(prof, self.first_step, self.schedule(self.first_step))
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
    dump_cuda_memory_snapshot(str(path))


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
            start_cuda_memory_history(MEMORY_HISTORY_MAX_ENTRIES)
            self.recording = True
            if self.rank == 0:
                logger.info("memory snapshots: every %d steps and on out-of-memory -> %s/iteration_<step>/"
                            "rank<r>_memory_snapshot.pickle (view at %s)", self.freq, self.folder, MEMORY_VIZ)

    def stop(self) -> None:
        if self.recording:
            self.recording = False
            try:
                stop_cuda_memory_history()
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
