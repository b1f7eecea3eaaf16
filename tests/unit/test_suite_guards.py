"""What keeps the suite from hanging: ``prepare``'s pool shuts down whatever signal handlers the calling
process has, and a hung test fails on its own timeout with the stacks it waits on (tests/support/timeouts.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.support import processes
from tests.support.launch import ROOT

# A handler that notes SIGTERM and returns, as the trainer's preemption handler does, and a live extra
# thread (a progress bar's monitor, torch's): prepare's workers inherited the handler when they were forked,
# survived Pool.terminate's SIGTERM idle in SimpleQueue.get, and prepare waited for them forever.
_PREPARE_UNDER_A_HANDLER = textwrap.dedent("""
    import json, signal, sys, threading
    from pathlib import Path
    from tests.support.data import ByteTokenizer, synthetic_texts
    from trainer.data.prepare import prepare

    signal.signal(signal.SIGTERM, lambda signum, frame: print("SIGTERM noted", flush=True))
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
    folder = Path(sys.argv[1])
    with open(folder / "c.jsonl", "w") as f:
        for t in synthetic_texts(200, seed=3):
            f.write(json.dumps({"text": t}) + "\\n")
    meta = prepare(f"jsonl:{folder}/c.jsonl", folder / "tok", ByteTokenizer(), workers=2, progress=True,
                   piece_bytes=2000)
    stop.set()
    print("prepared", meta["stats"]["documents"], flush=True)
""")


def test_prepare_finishes_in_a_process_with_a_sigterm_handler_and_a_thread(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        result = processes.run([sys.executable, "-c", _PREPARE_UNDER_A_HANDLER, str(tmp_path)], timeout=180,
                               env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail("prepare did not finish within 180 s in a process with a SIGTERM handler: its pool's "
                    "workers outlived Pool.terminate")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prepared 200" in result.stdout, result.stdout + result.stderr[-3000:]
