"""Many training runs per torchrun start (tests only): each rank runs the specs one after the other with the
real ``trainer.train.main``, in one process group.

``python -m torch.distributed.run --standalone --nproc_per_node N tests/distributed/worker.py SPECS.json``:
SPECS is a JSON list of runs, each ``{"name", "argv": [--section.key value ...], "log": PATH,
"result": PATH, "after": [RESULT PATH, ...], "copy": [[SRC, DST], ...], "remove": [PATH, ...],
"save_batch": PATH or null}``. For each: wait until the runs it continues from (``after``, maybe in another
torchrun start) have written their results; local rank 0 copies the checkpoint folders it starts from
(``copy``) and deletes the folders it must not find (``remove``); every rank calls
``trainer.train.main(argv)`` with its console output going to ``log`` (rank 0) or ``log.rank<r>``; rank 0
writes ``{"rc": exit code}`` to ``result``. ``save_batch`` also writes the run's first training batch (what
step 1 trains on). ``main`` ends a run by destroying the process group; here the group stays for the next
run and is destroyed after the last. An exception in a run ends the worker (its collectives may be
half-done), with the traceback in the run's result.
"""

from __future__ import annotations

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

WAIT_S = 1800


def _wait_for(paths: list[str]) -> None:
    deadline = time.monotonic() + WAIT_S
    for path in map(Path, paths):
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear within {WAIT_S} s")
            time.sleep(0.1)
        if json.loads(path.read_text()).get("rc") != 0:
            raise RuntimeError(f"the run this one continues from failed: {path.read_text()[-2000:]}")


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


def main() -> int:
    from trainer import train

    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None  # train.main's; the group serves every run
    try:
        for spec in json.loads(Path(sys.argv[1]).read_text()):
            t0 = time.monotonic()
            log = Path(spec["log"] if rank == 0 else f"{spec['log']}.rank{rank}")
            try:
                _wait_for(spec.get("after", []))
                _copy(spec.get("copy", []), local_rank)
                _remove(spec.get("remove", []), local_rank)
                if spec.get("save_batch") and rank == 0:
                    _save_batch(spec["argv"], spec["save_batch"])
                with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                    try:
                        rc = train.main(spec["argv"])
                    finally:
                        gc.enable()  # the training loop disables automatic GC
                        gc.collect()
            except BaseException:
                if rank == 0:
                    _write_result(spec["result"], {"rc": "exception", "error": traceback.format_exc()})
                raise
            if rank == 0:
                _write_result(spec["result"], {"rc": rc, "seconds": time.monotonic() - t0})
    finally:
        dist.destroy_process_group = destroy
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
