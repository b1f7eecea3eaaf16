"""Helpers for end-to-end tests: run the real launcher (torchrun processes) and read what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEBUG_CONFIG = ROOT / "train_configs" / "debug_model.toml"

# Small and fast: the debug model at short sequences; overridden per test as needed.
FAST = ["--training.seq_len", "64", "--training.local_batch_size", "4", "--metrics.log_freq", "1",
        "--lr_scheduler.warmup_steps", "2", "--metrics.enable_tensorboard", "false"]


def run_train(dump_folder: Path, *args: str, nproc: int = 1, config: Path = DEBUG_CONFIG,
              env: dict[str, str] | None = None, check: bool = True, timeout: float = 600,
              fast: bool = True) -> subprocess.CompletedProcess:
    """``NGPU=nproc ./run_train.sh --job.dump_folder DUMP ...`` with this interpreter; output captured."""
    full_env = {**os.environ, "PYTHON": sys.executable, "NGPU": str(nproc), "CONFIG_FILE": str(config),
                "OMP_NUM_THREADS": "1", "LOG_RANK": os.environ.get("LOG_RANK", "0")}
    full_env.update(env or {})
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(dump_folder), *(FAST if fast else []), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"run_train.sh failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(dump_folder: Path) -> list[dict]:
    path = Path(dump_folder) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(dump_folder: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(dump_folder)}


def start_train(dump_folder: Path, *args: str, nproc: int = 1, config: Path = DEBUG_CONFIG,
                env: dict[str, str] | None = None, log: Path | None = None, prefix: tuple[str, ...] = (),
                fast: bool = True) -> subprocess.Popen:
    """Like :func:`run_train` but returns at once: the launcher runs in its own process group (so that it and
    its torchrun workers can be stopped together with ``os.killpg``), output to ``log`` (default
    ``<dump_folder>.log``). ``prefix`` runs the launcher under another command, e.g. ``ip netns exec NS``."""
    full_env = {**os.environ, "PYTHON": sys.executable, "NGPU": str(nproc), "CONFIG_FILE": str(config),
                "OMP_NUM_THREADS": "1", "LOG_RANK": os.environ.get("LOG_RANK", "0")}
    full_env.update(env or {})
    log = Path(log) if log is not None else Path(f"{dump_folder}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [*prefix, str(ROOT / "run_train.sh"), "--job.dump_folder", str(dump_folder), *(FAST if fast else []), *args]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def fast_model(args, seed: int = 0) -> "Transformer":
    """Random weights without the (slow on CPU) truncated-normal init; norm weights around 1 so that a
    mixed-up norm mapping would show."""
    import torch

    from trainer.models.llama.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if "tok_embeddings" in name else 0.02
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if "norm" in name else 0.0))
    model.rope_cache = model._compute_rope_cache()
    return model.eval()
