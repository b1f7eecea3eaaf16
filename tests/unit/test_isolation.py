"""The suite's own guard (tests/support/isolation.py, tests/conftest.py): a test that leaves process-wide
state changed fails, naming what, and the next test starts from the state before it; ``--reverse``."""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import signal
import sys
import textwrap

import pytest
import torch
from torch.utils.serialization import config as serialization_config

from tests.support import isolation
from tests.support.launch import ROOT
from tests.support.processes import run


def _change_everything():
    signal.signal(signal.SIGUSR1, lambda *a: None)
    faulthandler.register(signal.SIGUSR2, chain=True)
    os.environ["ISOLATION_PROBE"] = "1"
    os.environ["HOME"] = "/elsewhere"
    serialization_config.save.compute_crc32 = not serialization_config.save.compute_crc32
    logging.getLogger("trainer").addHandler(logging.NullHandler())
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_num_threads(torch.get_num_threads() + 1)
    sys.excepthook = lambda *a: None


def test_changes_are_named_and_restored():
    before = isolation.snapshot()
    try:
        _change_everything()
        found = "\n".join(isolation.changes(before))
    finally:
        isolation.restore(before)
    for what in ("signal handler SIGUSR1", "signal handler SIGUSR2", "environment variable ISOLATION_PROBE set",
                 "environment variable HOME changed", "torch.utils.serialization.config.save.compute_crc32",
                 "logger 'trainer'", "torch deterministic algorithms", "torch threads", "sys.excepthook"):
        assert what in found, (what, found)
    assert isolation.changes(before) == []


def test_check_fails_after_restoring():
    before = isolation.snapshot()
    os.environ["ISOLATION_PROBE"] = "1"
    with pytest.raises(isolation.Leak, match="environment variable ISOLATION_PROBE set"):
        isolation.check(before, "this block")
    assert "ISOLATION_PROBE" not in os.environ and isolation.changes(before) == []


def test_an_entry_point_puts_back_its_process_setup_only():
    before = isolation.snapshot()
    try:
        with isolation.entry_point():
            logging.getLogger("trainer").addHandler(logging.NullHandler())
            os.environ["TORCH_FR_BUFFER_SIZE"] = "5"
            os.environ["ISOLATION_PROBE"] = "1"
        assert isolation.changes(before) == ["environment variable ISOLATION_PROBE set ('1')"]
    finally:
        isolation.restore(before)


INNER = '''
import os

import pytest


@pytest.fixture(scope="module")
def module_leak():
    os.environ["MODULE_PROBE"] = "1"  # never removed
    yield


def test_a_leaks():
    os.environ["ISOLATION_PROBE"] = "1"


def test_b_sees_a_clean_state(module_leak):
    assert "ISOLATION_PROBE" not in os.environ
'''


def _inner_pytest(tmp_path, *args: str):
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_CURRENT_TEST", None)
    return run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-p", "no:xdist",
                "--rootdir", str(tmp_path), "-c", str(tmp_path / "pytest.ini"), str(tmp_path / "test_inner.py"),
                *args], cwd=ROOT, env=env, timeout=300)


def test_the_suite_fails_a_leaking_test_and_module(tmp_path):
    out = _inner_pytest(tmp_path, "-rA")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "ERROR at teardown of test_a_leaks" in text and "environment variable ISOLATION_PROBE set" in text, text
    assert "test module test_inner.py (its module-scoped fixtures)" in text, text
    assert "environment variable MODULE_PROBE set" in text, text
    assert re.search(r"PASSED \S*test_inner.py::test_b_sees_a_clean_state", text), text


def test_reverse_runs_the_tests_backwards(tmp_path):
    forward = _inner_pytest(tmp_path, "-v").stdout
    backward = _inner_pytest(tmp_path, "-v", "--reverse").stdout
    assert forward.index("test_a_leaks") < forward.index("test_b_sees_a_clean_state"), forward
    assert backward.index("test_b_sees_a_clean_state") < backward.index("test_a_leaks"), backward
