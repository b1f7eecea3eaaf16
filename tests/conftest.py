"""Shared by every tier: no process a test starts outlives the session; the batched multi-process runs.

tests/support/processes.py registers each process a test starts; here they are killed, with all their
descendants, at the end of the session and when pytest itself is stopped by SIGTERM or SIGINT (the
handlers run before the signal's usual effect). A SIGKILL of pytest is covered by PR_SET_PDEATHSIG,
which processes.py sets on each child.

Each test, and each test module, is checked for process-wide state it leaves changed (signal handlers,
environment, torch's and the checkpoint saver's global flags, logging: tests/support/isolation.py); one that
does fails, after the state is put back. ``--reverse`` runs the selected tests in reverse order (after the
worker ordering below), to show that no test depends on what ran before it.
"""

from __future__ import annotations

import gc
import os
import signal
import sys

import pytest

from tests.support import isolation, processes, timeouts

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
    timeouts.install(config)


def pytest_collection_finish(session):
    # What the test modules imported (torch, transformers, lm-eval: most of the worker's objects) lives as long
    # as the session: frozen (as trainer/startup.py does in the trainer's processes), so that the full
    # collections the tests set off walk only what the tests make.
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()
    timeouts.uninstall()
    processes.kill_all()
    for signum, previous in _previous.items():
        signal.signal(signum, previous)
    _previous.clear()


# Each phase of a test has a time limit (tests/support/timeouts.py): a hung test fails with the stacks of what
# it waits for instead of hanging the suite.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with timeouts.limited(item, "setup"):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with timeouts.limited(item, "call"):
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    # The time limit covers the teardown and the module's state check after it (tests/support/isolation.py:
    # run once the module's fixtures are torn down).
    with timeouts.limited(item, "teardown", last=nextitem is None):
        result = yield
        isolation.module_ended(item.nodeid.split("::")[0],
                               nextitem.nodeid.split("::")[0] if nextitem is not None else None)
    return result


# Under pytest-xdist each worker takes whole files as it becomes free. First the longest files and those that
# mostly wait (on processes they started, on a time limit), while the batched runs started with the session
# keep the cores busy; then the rest of the end-to-end tier; then the files that read batched runs (ended by
# then; the two that also start processes of their own first); the unit tier's many short files last, so that
# neither worker is left alone with a long file at the end.
_FIRST = ["tests/e2e/test_multinode.py", "tests/e2e/test_never_lose_work.py", "tests/e2e/test_cleanup.py",
          "tests/unit/test_suite_guards.py", "tests/e2e/test_lighthouse.py", "tests/e2e/test_train.py",
          "tests/e2e/test_torchtitan_compat.py", "tests/e2e/test_hf_eval.py"]
_TIERS = ["tests/e2e/", "tests/distributed/", "tests/unit/"]
_FIRST_IN_TIER = ["tests/distributed/test_fault_tolerance.py", "tests/distributed/test_eval.py"]


def _file_order(item) -> tuple[int, int]:
    path = item.nodeid.split("::")[0]
    if path in _FIRST:
        return 0, _FIRST.index(path)
    tier = next((i for i, t in enumerate(_TIERS) if path.startswith(t)), len(_TIERS))
    return 1 + tier, _FIRST_IN_TIER.index(path) if path in _FIRST_IN_TIER else len(_FIRST_IN_TIER)


def pytest_addoption(parser):
    parser.addoption("--reverse", action="store_true", help="run the selected tests in reverse order")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        items.sort(key=_file_order)  # stable: tests keep their order within a file
    if config.getoption("reverse"):
        items.reverse()

    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:  # no torch import (a second or two of CPU) for a session that has no GPU test
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker)")
    for item in gpu:
        item.add_marker(skip)


def _wanted_runs(session) -> set[str]:
    return {name for item in session.items for mark in item.iter_markers("runs") for name in mark.args}


@pytest.fixture(scope="session")
def batches(request, tmp_path_factory):
    """Every batched run (tests/support/batches.py) the selected tests name in ``@pytest.mark.runs(...)``,
    one torchrun start per world size."""
    from tests.support.batches import Batches

    names = _wanted_runs(request.session)
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        started = Batches(tmp_path_factory.mktemp("batches"), names)
        yield started
        started.close()
        return
    # pytest-xdist: one folder for all workers (their base folders share a parent); the worker that creates
    # it starts the runs, the others attach. The owner's session may end first: it waits for the runs to end.
    root = tmp_path_factory.getbasetemp().parent / "batches"
    try:
        root.mkdir()
        owner = True
    except FileExistsError:
        owner = False
    started = Batches(root, names, owner=owner)
    yield started
    started.close(wait=1800)


@pytest.fixture(scope="session", autouse=True)
def _start_batches_first(request):
    """The batched runs start with the session, not when the first test that reads one comes up: they run
    on the core the in-process tests leave idle while those tests run."""
    if _wanted_runs(request.session):
        request.getfixturevalue("batches")


@pytest.fixture(scope="module", autouse=True)
def _module_leaves_process_state_alone(request):
    isolation.module_started(request.node.nodeid)  # checked in pytest_runtest_teardown, after its fixtures




@pytest.fixture(autouse=True)
def _test_leaves_process_state_alone(request):
    with isolation.checked(request.node.nodeid):
        yield


@pytest.fixture(autouse=True)
def _lm_eval_logging_per_test():
    """lm-eval's console handler (added once per process by ``trainer eval``) writes to the sys.stderr of
    the moment it was made: in pytest, one test's capture, closed after it. Each test that configures it
    gets its own, removed afterwards."""
    import logging

    logger = logging.getLogger("lm_eval")
    before = list(logger.handlers)
    yield
    utils = sys.modules.get("lm_eval.utils")
    if utils is not None and hasattr(utils, "_LOGGING_CONFIGURED"):
        for handler in [h for h in logger.handlers if h not in before]:
            logger.removeHandler(handler)
        utils._LOGGING_CONFIGURED = False

