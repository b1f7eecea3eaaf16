"""The [checkpoint] config section and its rules (torch-free: the launcher's pre-flight runs them).

The string under each field is its documentation (``--help`` and docs/config.md). See docs/checkpointing.md.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Literal

from trainer.errors import ConfigError

# checkpoint.checksum's default: xxh3_128 when the xxhash package is installed (a dependency), else sha256.
_DEFAULT_CHECKSUM = "xxh3_128" if importlib.util.find_spec("xxhash") is not None else "sha256"

# State entries a checkpoint holds; checkpoint.exclude_from_loading may name any of them.
STATE_KEYS = ("model", "optimizer", "lr_scheduler", "train_state", "callbacks", "dataloader", "rng")


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints and resume from the latest complete one found in the dump folder."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 10
    """Keep this many newest full checkpoints of the run (over all its launches) and delete older ones; 0 keeps all."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """Save in the background: async copies the state to fresh CPU memory and then writes it, on a thread of
    its own that the save starts (the next optimizer step waits for the copy); async_with_pinned_mem copies
    into CPU buffers kept from save to save (pinned on CUDA; this rank's weights and optimizer state in size,
    held for the whole run). A failed background save is agreed by every rank at the next step boundary."""
    last_save_model_only: bool = True
    """The final checkpoint holds only model weights (no optimizer state)."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the weights in a model-only final checkpoint."""
    load_step: int = -1
    """Resume from this step instead of the latest checkpoint; -1: latest."""
    initial_load_path: str | None = None
    """Checkpoint to start from when the dump folder has none (e.g. a pretrained model)."""
    initial_load_model_only: bool = True
    """Load only the model weights from initial_load_path (fresh optimizer, step 0)."""
    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face safetensors Llama folder."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """State keys not to restore on resume, e.g. ["optimizer", "dataloader"]."""
    partial_model_load: bool = False
    """Load only the model weights a checkpoint shares with the model (same name and shape) and keep the rest
    as initialised, e.g. to grow a model from a smaller one; the optimizer then starts fresh. Without it a
    checkpoint whose model weights do not match the model is refused (exit code 3)."""
    create_seed_checkpoint: bool = False
    """Initialise the model, save it as step 0, and exit (run on one process)."""
    max_failed_saves: int = 1
    """Stop the run (non-zero exit) after this many consecutive failed saves."""
    checksum: Literal["xxh3_128", "sha256", "none"] = _DEFAULT_CHECKSUM
    """Checksum of every checkpoint file, computed while it is written and recorded in the commit marker
    (xxh3_128 needs the xxhash package; none records sizes only)."""
    save_threads: int = 1
    """Writer threads per rank (DCP FileSystemWriter thread_count): each thread writes its own file
    (__<rank>_<i>.distcp) from a share of the rank's tensors, so that the writes, their checksums and fsyncs
    overlap; more can help on parallel filesystems (Lustre, GPFS) and fast NVMe, not on a slow local disk."""
    verify_on_load: bool = True
    """Verify the checksums when loading a checkpoint (from the bytes the load reads); a mismatch refuses
    it as corrupt and the previous checkpoint is loaded instead."""
    start_fresh_if_unloadable: bool = False
    """When the checkpoint folder holds checkpoints and none can be loaded, start from step 0 anyway
    (nothing is deleted) instead of stopping with exit code 3."""
    preemption_check_steps: int = 5
    """On SIGTERM/SIGINT the run saves a full checkpoint and stops (exit 128 + signal); the ranks agree on
    a received signal every this many steps (one small CPU all-reduce), so the stop comes at most this
    many steps after the signal."""
    timeout_seconds: int = 1800
    """Collective timeout while saving or loading a checkpoint (ranks wait for the slowest writer); a save
    that takes longer counts as failed."""
    drill_save_delay_s: float = 0.0
    """Fault drill: rank 0 waits this long inside each save before writing (the save stays uncommitted
    meanwhile), to practise killing a run in the middle of a save."""
    drill_fail_save_steps: list[int] = field(default_factory=list)
    """Fault drill: the saves at these steps fail with an injected I/O error on the last rank."""
    drill_fail_copy_steps: list[int] = field(default_factory=list)
    """Fault drill: the background saves (checkpoint.async_mode) at these steps fail while copying the state,
    on the last rank."""
    drill_disk_bytes: int = -1
    """Fault drill: pretend the checkpoint folder sits on a filesystem of this many bytes (free space is
    this minus what the folder holds); -1 measures the real filesystem."""
    enable_ft_dataloader_checkpoints: bool = True
    """Refused unless true: the data-loader state is always saved (with fault_tolerance.enable, each replica
    group saves its own beside the job's checkpoint: <checkpoint.folder>/replica_<id>/step-N)."""
    initial_load_in_hf_quantized: bool = False
    """Refused unless false: quantized Hugging Face checkpoints are not read."""
    last_save_in_hf: bool = False
    """Refused unless false: the final save is a DCP checkpoint; `trainer export` writes Hugging Face
    safetensors from it."""
    enable_first_step_checkpoint: bool = False
    """Refused unless false: not implemented; checkpoint.interval = 1 with training.steps = 1 checks saving
    on a new cluster."""
    load_only: bool = False
    """Refused unless false: not implemented; checkpoint.enable = false with checkpoint.initial_load_path
    starts from a checkpoint without saving."""


SECTION_DOC = {"checkpoint": "Saving and resuming (DCP)."}


def check_config(config) -> None:
    cfg = config.checkpoint
    for key in ("interval", "max_failed_saves", "timeout_seconds", "preemption_check_steps", "save_threads"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"checkpoint.{key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.keep_latest_k < 0:
        raise ConfigError(f"checkpoint.keep_latest_k must be >= 0, got {cfg.keep_latest_k}")
    if cfg.drill_save_delay_s < 0:
        raise ConfigError(f"checkpoint.drill_save_delay_s must be >= 0, got {cfg.drill_save_delay_s}")
    if cfg.checksum == "xxh3_128" and importlib.util.find_spec("xxhash") is None:
        raise ConfigError("checkpoint.checksum xxh3_128 needs the xxhash package: pip install xxhash, or set "
                          "checkpoint.checksum sha256")
    unknown = [k for k in cfg.exclude_from_loading if k not in STATE_KEYS]
    if unknown:
        raise ConfigError(f"checkpoint.exclude_from_loading: unknown entries {unknown}; valid: {list(STATE_KEYS)}")
    if cfg.drill_fail_copy_steps and cfg.async_mode == "disabled":
        raise ConfigError("checkpoint.drill_fail_copy_steps fails the copy of background saves: set "
                          "checkpoint.async_mode async (or async_with_pinned_mem)")
    if cfg.initial_load_in_hf and not cfg.initial_load_path:
        raise ConfigError("checkpoint.initial_load_in_hf needs checkpoint.initial_load_path (the Hugging Face folder)")


def check_layout(config, world_size: int) -> None:
    if config.checkpoint.create_seed_checkpoint and world_size != 1:
        raise ConfigError(f"checkpoint.create_seed_checkpoint runs on one process (NGPU=1), not {world_size}")


def check_paths(config) -> None:
    """The checkpoint folder can be a folder (stat only): a file in its place would otherwise surface only at
    the first save, possibly hours into the run."""
    if not config.checkpoint.enable:
        return
    folder = os.path.join(os.path.expanduser(config.job.dump_folder), config.checkpoint.folder)
    existing = folder
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if existing and not os.path.isdir(existing):
        where = "is a file" if existing == folder else f"is inside {existing!r}, which is a file"
        raise ConfigError(f"checkpoint.folder: {folder!r} {where}; name a folder (relative to job.dump_folder)")
