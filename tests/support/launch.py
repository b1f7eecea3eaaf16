"""Launching training runs from a test: the real launcher (``run_train.sh``), torchrun with the test worker
(tests/distributed/worker.py), and ``trainer.train.main`` in this process; reading what a run wrote. The
processes are started through tests/support/processes.py, so none outlives the test session.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support import isolation
from tests.support.processes import free_port, popen, run

ROOT = Path(__file__).resolve().parents[2]
DEBUG_CONFIG = ROOT / "train_configs" / "debug_model.toml"

# Small and fast: the debug model at short sequences; overridden per test as needed.
# Two of the debug model's six blocks, at half its width (dim 128: head_dim 8, feed-forward hidden 512): a
# step of the whole model costs 8x the CPU, and what the tests compare (layouts, resumes, schedules) is the
# same with two narrow blocks. A test that needs more blocks or the full width says so after these.
FAST = ["--training.seq_len", "64", "--training.local_batch_size", "4", "--metrics.log_freq", "1",
        "--lr_scheduler.warmup_steps", "2", "--metrics.enable_tensorboard", "false", "--model.n_layers", "2",
        "--model.dim", "128"]
# The debug model's own width, after FAST: for what depends on its size (a checkpoint's bytes, the experts' load).
FULL_WIDTH = ["--model.dim", "256"]

# -------------------------------------------------------------------------------------------------
# The launcher: ./run_train.sh
# -------------------------------------------------------------------------------------------------


def train_env(nproc: int, config: Path = DEBUG_CONFIG, env: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, "NGPU": str(nproc), "CONFIG_FILE": str(config),
            "OMP_NUM_THREADS": "1", "LOG_RANK": os.environ.get("LOG_RANK", "0"), **(env or {})}


def run_train(dump_folder: Path, *args: str, nproc: int = 1, config: Path = DEBUG_CONFIG,
              env: dict[str, str] | None = None, check: bool = True, timeout: float = 600,
              fast: bool = True) -> subprocess.CompletedProcess:
    """``NGPU=nproc ./run_train.sh --job.dump_folder DUMP ...`` with this interpreter; output captured."""
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(dump_folder), *(FAST if fast else []), *args]
    proc = run(cmd, cwd=ROOT, env=train_env(nproc, config, env), timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"run_train.sh failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc


def start_train(dump_folder: Path, *args: str, nproc: int = 1, config: Path = DEBUG_CONFIG,
                env: dict[str, str] | None = None, log: Path | None = None, prefix: tuple[str, ...] = (),
                fast: bool = True) -> subprocess.Popen:
    """Like :func:`run_train` but returns at once: the launcher runs in its own process group (``os.killpg``
    signals the launcher as a scheduler would; ``processes.kill_tree`` also reaches the workers), output to ``log``
    (default ``<dump_folder>.log``). ``prefix`` runs the launcher under another command, e.g.
    ``ip netns exec NS``."""
    log = Path(log) if log is not None else Path(f"{dump_folder}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [*prefix, str(ROOT / "run_train.sh"), "--job.dump_folder", str(dump_folder), *(FAST if fast else []), *args]
    with open(log, "w") as out:
        return popen(cmd, cwd=ROOT, env=train_env(nproc, config, env), stdout=out, stderr=subprocess.STDOUT)


# -------------------------------------------------------------------------------------------------
# torchrun with the test worker (tests/distributed/worker.py): many runs per start
# -------------------------------------------------------------------------------------------------

WORKER = ROOT / "tests" / "distributed" / "worker.py"


def start_torchrun(nproc: int, specs: list[dict], folder: Path, name: str | None = None) -> tuple[subprocess.Popen, Path]:
    """``torchrun --standalone --nproc_per_node NPROC tests/distributed/worker.py SPECS.json`` in the
    background; returns the process and its log."""
    name = name or f"torchrun_{nproc}"
    spec_file = folder / f"{name}.json"
    spec_file.write_text(json.dumps(specs, indent=1))
    log = folder / f"{name}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "LOGLEVEL": "WARNING"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(WORKER), str(spec_file)]
    with open(log, "w") as out:
        return popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT), log


# -------------------------------------------------------------------------------------------------
# trainer.train.main in this process (world size 1): a second or two instead of a torchrun start
# -------------------------------------------------------------------------------------------------


def train_in_process(dump: Path, *args: str, monkeypatch, config: Path = DEBUG_CONFIG,
                     fast: bool = True) -> tuple[int, str]:
    """``trainer.train.main`` in this process (world size 1, gloo); returns (exit code, console output).
    What main sets up for its process on purpose (console logging, the flight recorder's variables, ...:
    tests/support/isolation.py) is put back afterwards; anything else it leaves changed fails the test."""
    from trainer.train import main

    # Not under torchrun: without LOCAL_RANK, main() leaves this process's parent-death signal alone.
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), isolation.entry_point():
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        rc = main(["--job.config_file", str(config), "--job.dump_folder", str(dump), *(FAST if fast else []), *args])
    return rc, out.getvalue()


# -------------------------------------------------------------------------------------------------
# What a run wrote
# -------------------------------------------------------------------------------------------------


def read_metrics(dump_folder: Path) -> list[dict]:
    path = Path(dump_folder) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(dump_folder: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(dump_folder)}
