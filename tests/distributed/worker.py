"""Many training runs per torchrun start (tests only): each rank runs the specs one after the other with the
real ``trainer.train.main``, in one process group.

``python -m torch.distributed.run --standalone --nproc_per_node N tests/distributed/worker.py SPECS.json``:
SPECS is a JSON list of runs, each ``{"name", "argv": [--section.key value ...], "log": PATH,
"result": PATH, "after": [[RESULT PATH, EXIT CODE], ...], "copy": [[SRC, DST], ...], "remove": [PATH, ...],
"save_batch": PATH or null}``. For each: wait until the runs it continues from (``after``, maybe in another
torchrun start) have written their results; local rank 0 copies the checkpoint folders it starts from
(``copy``) and deletes the folders it must not find (``remove``); every rank calls
``trainer.train.main(argv)`` with its console output going to ``log`` (rank 0) or ``log.rank<r>``; rank 0
writes ``{"rc": exit code}`` to ``result``. ``save_batch`` also writes the run's first training batch (what
step 1 trains on). ``main`` ends a run by destroying the process group; here the group stays for the next
run and is destroyed after the last. An exception in a run ends the worker (its collectives may be
half-done), with the traceback in the run's result.

Each run starts from the same process state (tests/support/isolation.py): what ``main`` sets up for its
process on purpose (console logging, the flight recorder's variables, determinism flags) is put back after
it, and the shared group's collective timeout is set back to the run's own ``comm.init_timeout_seconds``
(what a fresh start would give it: the last run shortened it to its ``comm.train_timeout_seconds``).
Anything else a run leaves changed on any rank (a signal handler, a variable, torch's serialization or
Inductor settings, ...) is put back too, and fails that run (``{"rc": "leaked", "error": what}``).
"""

from __future__ import annotations

from trainer import startup

if __name__ == "__main__":  # no collection while torch's and the trainer's imports run (trainer/startup.py)
    startup.begin()

import contextlib
import gc
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from tests.support import isolation

WAIT_S = 1800


def _wait_for(after: list[list]) -> None:
    """Until each run this one continues from has written its result, with the exit code expected of it."""
    deadline = time.monotonic() + WAIT_S
    for path, rc in after:
        path = Path(path)
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear within {WAIT_S} s")
            time.sleep(0.1)
        if json.loads(path.read_text()).get("rc") != rc:
            raise RuntimeError(f"the run this one continues from did not end with exit code {rc}: "
                               f"{path.read_text()[-2000:]}")


def _copy(pairs: list[list[str]], local_rank: int) -> None:
    """Local rank 0 copies (to a temporary name, then renames); the others wait for the result."""
    for src, dst in pairs:
        dst = Path(dst)
        if local_rank == 0:
            tmp = dst.with_name(dst.name + ".copying")
            shutil.copytree(src, tmp)
            tmp.rename(dst)
        else:
            deadline = time.monotonic() + WAIT_S
            while not dst.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{dst} was not copied within {WAIT_S} s")
                time.sleep(0.05)


def _remove(paths: list[str], local_rank: int) -> None:
    for path in map(Path, paths):
        if local_rank == 0:
            shutil.rmtree(path)
        else:
            deadline = time.monotonic() + WAIT_S
            while path.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} was not removed within {WAIT_S} s")
                time.sleep(0.05)


def _write_result(path: str, result: dict) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(path)  # whole or absent for the readers


def _save_batch(argv: list[str], path: str) -> None:
    from trainer.config import load_config
    from trainer.data.loader import build_train_loader
    from trainer.data.tokenizer import load_tokenizer

    config = load_config(argv, env={})
    loader = build_train_loader(config, load_tokenizer(config), dp_rank=0, dp_world_size=1)
    batch = next(iter(loader))
    torch.save({"input": batch["input"].clone(), "labels": batch["labels"].clone()}, path)


# The default process group is made by the first run and kept for the others (see above).
SHARED = frozenset({"torch.distributed default process group"})


def _fresh_timeout(argv: list[str]) -> None:
    """The shared groups' collective timeout as a fresh start of this run would have it."""
    from trainer.config import load_config
    from trainer.setup import set_train_timeout

    if dist.is_initialized():
        set_train_timeout(load_config(argv, env={}).comm.init_timeout_seconds)


def _leaks(before: isolation.Snapshot, rank: int) -> list[str]:
    """What the run left changed on any rank (restored here), as ``rank R: what`` lines."""
    found = [f"rank {rank}: {c}" for c in isolation.restore_changes(before, SHARED)]
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return found
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, found)
    return [line for lines in every for line in lines]


def main() -> int:
    from trainer import train

    # What the imports made lives as long as the process: frozen, so that the full collection after each run
    # (below) walks only what the runs made, a few hundredths of a second instead of a few tenths per run and
    # rank; what a run leaves alive (the modules it imported, caches) is frozen after it for the same reason.
    startup.imports_done()
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None  # train.main's; the group serves every run
    try:
        for spec in json.loads(Path(sys.argv[1]).read_text()):
            t0, cpu0 = time.monotonic(), time.process_time()
            log = Path(spec["log"] if rank == 0 else f"{spec['log']}.rank{rank}")
            try:
                _wait_for(spec.get("after", []))
                _copy(spec.get("copy", []), local_rank)
                _remove(spec.get("remove", []), local_rank)
                if spec.get("save_batch") and rank == 0:
                    _save_batch(spec["argv"], spec["save_batch"])
                _fresh_timeout(spec["argv"])
                before = isolation.snapshot()
                with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                    try:
                        with isolation.entry_point():
                            rc = train.main(spec["argv"])
                    finally:
                        gc.collect()
                        gc.freeze()
                leaks = _leaks(before, rank)
            except BaseException:
                if rank == 0:
                    _write_result(spec["result"], {"rc": "exception", "error": traceback.format_exc()})
                raise
            if rank == 0:
                # rank 0's CPU seconds: what the run costs the suite's time budget, per process
                result = {"rc": rc, "seconds": time.monotonic() - t0, "cpu_seconds": time.process_time() - cpu0}
                if leaks:
                    result.update(rc="leaked", error="the run left process-wide state changed (restored for the "
                                  "next run; restore it where it is changed):\n  " + "\n  ".join(leaks))
                _write_result(spec["result"], result)
    finally:
        dist.destroy_process_group = destroy
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
