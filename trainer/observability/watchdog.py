"""The hang watchdog: every rank dumps its stacks when no step completes in time, then the run exits."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable


logger = logging.getLogger("trainer")

WATCHDOG_EXIT_CODE = 124  # like timeout(1): the run was stopped because it made no progress
WATCHDOG_FOLDER = "watchdog"  # <dump_folder>/watchdog/rank<r>_stacks.txt


def _main_thread_stack() -> str:
    """The main thread's stack, written first: faulthandler lists at most 100 threads, newest first, so in a
    process with many (data workers' feeders, prefetch threads) the thread that trains could be cut off."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return ""
    return "Main thread (most recent call last):\n" + "".join(traceback.format_stack(frame)) + "\n"


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
                 backstop_grace_s: float = 30.0, dump_on_sigterm: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock  # seconds; tests pass one they advance by hand
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
        self.last_progress = self.clock()
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
        now = self.clock()
        self.last_progress = now
        self.deadline = now + self.first_timeout_s
        if self.backstop:  # armed here too: the watchdog thread may never get the GIL to arm it
            self._armed = self.deadline
            faulthandler.dump_traceback_later(self.first_timeout_s + self.backstop_grace_s, exit=True, file=self.file)
        self._thread = threading.Thread(target=self._run, name="trainer-watchdog", daemon=True)
        self._thread.start()

    def heartbeat(self, step: int | None = None) -> None:
        """Progress: the next deadline is ``timeout_s`` from now."""
        now = self.clock()
        self.last_progress = now
        self.deadline = now + self.timeout_s
        if step is not None:
            self.step = step

    def allow(self, seconds: float) -> None:
        """Let the work that starts now take ``seconds`` longer than the timeout (e.g. a checkpoint save)."""
        self.deadline = max(self.deadline, self.clock() + self.timeout_s + seconds)

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
            now = self.clock()
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
            self.file.write(_main_thread_stack())
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
