"""Shared by every tier: no process a test starts outlives the session; the batched multi-process runs.

tests/support/processes.py registers each process a test starts; here they are killed, with all their
descendants, at the end of the session and when pytest itself is stopped by SIGTERM or SIGINT (the
handlers run before the signal's usual effect). A SIGKILL of pytest is covered by PR_SET_PDEATHSIG,
which processes.py sets on each child.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.support import processes

_previous: dict[int, object] = {}


def _on_signal(signum, frame):
    processes.kill_all()
    previous = _previous.get(signum)
    if callable(previous):
        previous(signum, frame)  # SIGINT: KeyboardInterrupt, pytest's own reporting
    elif signum == signal.SIGTERM:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def pytest_configure(config):
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            _previous[signum] = signal.signal(signum, _on_signal)
        except ValueError:  # not the main thread
            pass


def pytest_unconfigure(config):
    processes.kill_all()
    for signum, previous in _previous.items():
        signal.signal(signum, previous)
    _previous.clear()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _wanted_runs(session) -> set[str]:
    return {name for item in session.items for mark in item.iter_markers("runs") for name in mark.args}


@pytest.fixture(scope="session")
def batches(request, tmp_path_factory):
    """Every batched run (tests/support/batches.py) the selected tests name in ``@pytest.mark.runs(...)``,
    one torchrun start per world size."""
    from tests.support.batches import Batches

    started = Batches(tmp_path_factory.mktemp("batches"), _wanted_runs(request.session))
    yield started
    started.close()


@pytest.fixture(scope="session", autouse=True)
def _start_batches_first(request):
    """The batched runs start with the session, not when the first test that reads one comes up: they run
    on the core the in-process tests leave idle while those tests run."""
    if _wanted_runs(request.session):
        request.getfixturevalue("batches")
