"""Importing torchao for float8 prints none of its harmless warnings about compiled extensions it cannot
load here (and that float8 training does not use), and leaves the loggers as it found them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import processes

SETUP = "import logging; logging.basicConfig(level=logging.WARNING)\n"


def run(code: str) -> subprocess.CompletedProcess:
    return processes.run([sys.executable, "-c", SETUP + code], timeout=300)


def test_torchao_import_is_quiet_and_restores_the_loggers():
    plain = run("import torchao.float8")
    assert plain.returncode == 0, plain.stderr
    if "Failed to load" not in plain.stderr:
        pytest.skip("torchao loads every one of its extensions on this machine: nothing to silence")
    quiet = run("import logging\n"
                "from trainer.parallel.float8 import quiet_torchao_import\n"
                "with quiet_torchao_import():\n"
                "    import torchao.float8\n"
                "assert logging.getLogger('torchao').level == logging.NOTSET\n")
    assert quiet.returncode == 0, quiet.stderr
    assert "Failed to load" not in quiet.stderr, quiet.stderr
