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
# thread (a progress bar's monitor, torch's). prepare's workers were forks that inherited the handler: at
# the pool's end a worker that missed its stop sentinel (Pool.terminate drains them; a race, about one
# prepare in two here) survived terminate's SIGTERM idle in SimpleQueue.get, and prepare waited for it
# forever. Six prepares make a pass by luck unlikely.
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
        for t in synthetic_texts(300, seed=3):
            f.write(json.dumps({"text": t}) + "\\n")
    for i in range(6):
        meta = prepare(f"jsonl:{folder}/c.jsonl", folder / f"tok{i}", ByteTokenizer(), workers=2, progress=True,
                       piece_bytes=2000)
        print("prepared", meta["stats"]["documents"], flush=True)
    stop.set()
""")


def test_prepare_finishes_in_a_process_with_a_sigterm_handler_and_a_thread(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        result = processes.run([sys.executable, "-c", _PREPARE_UNDER_A_HANDLER, str(tmp_path)], timeout=150,
                               env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail("prepare did not finish within 150 s in a process with a SIGTERM handler: its pool's "
                    "workers outlived Pool.terminate")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("prepared 300\n") == 6, result.stdout + result.stderr[-3000:]


_HANGING_TESTS = textwrap.dedent("""
    import sys
    import time

    import pytest

    from tests.support import processes

    CHILD = "import time\\ndef waiting_in_the_child():\\n    time.sleep(600)\\nwaiting_in_the_child()\\n"


    def waiting_in_the_test():
        time.sleep(600)


    def test_hangs():
        processes.popen([sys.executable, "-c", CHILD])
        waiting_in_the_test()


    @pytest.mark.timeout(60)
    def test_longer_than_the_default_limit_with_a_marker():
        time.sleep(6)


    def test_after_the_hang():
        pass
""")


def test_a_hung_test_fails_on_its_limit_with_the_stacks_and_the_suite_goes_on(tmp_path):
    """Under pytest-xdist (as run_tests.sh runs the suite) the hung test's worker writes the stacks of the test
    and of the process it started, exits, and is reported as crashed; a fresh worker runs the rest."""
    (tmp_path / "test_hanging.py").write_text(_HANGING_TESTS)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TEST_TIMEOUT": "4"}
    cmd = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-n", "1", "-v",
           "--rootdir", str(tmp_path), str(tmp_path / "test_hanging.py")]
    try:
        result = processes.run(cmd, timeout=240, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail("the hung test did not fail on its 4 s limit: the session hung")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-6000:]
    assert "test_hanging.py::test_hangs (call) ran past its time limit of 4 s" in out, out[-6000:]
    assert "waiting_in_the_test" in out and "waiting_in_the_child" in out, out[-6000:]  # both processes' stacks
    assert "crashed while running" in out and "test_hangs" in out, out[-6000:]
    assert "PASSED" in out and "test_after_the_hang" in out and "test_longer_than_the_default_limit" in out, out[-6000:]
    assert "1 failed, 2 passed" in out, out[-6000:]
