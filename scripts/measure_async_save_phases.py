"""Where the time of an asynchronous checkpoint save goes, phase by phase, on the training loop's thread.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/measure_async_save_phases.py [--size llama3_1b_4l] \
        [--repeats 3] [--checksum xxh3_128] [--folder outputs/async_save_phases]

The model of ``trainer bench checkpoint`` (bf16 weights and AdamW's two moments) of ``--size``, saved
through a ``CheckpointManager`` with ``async_mode = "async"``: one synchronous and one asynchronous save
untimed, then ``--repeats`` asynchronous saves. Each function of the save path is wrapped with
``time.perf_counter`` (only calls on the main thread are counted). Printed per save, in milliseconds: each
phase inside the ``save(..., asynchronous=True)`` call, the call itself, the time until the state has been
copied (what the next optimizer step waits for) and until the save is committed, and what agreeing on
its outcome (at the next save step) costs the loop once the write is done. Needs about twice the checkpoint's size in memory.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TIMES: dict[str, float] = {}


def _wrap(owner, name: str, label: str) -> None:
    """Add the main thread's time in ``owner.name`` to TIMES[label]."""
    fn = getattr(owner, name, None)
    if fn is None:
        return

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[label] = TIMES.get(label, 0.0) + time.perf_counter() - t0

    setattr(owner, name, timed)


def _instrument() -> None:
    import trainer.checkpoint.saving as saving
    import trainer.checkpoint.state as state
    from trainer.checkpoint.agree import Collectives
    from trainer.checkpoint.space import DiskSpace

    _wrap(state.Components, "model_state", "state dicts: model")
    _wrap(state.Components, "optimizer_state", "state dicts: optimizer")
    _wrap(state.Components, "snapshot", "state dicts: all (model, optimizer, RNG, callbacks)")
    _wrap(saving, "estimate_checkpoint_bytes", "size estimate")
    _wrap(Collectives, "sum", "collectives: sum")
    _wrap(Collectives, "agree", "collectives: agree")
    _wrap(saving.Saver, "_prepare", "temporary folder and disk-space check")
    _wrap(DiskSpace, "check", "disk-space check")
    _wrap(saving.Saver, "_marker", "marker content")
    _wrap(saving.Saver, "_dataloader_state", "data-loader state: gathered, merged, encoded")
    _wrap(saving, "write_sidecar", "data-loader state file written")
    _wrap(saving.Saver, "_writer", "DCP writer")
    _wrap(saving.Saver, "_start_thread", "background save started")
    _wrap(threading.Thread, "start", "thread start")
    _wrap(saving.Saver, "_finish_save", "join: outcome agreed, retention")
    _wrap(saving, "commit", "commit (on the save's thread)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="llama3_1b_4l")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--checksum", default="xxh3_128")
    ap.add_argument("--folder", default=str(ROOT / "outputs" / "async_save_phases"))
    a = ap.parse_args()

    from trainer.tools.bench import DEFAULT_CONFIG, checkpoint_disk
    from trainer.tools.bench.common import _quiet, load_bench_config

    _instrument()
    model, optimizer = checkpoint_disk._build(a.size)
    folder = Path(a.folder)
    shutil.rmtree(folder, ignore_errors=True)
    config = load_bench_config(
        argparse.Namespace(config=str(DEFAULT_CONFIG)), [],
        ["--checkpoint.enable", "true", "--checkpoint.async_mode", "async", "--checkpoint.checksum", a.checksum,
         "--checkpoint.keep_latest_k", "0", "--checkpoint.folder", "checkpoint"], str(folder))
    manager = checkpoint_disk._manager(config, model, optimizer)
    rows = []
    with _quiet():
        manager.save(1, asynchronous=False)
        manager.save(2, asynchronous=True)
        manager.finish()
        t0 = time.perf_counter()
        manager.save(3, asynchronous=False)
        sync_s = time.perf_counter() - t0
        for i in range(a.repeats):
            step = 10 + i
            TIMES.clear()
            t0 = time.perf_counter()
            manager.save(step, asynchronous=True)
            call = time.perf_counter() - t0
            phases = dict(TIMES)
            manager.saver.wait_staging()
            copied = time.perf_counter() - t0
            manager.pending.upload.result()
            written = time.perf_counter() - t0
            TIMES.clear()
            manager.finish()  # the ranks agree on the outcome, as at the next save step
            phases.update({k: v for k, v in TIMES.items() if k.startswith("join")})
            rows.append((call, copied, written, phases))
            shutil.rmtree(manager.folder / f"step-{step}", ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)

    print(f"{a.size}, checksum {a.checksum}: a synchronous save took {sync_s:.3f} s; per asynchronous save (ms):")
    labels = sorted({k for r in rows for k in r[3]}, key=lambda k: (k.startswith("join"), -sum(r[3].get(k, 0)
                                                                                          for r in rows)))
    width = max(len(k) for k in labels + ["call until the state is copied"]) + 2

    def line(label, values):
        print(f"  {label:{width}s}" + "".join(f"{v * 1e3:10.2f}" for v in values))

    for k in labels:
        line(k, [r[3].get(k, 0.0) for r in rows])
    line("THE CALL (the loop blocked)", [r[0] for r in rows])
    line("call until the state is copied", [r[1] for r in rows])
    line("call until written and committed", [r[2] for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
