"""The rules of the job-level sections ([job], [training], [validation], [debug]) and the one rule over
every key: no NaN or infinity. Each layer's rules live next to its sections (``trainer/<layer>/config.py``);
``validate.py`` runs them all in order."""

from __future__ import annotations

import math
import os
import stat

from trainer.config.keys import iter_values
from trainer.errors import ConfigError


def check_numbers(config) -> None:
    """No NaN or infinity anywhere."""
    for key, value in iter_values(config):
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{key} must be a finite number, got {v}")


def check_config(config) -> None:
    """The job-level sections' own value rules."""
    t, v, d = config.training, config.validation, config.debug
    for key, value, minimum in (("training.max_norm", t.max_norm, 0), ("debug.stall_seconds", d.stall_seconds, 0),
                                ("debug.stall_at_step", d.stall_at_step, 0), ("debug.crash_at_step", d.crash_at_step, 0),
                                ("training.gc_freq", t.gc_freq, 0), ("training.local_batch_size", t.local_batch_size, 1),
                                ("training.seq_len", t.seq_len, 1), ("training.steps", t.steps, 1),
                                ("validation.freq", v.freq, 1), ("job.lock_stale_after_s", config.job.lock_stale_after_s, 0)):
        if value < minimum:
            raise ConfigError(f"{key} must be >= {minimum}, got {value}")
    if t.global_batch_size != -1 and (t.global_batch_size < 1 or t.global_batch_size % t.local_batch_size):
        raise ConfigError(
            f"training.global_batch_size ({t.global_batch_size}) must be -1 or a positive multiple of "
            f"training.local_batch_size ({t.local_batch_size})"
        )
    if v.seq_len != -1 and not 1 <= v.seq_len <= t.seq_len:
        raise ConfigError(f"validation.seq_len must be -1 (training.seq_len) or in [1, training.seq_len = "
                          f"{t.seq_len}], got {v.seq_len}")
    if v.enable and v.local_batch_size < 1:
        raise ConfigError(f"validation.local_batch_size must be >= 1, got {v.local_batch_size}")


def check_dump_folder(config) -> None:
    """The dump folder can be written: checked (stat only) before the launcher starts any process."""
    folder = os.path.abspath(os.path.expanduser(config.job.dump_folder))
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "is a file" if existing == folder else f"is inside {existing!r}, which is a file"
        raise ConfigError(f"job.dump_folder: {config.job.dump_folder!r} {what}; give a folder")
    mode = os.stat(existing).st_mode
    if (not os.access(existing, os.W_OK | os.X_OK) or not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
            or os.statvfs(existing).f_flag & os.ST_RDONLY):
        raise ConfigError(f"job.dump_folder: {existing!r} is read-only; give a folder the run can write to")
