"""Batch geometry and the [data] section's bounds: plain arithmetic on the config, no torch, so that the
launcher's pre-flight (``validate``) can run them in a fraction of a second."""

from __future__ import annotations

from trainer.errors import ConfigError


def check_data_section(d) -> None:
    for key, minimum in (("num_shards", 1), ("num_workers", 0), ("prefetch_factor", 1), ("prefetch_batches", 0),
                         ("shuffle_window", 1),
                         ("max_document_tokens", 0), ("long_document_windows", 1)):
        value = getattr(d, key)
        if value < minimum:
            raise ConfigError(f"data.{key} must be >= {minimum}, got {value}")


def grad_accum_steps(config, dp: int) -> int:
    """Micro-batches per optimizer step so that training.global_batch_size is honoured."""
    t = config.training
    per_pass = t.local_batch_size * dp
    global_batch = per_pass if t.global_batch_size == -1 else t.global_batch_size
    if global_batch % per_pass:
        raise ConfigError(
            f"training.global_batch_size ({global_batch}) must be a multiple of training.local_batch_size "
            f"({t.local_batch_size}) x data-parallel degree ({dp}) = {per_pass}"
        )
    return global_batch // per_pass


def batch_geometry(config, dp_world_size: int) -> tuple[int, int, int]:
    """(local batch B, global batch G, micro-batches per step A)."""
    accum = grad_accum_steps(config, dp_world_size)
    b = int(config.training.local_batch_size)
    return b, b * dp_world_size * accum, accum
