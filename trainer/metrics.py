"""Step metrics: throughput, MFU, memory; written to the console, metrics.jsonl and TensorBoard."""

from __future__ import annotations

import json
import math
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("trainer")

# Dense (no sparsity) bf16 peak TFLOPS per device, from the vendors' data sheets. Matched against
# torch.cuda.get_device_name() in order, first hit wins (so "H100 NVL" precedes "H100").
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("GH200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("MI355X", 2500.0),
    ("MI325X", 1307.0),
    ("MI300X", 1307.0),
    ("MI250X", 383.0),
]


def peak_tflops(device: torch.device, override: float = -1.0) -> float | None:
    """Peak bf16 TFLOPS of one device, or None when unknown (CPU, unlisted GPU): MFU is then null."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_TFLOPS:
        if key in name:
            return value
    logger.warning("peak TFLOPS of %r unknown; set metrics.peak_tflops for MFU", name)
    return None


def memory_gib(device: torch.device) -> float:
    """Max reserved GPU memory, or this process's resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


PREVIOUS_RUNS = "previous_runs"


def set_aside_previous_records(dump_folder: Path, tensorboard_dir: Path | None) -> Path | None:
    """A run that starts at step 0 in a dump folder holding an earlier run's records (metrics.jsonl,
    TensorBoard events, summary.json, but no checkpoint to resume from) moves them into
    ``previous_runs/<UTC time>/`` first, so that no file mixes two runs' steps. Returns that folder, or None
    when there was nothing to move."""
    records = [dump_folder / "metrics.jsonl", dump_folder / "summary.json"]
    if tensorboard_dir is not None and tensorboard_dir.is_dir() and any(tensorboard_dir.iterdir()):
        records.append(tensorboard_dir)
    records = [p for p in records if p.exists() and (p.is_dir() or p.stat().st_size > 0)]
    if not any(p.name == "metrics.jsonl" or p == tensorboard_dir for p in records):
        return None  # a summary.json alone (a run that failed before its first step) is simply replaced
    target = dump_folder / PREVIOUS_RUNS / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target.mkdir(parents=True, exist_ok=True)
    for path in records:
        os.replace(path, target / path.name)
    return target


class MetricsWriter:
    """Appends one JSON object per logged step to metrics.jsonl and mirrors scalars to TensorBoard.

    Only the rank chosen to write (rank 0) creates files; the others write nothing. Further sinks (objects
    with ``write(record)`` and ``close()``, e.g. Weights & Biases) can be added with :meth:`add_sink`.
    """

    def __init__(self, dump_folder: Path, enabled: bool, tensorboard_dir: Path | None):
        self.enabled = enabled
        self.jsonl = None
        self.tb = None
        self.sinks: list[Any] = []
        if not enabled:
            return
        dump_folder.mkdir(parents=True, exist_ok=True)
        self.path = dump_folder / "metrics.jsonl"
        self.jsonl = open(self.path, "a", buffering=1)
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(tensorboard_dir))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        # Non-finite values (a skipped step's loss) become null: NaN is not valid JSON.
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.jsonl.write(json.dumps(clean) + "\n")
        if self.tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tb.add_scalar(key, value, step)
                elif isinstance(value, bool):
                    self.tb.add_scalar(key, float(value), step)
        for sink in self.sinks:
            sink.write(record)

    def add_sink(self, sink: Any) -> None:
        if self.enabled:
            self.sinks.append(sink)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


class Throughput:
    """Tokens per second per device, TFLOPS and MFU over the steps since the last log."""

    def __init__(self, flops_per_token: int, peak: float | None):
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.steps = 0
        self.data_wait = 0.0

    def summary(self) -> dict[str, float | None]:
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        tps = self.tokens / elapsed
        tflops = tps * self.flops_per_token / 1e12
        return {
            "tps": tps,
            "tflops": tflops,
            "mfu": None if self.peak is None else 100.0 * tflops / self.peak,
            "step_time_s": elapsed / max(self.steps, 1),
            "data_wait_s": self.data_wait / max(self.steps, 1),
        }


def console_line(record: dict[str, Any], color: bool) -> str:
    """One scannable line per logged step."""
    c = {"g": "\033[32m", "y": "\033[33m", "b": "\033[34m", "c": "\033[36m", "r": "\033[31m", "0": "\033[0m"}
    if not color:
        c = dict.fromkeys(c, "")
    parts = [f"{c['r'] if record.get('skipped') else ''}step {record['step']:>6}{c['0']}",
             f"{c['g']}loss {record['loss']:.4f}{c['0']}"]
    if record.get("validation_loss") is not None:
        parts.append(f"{c['g']}val {record['validation_loss']:.4f}{c['0']}")
    scores = [f"{k[len('eval/'):]} {v:.4f}" for k, v in record.items() if k.startswith("eval/") and v is not None]
    if scores:  # lm-eval scores of an [eval] step, and the time they took
        parts.append(f"{c['g']}eval {' '.join(scores)} ({record.get('eval_time_s', 0):.1f}s){c['0']}")
    parts += [
        f"grad_norm {record['grad_norm']:.3f}",
        f"lr {record['lr']:.2e}",
        f"{c['b']}tps {record['tps']:,.0f}{c['0']}",
        f"tflops {record['tflops']:.2f}",
        f"mfu {record['mfu']:.1f}%" if record.get("mfu") is not None else "mfu -",
        f"{c['y']}mem {record['memory']:.2f}GiB{c['0']}",
    ]
    if record.get("eta"):
        parts.append(f"{c['c']}eta {record['eta']}{c['0']}")
    if record.get("skipped"):
        reason = record.get("skip_reason")
        parts.append(f"{c['r']}skipped{f' ({reason})' if reason else ''}{c['0']}")
    return "  ".join(parts)


def use_color(disabled: bool) -> bool:
    return not disabled and sys.stdout.isatty() and os.environ.get("NO_COLOR") is None


def format_eta(seconds: float) -> str:
    seconds = int(seconds)
    d, rem = divmod(seconds, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    return (f"{d}d" if d else "") + f"{h:02d}:{m:02d}:{s:02d}"
