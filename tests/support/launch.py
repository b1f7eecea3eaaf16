"""Starting and stopping the processes of a test: the real launcher (``run_train.sh``), torchrun with a test
worker, plain commands, and ``trainer.train.main`` in this process; reading what a run wrote.

Every process started here is registered: :func:`kill_all` (called at the end of the session and from the
SIGTERM/SIGINT handlers that tests/conftest.py installs) kills each one with every process below it. Each
also gets ``PR_SET_PDEATHSIG`` (Linux): it is killed when the test process dies, even by SIGKILL. The
launcher execs torchrun's agent, and the agent's workers die with the agent, so no run outlives pytest.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEBUG_CONFIG = ROOT / "train_configs" / "debug_model.toml"

# Small and fast: the debug model at short sequences; overridden per test as needed.
FAST = ["--training.seq_len", "64", "--training.local_batch_size", "4", "--metrics.log_freq", "1",
        "--lr_scheduler.warmup_steps", "2", "--metrics.enable_tensorboard", "false"]

PR_SET_PDEATHSIG = 1

# -------------------------------------------------------------------------------------------------
# Process trees
# -------------------------------------------------------------------------------------------------

_started: dict[int, subprocess.Popen] = {}
_lock = threading.Lock()


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


# -------------------------------------------------------------------------------------------------
# The launcher: ./run_train.sh
# -------------------------------------------------------------------------------------------------


def train_env(nproc: int, config: Path = DEBUG_CONFIG, env: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, "NGPU": str(nproc), "CONFIG_FILE": str(config),
            "OMP_NUM_THREADS": "1", "LOG_RANK": os.environ.get("LOG_RANK", "0"), **(env or {})}


def run_train(dump_folder: Path, *args: str, nproc: int = 1, config: Path = DEBUG_CONFIG,
              env: dict[str, str] | None = None, check: bool = True, timeout: float = 600,
              fast: bool = True) -> subprocess.CompletedProcess:
    """``NGPU=nproc ./run_train.sh --job.dump_folder DUMP ...`` with this interpreter; output captured."""
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(dump_folder), *(FAST if fast else []), *args]
    proc = run(cmd, cwd=ROOT, env=train_env(nproc, config, env), timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"run_train.sh failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc


def start_train(dump_folder: Path, *args: str, nproc: int = 1, config: Path = DEBUG_CONFIG,
                env: dict[str, str] | None = None, log: Path | None = None, prefix: tuple[str, ...] = (),
                fast: bool = True) -> subprocess.Popen:
    """Like :func:`run_train` but returns at once: the launcher runs in its own process group (``os.killpg``
    signals the launcher as a scheduler would; :func:`kill_tree` also reaches the workers), output to ``log``
    (default ``<dump_folder>.log``). ``prefix`` runs the launcher under another command, e.g.
    ``ip netns exec NS``."""
    log = Path(log) if log is not None else Path(f"{dump_folder}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [*prefix, str(ROOT / "run_train.sh"), "--job.dump_folder", str(dump_folder), *(FAST if fast else []), *args]
    with open(log, "w") as out:
        return popen(cmd, cwd=ROOT, env=train_env(nproc, config, env), stdout=out, stderr=subprocess.STDOUT)


# -------------------------------------------------------------------------------------------------
# torchrun with the test worker (tests/distributed/worker.py): many runs per start
# -------------------------------------------------------------------------------------------------

WORKER = ROOT / "tests" / "distributed" / "worker.py"


def start_torchrun(nproc: int, specs: list[dict], folder: Path, name: str | None = None) -> tuple[subprocess.Popen, Path]:
    """``torchrun --standalone --nproc_per_node NPROC tests/distributed/worker.py SPECS.json`` in the
    background; returns the process and its log."""
    name = name or f"torchrun_{nproc}"
    spec_file = folder / f"{name}.json"
    spec_file.write_text(json.dumps(specs, indent=1))
    log = folder / f"{name}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "LOGLEVEL": "WARNING"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(WORKER), str(spec_file)]
    with open(log, "w") as out:
        return popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT), log


# -------------------------------------------------------------------------------------------------
# trainer.train.main in this process (world size 1): a second or two instead of a torchrun start
# -------------------------------------------------------------------------------------------------


def train_in_process(dump: Path, *args: str, monkeypatch, config: Path = DEBUG_CONFIG,
                     fast: bool = True) -> tuple[int, str]:
    """``trainer.train.main`` in this process (world size 1, gloo); returns (exit code, console output)."""
    from trainer.train import main

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    # Not under torchrun: without LOCAL_RANK, main() leaves this process's parent-death signal alone.
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            rc = main(["--job.config_file", str(config), "--job.dump_folder", str(dump), *(FAST if fast else []),
                       *args])
        finally:
            gc.enable()  # the training loop disables automatic GC
    return rc, out.getvalue()


# -------------------------------------------------------------------------------------------------
# What a run wrote
# -------------------------------------------------------------------------------------------------


def read_metrics(dump_folder: Path) -> list[dict]:
    path = Path(dump_folder) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(dump_folder: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(dump_folder)}
