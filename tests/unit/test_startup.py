"""A process's start-up (trainer/startup.py).

- Ctrl-C while torch is imported (seconds on a loaded node): one line, no traceback, and the process ends by
  SIGINT (the shell's exit 130). The interrupt is made deterministic by a stand-in torch package whose import
  raises KeyboardInterrupt, as a Ctrl-C there does.
- The launcher and the trainer's processes collect no garbage while their imports run, then freeze what the
  imports made and collect again; a module imported by another program leaves its collector alone.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.support.processes import QUICK_S, run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def interrupted_torch(tmp_path):
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise KeyboardInterrupt\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "fake"), str(ROOT)])
    return env


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "trainer.launch", "--standalone", "--nproc-per-node", "1", "-m", "trainer.train"],
    [sys.executable, "-m", "trainer.train", "--job.dry_run"],
    [sys.executable, "-m", "trainer.cli", "eval", "--help"],
], ids=["launcher", "worker", "trainer-command"])
def test_ctrl_c_while_importing_torch_is_one_line_and_sigint(command, interrupted_torch, tmp_path):
    proc = run(command, env=interrupted_torch, cwd=tmp_path, timeout=QUICK_S)
    assert proc.returncode == -signal.SIGINT, (proc.returncode, proc.stderr)  # a shell reports 130
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted (Ctrl-C)"), proc.stderr


def test_a_torchrun_worker_leaves_the_report_to_its_launcher(interrupted_torch, tmp_path):
    proc = run([sys.executable, "-m", "trainer.train"], env={**interrupted_torch, "LOCAL_RANK": "0"},
               cwd=tmp_path, timeout=QUICK_S)
    assert proc.returncode == -signal.SIGINT and proc.stderr.strip() == "", proc.stderr


# Runs an entry point as ``python -m MODULE ARGS...`` does, and says on exit what its collector was left doing.
PROBE = """import atexit, gc, runpy, sys
atexit.register(lambda: print("collector", gc.isenabled(), gc.get_freeze_count(), file=sys.stderr))
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("command", [["trainer.launch", "--help"], ["trainer.train", "--help"],
                                     ["trainer.cli", "export", "--help"]], ids=["launcher", "worker", "trainer-command"])
def test_an_entry_point_freezes_what_its_imports_made_and_collects_again(command, tmp_path):
    proc = run([sys.executable, "-c", PROBE, *command], cwd=tmp_path, timeout=QUICK_S)
    assert proc.returncode == 0, proc.stderr
    _, enabled, frozen = proc.stderr.strip().splitlines()[-1].split()
    assert enabled == "True" and int(frozen) > 100_000, proc.stderr  # torch's import alone makes ~250k


def test_imports_done_without_begin_leaves_the_collector_alone():
    from trainer import startup

    frozen, enabled = gc.get_freeze_count(), gc.isenabled()
    startup.imports_done()  # as when a test imports an entry point's module and calls its main
    assert (gc.get_freeze_count(), gc.isenabled()) == (frozen, enabled)
