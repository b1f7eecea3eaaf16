"""One run per dump folder: ``<dump_folder>/run.lock`` names the host, pid and start time of the run that
owns the folder, with a heartbeat the owner refreshes every ``HEARTBEAT_S`` seconds.

The launcher (``trainer.launch``) takes the lock before torchrun starts and holds it across torchrun's
restarts; workers started without it (plain ``torchrun -m trainer.train``) take it on rank 0. The lock
belongs to the job, not to one node: a multi-node job names itself by its rendezvous (id and endpoint), the
first node's launcher to arrive takes the lock, and the other nodes of that job join it (whatever node rank
they were given); a launcher of any other job is refused. Every part of a job that takes or joins the lock
also keeps a holder file with its own heartbeat in ``<dump_folder>/run.lock.holders/``: the lock stays held
while any holder lives (the part that took it may end first, e.g. one replica group of a fault-tolerant
job), and the last holder to leave removes it.
A second launch into the same folder stops at once with one line (exit code 6). A lock is stale, and taken
over with a warning, when its process is gone (same host) or its heartbeat is older than
``job.lock_stale_after_s`` (another host, e.g. on a shared filesystem after a node died).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from trainer.errors import TrainerError

logger = logging.getLogger("trainer")

LOCK_FILE = "run.lock"
HOLDERS_DIR = LOCK_FILE + ".holders"  # one file per live part of the job that holds the lock
ENV = "TRAINER_RUN_LOCK"  # set by the launcher for its workers: the lock is held already
HEARTBEAT_S = 15.0


class RunLockedError(TrainerError):
    """Another live run holds this dump folder."""

    exit_code = 6
    label = "dump folder in use"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def read_lock(path: Path) -> dict | None:
    try:
        data = json.loads(Path(path).read_text())
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable or half-written: treated by its age (mtime)


def stale_reason(info: dict, path: Path, stale_after_s: float) -> str | None:
    """Why the lock ``info`` (read from ``path``) is stale, or None while its owner, or any holder of its job,
    is alive."""
    reason = _own_stale_reason(info, path, stale_after_s)
    if reason is not None and info.get("job") is not None and live_holders(Path(path).parent, stale_after_s):
        return None  # the part that took it ended or died; the job's other parts still run
    return reason


def live_holders(dump_folder: Path, stale_after_s: float, exclude: Path | None = None) -> list[Path]:
    """The holder files of parts of the job that are still alive (stale ones are removed)."""
    live = []
    try:
        files = sorted((Path(dump_folder) / HOLDERS_DIR).glob("*.json"))
    except OSError:
        return live
    for f in files:
        if f == exclude:
            continue
        info = read_lock(f)
        if info is None:
            continue
        if _own_stale_reason(info, f, stale_after_s) is None:
            live.append(f)
        else:
            try:
                f.unlink()
            except OSError:
                pass
    return live


def _own_stale_reason(info: dict, path: Path, stale_after_s: float) -> str | None:
    host, pid = info.get("host"), info.get("pid")
    if host == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
        return f"its process {pid} on this host is gone"
    try:
        beat = max(float(info.get("heartbeat", 0) or 0), Path(path).stat().st_mtime)
    except OSError:
        beat = 0.0
    age = time.time() - beat
    if age > stale_after_s:
        return f"its heartbeat is {age:.0f} s old (job.lock_stale_after_s={stale_after_s:g})"
    return None


def _mtime(path: Path) -> float:
    try:
        return Path(path).stat().st_mtime
    except OSError:
        return 0.0


def acquire_in_worker(job, identity: str | None = None) -> "RunLock | None":
    """Rank 0 of a run started without the launcher (plain torchrun) takes the lock itself; ``identity``
    names the job whose other parts join the lock (the replica groups of a fault-tolerant job)."""
    if os.environ.get(ENV) or job.lock_stale_after_s <= 0 or int(os.environ.get("RANK", "0")) != 0:
        return None
    return RunLock(Path(job.dump_folder), job.lock_stale_after_s, role="rank 0", job=identity).acquire()


class RunLock:
    """The lock of one dump folder, held by this process until :meth:`release`."""

    def __init__(self, dump_folder: Path, stale_after_s: float, role: str = "launcher", job: str | None = None):
        self.path = Path(dump_folder) / LOCK_FILE
        self.stale_after_s = stale_after_s
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "role": role,
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "heartbeat": time.time()}
        if job is not None:
            self.info["job"] = job  # the other nodes of this job join the lock instead of being refused
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False
        self.joined = False  # another node of the same job holds it
        self.holder: Path | None = None  # this part's file under run.lock.holders (a job's lock)

    def acquire(self) -> "RunLock":
        """Take the lock (or a stale one) and start the heartbeat, or join the lock of this job's first node;
        raises :class:`RunLockedError`."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(100):  # a few take-overs, or up to 5 s of waiting for a lock being written
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                info = read_lock(self.path)
                if info is None:
                    continue  # released meanwhile
                if not info and time.time() - _mtime(self.path) < 5.0:
                    time.sleep(0.1)  # created a moment ago by another launcher, not written yet
                    continue
                reason = stale_reason(info, self.path, self.stale_after_s)
                if reason is None and self.info.get("job") is not None and info.get("job") == self.info["job"]:
                    self.joined = True
                    logger.info("run lock %s: held by this job's node on host %s; joining it", self.path,
                                info.get("host", "?"))
                    self._hold()
                    return self
                if reason is None:
                    raise RunLockedError(
                        f"{self.path.parent} is in use by another run (host {info.get('host', '?')}, pid "
                        f"{info.get('pid', '?')}, started {info.get('started', '?')}; lock {self.path}): use another "
                        f"job.dump_folder, or stop that run; a lock whose run died is taken over automatically")
                logger.warning("taking over the stale lock %s of host %s pid %s (started %s): %s", self.path,
                               info.get("host", "?"), info.get("pid", "?"), info.get("started", "?"), reason)
                try:
                    os.replace(self.path, self.path.with_name(LOCK_FILE + ".stale"))
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.info, f)
            self.held = True
            break
        else:
            raise RunLockedError(f"could not take the lock {self.path} (others keep taking it)")
        if self.info.get("job") is not None:
            self._hold()
        else:
            self._start_beat()
        return self

    def _hold(self) -> None:
        """This part of the job holds the lock until :meth:`release`: its holder file, with a heartbeat."""
        holders = self.path.with_name(HOLDERS_DIR)
        if self.held:  # a new job's lock: the holders of a job that held it before are gone
            for old in holders.glob("*.json"):
                if _own_stale_reason(read_lock(old) or {}, old, self.stale_after_s) is not None:
                    old.unlink(missing_ok=True)
        holders.mkdir(exist_ok=True)
        self.holder = holders / f"{self.info['host']}-{self.info['pid']}-{id(self)}.json"
        self.holder.write_text(json.dumps(self.info))
        self._start_beat()

    def _start_beat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.info["heartbeat"] = time.time()
            if self.holder is not None:
                try:
                    tmp = self.holder.with_suffix(".tmp")
                    tmp.write_text(json.dumps(self.info))
                    os.replace(tmp, self.holder)
                except OSError:
                    pass
            if not self.held:
                continue
            tmp = self.path.with_name(f"{LOCK_FILE}.{os.getpid()}.tmp")
            try:
                mine = read_lock(self.path)
                if not mine or mine.get("pid") != self.info["pid"] or mine.get("host") != self.info["host"]:
                    logger.error("the run lock %s was taken by another process; this run no longer owns %s",
                                 self.path, self.path.parent)
                    return
                tmp.write_text(json.dumps(self.info))
                os.replace(tmp, self.path)
            except OSError:
                pass  # a full or flaky disk: the next beat tries again

    def release(self) -> None:
        """Give the lock up: removed when this process owns it, or (a job's lock) when this is its last
        live holder, whichever part of the job took it."""
        self._stop.set()
        held, self.held = self.held, False
        if self.holder is not None:
            self.holder.unlink(missing_ok=True)
            self.holder = None
            if live_holders(self.path.parent, self.stale_after_s):
                if held:
                    logger.info("run lock %s: this part of the job ends; its other parts still hold it", self.path)
                return
            info = read_lock(self.path)
            if info and info.get("job") == self.info.get("job"):
                self.path.unlink(missing_ok=True)
            return
        if not held:
            return
        info = read_lock(self.path)
        if info and info.get("pid") == self.info["pid"] and info.get("host") == self.info["host"]:
            try:
                self.path.unlink()
            except OSError:
                pass
