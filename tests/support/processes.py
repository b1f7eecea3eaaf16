"""The processes a test starts, and their trees: start (registered, dying with the test process), wait,
kill, and their stacks when a test hangs.

Every process started here is registered: :func:`kill_all` (called at the end of the session and from the
SIGTERM/SIGINT handlers that tests/conftest.py installs) kills each one with every process below it. Each
also gets ``PR_SET_PDEATHSIG`` (Linux): it is killed when the test process dies, even by SIGKILL. The
launcher (run_train.sh) execs torchrun's agent, and the agent's workers die with the agent
(trainer.preemption.die_with_parent), so no run outlives pytest.

Once :func:`collect_stacks_in` names a folder, every Python process started here (and every one below it)
writes its threads' stacks there on SIGUSR1 (tests/support/stacks/sitecustomize.py); :func:`dump_stacks`
asks for them and copies them out (tests/support/timeouts.py, when a test runs past its limit).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
_SITECUSTOMIZE = Path(__file__).with_name("stacks")  # the folder holding sitecustomize.py

# The limit for a command that takes seconds on an idle machine (a Python start that imports torch, a run
# stopping). The suite runs its batched multi-process runs beside its two workers on two cores, so such a
# command can take minutes there: CI once saw a 3-second `trainer checkpoint verify` pass 120 s. Below the
# unit tier's 300-s test limit (tests/support/timeouts.py), so the command's own message comes first.
QUICK_S = 280.0

_started: dict[int, subprocess.Popen] = {}
_lock = threading.Lock()
_stacks_folder: Path | None = None


def _die_with_test_process() -> None:
    """preexec_fn: SIGKILL this child when the thread that started it (pytest's) dies."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass


def popen(cmd: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` in a session of its own, registered for :func:`kill_all` and killed when this
    process dies. Start it from the main thread: the death signal follows the thread that started it."""
    kwargs.setdefault("start_new_session", True)
    if _stacks_folder is not None:
        env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
        env["PYTHONPATH"] = os.pathsep.join([str(_SITECUSTOMIZE), *filter(None, [env.get("PYTHONPATH")])])
        env["TEST_STACKS_DIR"] = str(_stacks_folder)
        kwargs["env"] = env
    proc = subprocess.Popen(cmd, preexec_fn=_die_with_test_process, **kwargs)
    with _lock:
        _started[proc.pid] = proc
    return proc


def run(cmd: list[str], *, timeout: float | None = None, input: str | None = None,
        **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` through :func:`popen`: on a timeout or an
    interrupt the whole process tree is killed."""
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    kwargs.setdefault("text", True)
    proc = popen(cmd, stdin=subprocess.PIPE if input is not None else None, **kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except BaseException:
        kill_tree(proc)
        raise
    finally:
        forget(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def forget(proc: subprocess.Popen) -> None:
    """Unregister a process that has ended (or whose tree was killed)."""
    with _lock:
        _started.pop(proc.pid, None)


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children first), from /proc. torchrun starts its workers in sessions of
    their own, so a process-group kill would miss them."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """Running (a zombie is not)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return False


def kill_tree(proc: subprocess.Popen | int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to a process and every process below it at once (kill -9 of a whole job by default:
    a lost node, ``scancel -s KILL``). Collected first, so a dying parent cannot hide its children."""
    pid = proc if isinstance(proc, int) else proc.pid
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass
    if not isinstance(proc, int) and sig == signal.SIGKILL:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        forget(proc)


def kill_all() -> None:
    """Kill every registered process tree still running (end of session, SIGTERM or SIGINT of pytest)."""
    with _lock:
        procs = list(_started.values())
        _started.clear()
    trees = [(p, [p.pid, *descendants(p.pid)]) for p in procs if p.poll() is None]
    for _, pids in trees:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    for p, _ in trees:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def collect_stacks_in(folder: Path | None) -> None:
    """Processes started from now on write their stacks to ``folder/<pid>.txt`` on SIGUSR1 (None: stop)."""
    global _stacks_folder
    _stacks_folder = folder


def dump_stacks(out, wait: float = 2.0) -> None:
    """Write to ``out`` the stacks of every Python process in the registered trees: each is sent SIGUSR1,
    which its faulthandler answers from C at once (even while a thread holds the GIL)."""
    if _stacks_folder is None:
        return
    with _lock:
        roots = [p.pid for p in _started.values()]
    asked = []
    for pid in [p for root in roots for p in (root, *descendants(root))]:
        if (_stacks_folder / f"{pid}.txt").exists() and alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGUSR1)
                asked.append(pid)
    if asked:
        time.sleep(wait)
    for pid in asked:
        try:
            cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = "?"
        stacks = (_stacks_folder / f"{pid}.txt").read_text(errors="replace").strip()
        out.write(f"\n--- stacks of process {pid} ({cmd.strip()[:300]}) ---\n{stacks or '(none written)'}\n")
    out.flush()


def wait_for(predicate, what: str, timeout: float = 300, proc: subprocess.Popen | None = None,
             log: Path | None = None, interval: float = 0.05):
    """Poll ``predicate()`` until it returns something true; fail after ``timeout`` seconds or when ``proc``
    ends first (with the tail of ``log``)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log is not None and log.exists() else ""
            raise AssertionError(f"the process ended (exit {proc.returncode}) before {what}\n{tail}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
