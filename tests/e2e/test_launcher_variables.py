"""run_train.sh's own variables (NNODES, NODE_RANK, LOG_RANK): a wrong value is one line naming that
variable and exit code 2, before Python or torchrun start (RUN_TRAIN_DRY prints the command instead of
running it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.processes import QUICK_S, run

ROOT = Path(__file__).resolve().parents[2]
CASES = {
    "NNODES=0": ({"NNODES": "0"}, "NNODES=0 must be a positive whole number"),
    "NNODES=abc": ({"NNODES": "abc"}, "NNODES=abc must be a positive whole number"),
    "NODE_RANK=x": ({"NNODES": "2", "NODE_RANK": "x", "MASTER_ADDR": "h"}, "NODE_RANK=x must be in [0, NNODES=2)"),
    "NODE_RANK=2": ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, "NODE_RANK=2 must be in [0, NNODES=2)"),
    "LOG_RANK=abc": ({"LOG_RANK": "abc"}, "LOG_RANK=abc must be local ranks"),
}


def dry(env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_", "NNODES", "NODE_RANK"))}
    return run([str(ROOT / "run_train.sh")], env={**clean, "RUN_TRAIN_DRY": "1", "NGPU": "1", **env}, timeout=QUICK_S,
               cwd=ROOT)


@pytest.mark.parametrize("case", list(CASES))
def test_a_wrong_launcher_variable_is_one_line(case):
    env, line = CASES[case]
    proc = dry(env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [f"run_train.sh: {proc.stderr.strip().split(': ', 1)[1]}"]
    assert line in proc.stderr


def test_valid_values_still_launch():
    proc = dry({"LOG_RANK": "0,1", "NNODES": "1", "NODE_RANK": "0"})
    assert proc.returncode == 0 and "--local-ranks-filter=0\\,1" in proc.stdout, proc.stderr
