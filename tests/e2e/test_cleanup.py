"""No run outlives the test session: pytest on a small test file that starts a long training run through
./run_train.sh is stopped by SIGTERM, SIGINT or SIGKILL, and every process of its tree (the launcher,
torchrun's agent, the worker) ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.support.launch import ROOT
from tests.support.processes import QUICK_S, alive, descendants, kill_tree, popen, wait_for

INNER = textwrap.dedent('''
    import json
    from pathlib import Path

    from tests.support.launch import start_train
    from tests.support.processes import wait_for


    def test_long_run(tmp_path):
        dump = Path({dump!r})
        proc = start_train(dump, "--training.steps", "100000", "--training.seq_len", "32",
                           "--training.local_batch_size", "2", nproc=1)
        wait_for(lambda: (dump / "metrics.jsonl").exists(), "step 1", proc=proc, log=Path(f"{{dump}}.log"))
        Path({ready!r}).write_text(str(proc.pid))
        proc.wait()
''')


SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGKILL": signal.SIGKILL}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    """One inner pytest session per signal, all started at once (each is mostly start-up), each sent its
    signal once its run has trained a step; yields name -> (the inner pytest process, its process tree then)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out, logs, trees = {}, [], {}
    try:
        for name in SIGNALS:
            tmp_path = tmp_path_factory.mktemp(f"cleanup_{name}")
            dump, ready = tmp_path / "run", tmp_path / "ready"
            (tmp_path / "test_inner.py").write_text(INNER.format(dump=str(dump), ready=str(ready)))
            (tmp_path / "pytest.ini").write_text("[pytest]\n")
            # tests/conftest.py as a plugin: its signal handlers and session-end cleanup, as in the real suite.
            logs.append(open(tmp_path / "inner.log", "w"))
            out[name] = (popen([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                                "--rootdir", str(tmp_path), "-c", str(tmp_path / "pytest.ini"),
                                str(tmp_path / "test_inner.py")], cwd=ROOT, env=env, stdout=logs[-1],
                               stderr=subprocess.STDOUT), tmp_path)
        for name, (inner, tmp_path) in out.items():  # each stopped as soon as its run trains (the others run on)
            ready = tmp_path / "ready"
            wait_for(ready.exists, "the inner run's first step", timeout=300, proc=inner, log=tmp_path / "inner.log")
            launcher, tree = int(ready.read_text()), descendants(inner.pid)
            assert launcher in tree and len(descendants(launcher)) >= 1, tree  # the launcher and its worker
            os.kill(inner.pid, SIGNALS[name])
            trees[name] = tree
        yield {name: (inner, trees[name]) for name, (inner, _) in out.items()}
    finally:
        for inner, _ in out.values():
            kill_tree(inner)
        for log in logs:
            log.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SIGNALS))
def test_stopping_pytest_stops_every_run_it_started(sessions, name):
    inner, tree = sessions[name]
    inner.wait(timeout=QUICK_S)
    wait_for(lambda: not any(alive(p) for p in tree), "every process of the tree to end", timeout=QUICK_S)
    assert not [p for p in tree if alive(p)]
