"""The observability config sections and their rules: [metrics], [profiling] and [comm] (timeouts, the
hang watchdog, the flight recorder). Torch-free: the launcher's pre-flight runs the rules.

The string under each field is its documentation (``--help`` and docs/config.md). See docs/observability.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.errors import ConfigError


@dataclass
class Metrics:
    log_freq: int = 10
    """Log a console line and a metrics.jsonl record every this many steps (and at step 1 and the last step)."""
    enable_tensorboard: bool = True
    """Write TensorBoard events under <dump_folder>/<save_tb_folder>."""
    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""
    enable_wandb: bool = False
    """Also log to Weights & Biases (needs the wandb package)."""
    save_for_all_ranks: bool = False
    """Refused unless false: TensorBoard and W&B records are written once per run, not per rank."""
    disable_color_printing: bool = False
    """Never color console output (color is only used on a terminal anyway)."""
    peak_tflops: float = -1.0
    """Peak dense bf16 TFLOPS of one device for MFU; -1 looks the GPU up by name (unknown: MFU is null)."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces (CPU and CUDA activity, with ranges named data, forward, loss, backward,
    optimizer, log and checkpoint): one Chrome/Perfetto trace per rank at
    <dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json."""
    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder."""
    profile_freq: int = 100
    """Record a trace every this many steps: each window ends at a multiple of profile_freq (also the
    interval of memory snapshots)."""
    profiler_warmup: int = 3
    """Steps of profiler warmup (not recorded) before each recorded window."""
    profiler_active: int = 1
    """Steps recorded in each window (the last ones before each multiple of profile_freq); warmup + active
    must not exceed profile_freq."""
    enable_memory_snapshot: bool = False
    """Record the CUDA allocator's history and dump a snapshot every profile_freq steps and on out-of-memory,
    to <dump_folder>/<save_memory_snapshot_folder>/iteration_<step>[_exit]/rank<r>_memory_snapshot.pickle
    (view at https://pytorch.org/memory_viz). GPU only; a CPU run warns and skips it."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Snapshot folder, relative to job.dump_folder."""


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Collective timeout until the first step completes (start-up, compilation, checkpoint loading)."""
    train_timeout_seconds: int = 100
    """Collective timeout after the first step, so a hung rank is noticed within minutes."""
    trace_buf_size: int = 20000
    """Flight-recorder entries (the most recent collectives, NCCL and gloo) kept per rank for hang
    diagnosis; dumped by NCCL on a collective timeout and by the watchdog (0 disables)."""
    save_traces_folder: str = "comm_traces"
    """Flight-recorder dumps, relative to job.dump_folder: one file per rank, <save_traces_file_prefix><rank>;
    analyse NCCL's with `torchfrtrace <folder>` (see docs/observability.md)."""
    save_traces_file_prefix: str = "rank_"
    """File-name prefix of the flight-recorder dumps (the rank follows)."""
    watchdog_timeout_seconds: int = 600
    """Hang watchdog: when no training step completes for this many seconds, every rank writes its Python
    stacks to <dump_folder>/watchdog/rank<r>_stacks.txt (and the flight recorder), the run summary is
    written, and the process exits with code 124 instead of hanging. The first step may take
    comm.init_timeout_seconds if that is longer, a checkpoint save checkpoint.timeout_seconds more. Set it
    below comm.train_timeout_seconds to get every rank's stacks before a collective timeout ends the run.
    0 disables."""
    mode: Literal["default", "fake_backend", "local_tensor"] = "default"
    """Refused unless "default": torchtitan's fake-backend and local-tensor modes are not here; job.dry_run
    checks a layout without devices, and parity tests run layouts on CPU with gloo."""


SECTION_DOC = {
    "metrics": "Logging: console, metrics.jsonl, TensorBoard.",
    "profiling": "Profiler traces and CUDA memory snapshots (see docs/observability.md).",
    "comm": "Process-group timeouts, the hang watchdog and the collective flight recorder (see docs/observability.md).",
}


def check_config(config) -> None:
    """Bounds, and the profiling and watchdog settings that only make sense together."""
    for key in ("metrics.log_freq", "profiling.profile_freq", "comm.init_timeout_seconds", "comm.train_timeout_seconds"):
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if config.metrics.peak_tflops != -1 and config.metrics.peak_tflops <= 0:
        raise ConfigError(f"metrics.peak_tflops must be -1 (look up the GPU) or > 0, got {config.metrics.peak_tflops}")
    p, c = config.profiling, config.comm
    if p.profiler_active < 1:
        raise ConfigError(f"profiling.profiler_active must be >= 1, got {p.profiler_active}")
    if p.profiler_warmup < 0:
        raise ConfigError(f"profiling.profiler_warmup must be >= 0, got {p.profiler_warmup}")
    if p.enable_profiling and p.profiler_warmup + p.profiler_active > p.profile_freq:
        raise ConfigError(
            f"profiling.profiler_warmup ({p.profiler_warmup}) + profiler_active ({p.profiler_active}) must not "
            f"exceed profiling.profile_freq ({p.profile_freq})"
        )
    if c.watchdog_timeout_seconds < 0:
        raise ConfigError(f"comm.watchdog_timeout_seconds must be >= 0 (0 disables), got {c.watchdog_timeout_seconds}")
