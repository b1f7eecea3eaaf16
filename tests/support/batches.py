"""Multi-process runs of the real trainer, batched: one torchrun start per world size runs every selected
run of that size (tests/distributed/worker.py), the starts running concurrently.

A test module declares its runs at import with :func:`spec` and marks each test with the runs it reads,
``@pytest.mark.runs("name", ...)``; the session fixture ``batches`` starts
the runs the selected tests need (and the runs those continue from) and :meth:`Batches.get` waits for one.
The fixture lives in tests/conftest.py, so a test of any tier can compare with a batched run.
Arguments may name other runs' dump folders as ``{root}/<name>``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.launch import DEBUG_CONFIG, FAST, read_metrics, start_torchrun
from tests.support.processes import kill_tree


@dataclass(frozen=True)
class Spec:
    name: str
    nproc: int
    args: tuple[str, ...]
    after: tuple[str, ...] = ()
    copy: tuple[tuple[str, str], ...] = ()
    fast: bool = True
    save_batch: bool = False
    lane: str = ""
    dump: str = ""
    remove: tuple[str, ...] = ()
    rc: int = 0


SPECS: dict[str, Spec] = {}


def spec(name: str, nproc: int, *args: str, after: tuple[str, ...] = (), copy: tuple[tuple[str, str], ...] = (),
         fast: bool = True, save_batch: bool = False, lane: str = "", dump: str = "",
         remove: tuple[str, ...] = (), rc: int = 0) -> str:
    """Declare a run: ``--job.config_file`` the debug model, ``--job.dump_folder {root}/<name>``, the fast
    settings of tests/support/launch.py (unless ``fast`` is false), then ``args``. ``after``: runs that must
    end first; ``copy``: (source, destination) folders copied before it starts; ``lane``: a name for a
    torchrun start of its own (beside the one of its world size), for a long run that should not hold up the
    others; ``dump``: another dump folder (e.g. the folder of the run it continues); ``remove``: folders
    deleted before it starts; ``rc``: the exit code the run must end with (a run that stops on purpose).
    Returns the name. A run with an ``rc`` other than 0 always gets a torchrun start of its own: stopping on a
    failure may leave the shared process group with a collective one rank never joined, which would break the
    runs after it."""
    if rc != 0 and not lane:
        lane = name
    new = Spec(name, nproc, tuple(args), tuple(after), tuple(tuple(c) for c in copy), fast, save_batch, lane, dump,
               tuple(remove), rc)
    if SPECS.setdefault(name, new) != new:
        raise ValueError(f"run {name!r} declared twice, differently")
    return name


@dataclass
class Run:
    name: str
    dump: Path
    log_path: Path
    rc: int

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def records(self) -> dict[int, dict]:
        """Metrics by step (a step logged again after a resume: its last record)."""
        return {r["step"]: r for r in read_metrics(self.dump)}

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in read_metrics(self.dump)}


@dataclass
class Batches:
    """The runs in ``root``. The owner starts them (one torchrun per world size and lane); with pytest-xdist
    the other workers attach to the same folder (``owner=False``) and read the runs as they end, so each run
    happens once per session whichever worker's tests read it."""

    root: Path
    names: set[str]
    procs: dict[tuple[int, str], tuple] = field(default_factory=dict)
    owner: bool = True

    def __post_init__(self):
        todo, wanted = list(self.names), set()
        while todo:
            name = todo.pop()
            if name not in SPECS:
                raise KeyError(f"no run named {name!r} was declared with tests.support.batches.spec")
            if name not in wanted:
                wanted.add(name)
                todo += SPECS[name].after
        self._wanted = wanted
        order = list(SPECS)  # declaration order, then: runs others continue from first, runs that wait last
        producers = {a for n in wanted for a in SPECS[n].after}
        by_size: dict[tuple[int, str], list[Spec]] = {}
        for s in sorted((SPECS[n] for n in wanted),
                        key=lambda s: (bool(s.after), s.name not in producers, order.index(s.name))):
            by_size.setdefault((s.nproc, s.lane), []).append(s)
        self.root.mkdir(parents=True, exist_ok=True)
        self._keys = {(s.nproc, s.lane) for s in (SPECS[n] for n in wanted)}
        if not self.owner:
            return
        for (nproc, lane), specs in sorted(by_size.items()):
            self.procs[(nproc, lane)] = start_torchrun(nproc, [self._worker_spec(s) for s in specs], self.root,
                                                       name=self._start_name(nproc, lane))
        pids = {self._start_name(*key): proc.pid for key, (proc, _) in self.procs.items()}
        tmp = self.root / "pids.json.tmp"
        tmp.write_text(json.dumps(pids))
        tmp.rename(self.root / "pids.json")

    @staticmethod
    def _start_name(nproc: int, lane: str) -> str:
        return f"torchrun_{nproc}{'_' + lane if lane else ''}"

    def _ended(self, nproc: int, lane: str) -> bool:
        """Whether the torchrun start that runs this world size and lane has ended (any worker can ask)."""
        if self.owner:
            return self.procs[(nproc, lane)][0].poll() is not None
        pids = self.root / "pids.json"
        if not pids.exists():
            return False  # the owner is starting them
        pid = json.loads(pids.read_text())[self._start_name(nproc, lane)]
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"

    def _path(self, text: str) -> str:
        return text.replace("{root}", str(self.root))

    def dump(self, s: Spec) -> Path:
        return Path(self._path(s.dump)) if s.dump else self.root / s.name

    def _worker_spec(self, s: Spec) -> dict:
        dump = self.dump(s)
        argv = ["--job.config_file", str(DEBUG_CONFIG), "--job.dump_folder", str(dump), *(FAST if s.fast else []),
                *map(self._path, s.args)]
        for _, dst in s.copy:
            Path(self._path(dst)).parent.mkdir(parents=True, exist_ok=True)
        return {"name": s.name, "argv": argv, "log": str(self.root / f"{s.name}.log"),
                "result": str(self.root / f"{s.name}.result.json"),
                "after": [[str(self.root / f"{a}.result.json"), SPECS[a].rc] for a in s.after],
                "copy": [[self._path(a), self._path(b)] for a, b in s.copy],
                "remove": [self._path(r) for r in s.remove],
                "save_batch": str(self.root / f"{s.name}.batch0.pt") if s.save_batch else None}

    def get(self, name: str, timeout: float = 1200) -> Run:
        """The run, once it has ended with its expected exit code (``spec(rc=...)``, 0 unless given; else the
        test fails with its log)."""
        s = SPECS.get(name)
        if s is None or (s.nproc, s.lane) not in self._keys or name not in self._wanted:
            raise KeyError(f"run {name!r} was not started: mark the test with @pytest.mark.runs({name!r})")
        worker_log = self.root / f"{self._start_name(s.nproc, s.lane)}.log"
        result = self.root / f"{name}.result.json"
        log = self.root / f"{name}.log"
        deadline = time.monotonic() + timeout
        while not result.exists():
            if self._ended(s.nproc, s.lane) and not result.exists():
                raise AssertionError(f"torchrun ({SPECS[name].nproc} processes) ended "
                                     f"before run {name!r}:\n{worker_log.read_text(errors='replace')[-6000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"run {name!r} not done after {timeout:.0f} s")
            time.sleep(0.1)
        out = json.loads(result.read_text())
        text = log.read_text(errors="replace") if log.exists() else ""
        assert out["rc"] == s.rc, (f"run {name!r} ended with {out['rc']}, expected {s.rc}:\n{out.get('error', '')}\n"
                                   f"{text[-6000:]}")
        return Run(name, self.dump(s), log, out["rc"])

    def close(self, wait: float = 0) -> None:
        """Kill what is still running; first wait up to ``wait`` seconds for the runs to end (other workers
        may still read them)."""
        deadline = time.monotonic() + wait
        while any(proc.poll() is None for proc, _ in self.procs.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                kill_tree(proc)
