"""A function of a test module run in fresh Python processes (one per rank), started through
tests/support/processes.py like every process a test starts, so they die with the test session.

``call(fn, *args, nprocs=N)`` runs ``fn(rank, *args)`` in N new interpreters at once (a process group's
ranks) and returns each rank's result. Arguments and results travel pickled through files; ``fn`` must be a
module-level function (a child imports its module, as multiprocessing's spawn does). A fresh interpreter
inherits none of the test process's threads, signal handlers or torch state.

``python -m tests.support.children MODULE:NAME RANK FOLDER`` is the child's side.
"""

from __future__ import annotations

if __name__ == "__main__":  # a child: no collection while its module's imports run (trainer/startup.py)
    from trainer import startup

    startup.begin()

import importlib
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from tests.support.processes import forget, kill_tree, popen, wait_for

ROOT = Path(__file__).resolve().parents[2]


def call(fn, *args, nprocs: int = 1, timeout: float = 300) -> list:
    """``[fn(0, *args), ..., fn(nprocs - 1, *args)]``, each in a process of its own, run concurrently. A
    rank that raises or does not end within ``timeout`` seconds fails the call with its output."""
    folder = Path(tempfile.mkdtemp(prefix="children_"))
    try:
        (folder / "args.pkl").write_bytes(pickle.dumps(args))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        target = f"{fn.__module__}:{fn.__qualname__}"
        procs = []
        for rank in range(nprocs):
            with open(folder / f"{rank}.log", "w") as log:
                procs.append(popen([sys.executable, "-m", "tests.support.children", target, str(rank), str(folder)],
                                   cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        try:
            wait_for(lambda: all(p.poll() is not None for p in procs) or any(p.poll() not in (None, 0) for p in procs),
                     f"{target} on {nprocs} process(es)", timeout=timeout, interval=0.02)
        finally:
            for p in procs:
                if p.poll() is None:  # still running: another rank failed first, or time ran out
                    kill_tree(p)
                else:
                    forget(p)
        failed = [(rank, p.returncode) for rank, p in enumerate(procs) if p.returncode != 0]
        if failed:
            logs = "\n".join(f"--- rank {r} (exit {rc}):\n{(folder / f'{r}.log').read_text()[-4000:]}" for r, rc in failed)
            raise AssertionError(f"{target} failed on rank(s) {[r for r, _ in failed]}\n{logs}")
        return [pickle.loads((folder / f"{rank}.result.pkl").read_bytes()) for rank in range(nprocs)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _child(target: str, rank: int, folder: Path) -> int:
    module, _, name = target.partition(":")
    fn = importlib.import_module(module)
    if __name__ == "__main__":
        startup.imports_done()
    for part in name.split("."):
        fn = getattr(fn, part)
    try:
        result = fn(rank, *pickle.loads((folder / "args.pkl").read_bytes()))
    except BaseException:
        traceback.print_exc()
        return 1
    (folder / f"{rank}.result.pkl").write_bytes(pickle.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])))
