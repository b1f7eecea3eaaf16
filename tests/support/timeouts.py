"""A hung test fails on its own time limit, with the stacks of what it waits for, instead of hanging the suite.

Each phase of a test (setup, call, teardown) has a limit: the seconds of its ``@pytest.mark.timeout(seconds)``
for the few long ones, else its tier's (``TIER_LIMIT_S``: above the timeouts the multi-process tests set
themselves, so those fire first with their own messages), else ``DEFAULT_LIMIT_S``.
``TEST_TIMEOUT=<seconds>`` replaces the defaults (not a marker's) and ``TEST_TIMEOUT=0`` turns the limits off
(e.g. to sit in a debugger). Past its limit a watchdog thread
writes, to the stderr pytest started with (not a test's capture): which test and phase, the stacks of the
processes the test started (tests/support/processes.py), this process's own stacks; then kills those
processes and exits this process with status 1. Under pytest-xdist the controller reports the test as
failed ("worker crashed while running ...") and carries on with a fresh worker; without it the session
ends there, the stacks being its report. faulthandler's C timer, armed a little later, does the same for
this process if the watchdog thread cannot run (a thread holding the GIL).

The session's own teardown (waiting for the batched runs, tests/conftest.py) runs in the teardown of the
last test: that phase gets ``SESSION_TEARDOWN_S``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.support import processes

DEFAULT_LIMIT_S = 300.0
# A training run through run_train.sh waits up to 600 s (tests/support/launch.py); a test reading the batched
# runs up to 1200 s for them (tests/support/batches.py, Batches.get).
TIER_LIMIT_S = {"tests/e2e/": 900.0, "tests/distributed/": 900.0}
RUNS_LIMIT_S = 1260.0
SESSION_TEARDOWN_S = 1900.0  # the batched runs' wait at the session's end (1800 s), and a margin
BACKSTOP_GRACE_S = 30.0  # faulthandler's timer: after the watchdog has had time to write and exit
MARKER = "timeout(seconds): this test's time limit per phase (tests/support/timeouts.py; default 300 s)"


class Watchdog:
    """One thread waiting for the armed deadline; :meth:`arm` / :meth:`disarm` around each phase."""

    def __init__(self, out, stacks_folder: Path):
        self.out = out
        self.stacks_folder = stacks_folder
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        self._limit = 0.0
        threading.Thread(target=self._run, name="test-timeout", daemon=True).start()

    def arm(self, limit: float, what: str) -> None:
        with self._cond:
            self._deadline, self._what, self._limit = time.monotonic() + limit, what, limit
            self._cond.notify()
        faulthandler.dump_traceback_later(limit + BACKSTOP_GRACE_S, exit=True, file=self.out)

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        with self._cond:
            self._deadline = None
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while self._deadline is None or time.monotonic() < self._deadline:
                self._cond.wait(None if self._deadline is None else self._deadline - time.monotonic())
            what, limit = self._what, self._limit
        self.out.write(f"\n=== {what} ran past its time limit of {limit:.0f} s (tests/support/timeouts.py; a "
                       f"longer test says @pytest.mark.timeout(seconds)): the stacks of what it waits for ===\n")
        processes.dump_stacks(self.out)
        self.out.write(f"\n--- stacks of the test process {os.getpid()} ---\n")
        self.out.flush()
        faulthandler.dump_traceback(file=self.out, all_threads=True)
        self.out.write(f"=== {what}: failed on its time limit of {limit:.0f} s ===\n")
        self.out.flush()
        processes.kill_all()
        shutil.rmtree(self.stacks_folder, ignore_errors=True)
        os._exit(1)


_watchdog: Watchdog | None = None


def install(config) -> None:
    """Start the watchdog for this session (pytest_configure), unless TEST_TIMEOUT=0."""
    global _watchdog
    config.addinivalue_line("markers", MARKER)
    if _default_limit() <= 0:
        return
    # The stderr pytest started with (a test's capture is discarded when this process exits). Capture is
    # suspended here (pytest suspends it once the conftests are loaded): resuming it unconditionally would
    # hand the terminal reporter a captured stdout, and the session's output would be lost.
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        out = os.fdopen(os.dup(2), "w", buffering=1, errors="replace")
    folder = Path(tempfile.mkdtemp(prefix="test-stacks-"))
    processes.collect_stacks_in(folder)
    _watchdog = Watchdog(out, folder)


def uninstall() -> None:
    """Stop limiting (pytest_unconfigure); the stacks folder goes."""
    global _watchdog
    if _watchdog is None:
        return
    _watchdog.disarm()
    processes.collect_stacks_in(None)
    shutil.rmtree(_watchdog.stacks_folder, ignore_errors=True)
    _watchdog = None


def limited(item, phase: str, last: bool = False):
    """Context for one phase of ``item``: armed with its limit, disarmed after."""
    return _Phase(item, phase, last)


class _Phase:
    def __init__(self, item, phase: str, last: bool):
        self.item, self.phase, self.last = item, phase, last

    def __enter__(self):
        if _watchdog is not None:
            limit = _limit(self.item)
            if self.last and self.phase == "teardown":
                limit = max(limit, SESSION_TEARDOWN_S)
            _watchdog.arm(limit, f"{self.item.nodeid} ({self.phase})")
        return self

    def __exit__(self, *exc):
        if _watchdog is not None:
            _watchdog.disarm()
        return False


def _limit(item) -> float:
    mark = item.get_closest_marker("timeout")
    if mark is not None:
        return float(mark.args[0])
    if "TEST_TIMEOUT" in os.environ:
        return _default_limit()
    if item.get_closest_marker("runs") is not None:
        return RUNS_LIMIT_S
    path = item.nodeid.split("::")[0]
    return next((v for tier, v in TIER_LIMIT_S.items() if path.startswith(tier)), DEFAULT_LIMIT_S)


def _default_limit() -> float:
    value = os.environ.get("TEST_TIMEOUT", "")
    try:
        return float(value) if value else DEFAULT_LIMIT_S
    except ValueError:
        raise pytest.UsageError(f"TEST_TIMEOUT={value!r} is not a number of seconds (0: no limit)") from None
