"""Every config rule, in one place: ``validate(config, world_size)``.

The launcher runs it before torchrun starts (``python -m trainer.config --check``) and every worker runs
it again at start-up, so a mistake is reported once, in one line naming the key, before any work. Rules
that need the world size (degrees, batch geometry, shards, the model's heads and layers against the
layout) run when it is given. Extensions add their rules through the registry.
"""

from __future__ import annotations

import importlib.util
import math
import os
import stat


from trainer import compat, extensions
from trainer.config.keys import iter_values, section_of
from trainer.errors import ConfigError


def validate(config, world_size: int | None = None, *, files: bool = True) -> None:
    """Raise ConfigError for the first rule the config breaks. ``files`` False (dry runs and simulations,
    which read no file) skips the checks that the tokenizer, data and dump folder are there."""
    _check_numbers(config)
    compat.check(config)  # torchtitan keys accepted only at their default, with the reason when set otherwise
    _check_core(config)
    _check_observability(config)
    _check_checkpoint(config)
    _check_model(config)
    _check_data(config)
    if world_size is not None:
        _check_layout(config, world_size)
        if files and not config.job.dry_run:  # presets can be checked on any machine
            _check_paths(config)
    extensions.check_config(config, world_size)


def _check_numbers(config) -> None:
    """No NaN or infinity anywhere, and no negative value where only a magnitude makes sense."""
    for key, value in iter_values(config):
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{key} must be a finite number, got {v}")
    nonneg = ("training.max_norm", "training.z_loss_weight", "optimizer.weight_decay",
              "checkpoint.drill_save_delay_s", "debug.stall_seconds", "debug.stall_at_step",
              "debug.crash_at_step", "training.gc_freq")
    for key in nonneg:
        value = section_of(config, key)
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    o = config.optimizer
    if o.eps <= 0:
        raise ConfigError(f"optimizer.eps must be > 0, got {o.eps}")
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(o, key) < 1.0:
            raise ConfigError(f"optimizer.{key} must be in [0, 1), got {getattr(o, key)}")
    if config.metrics.peak_tflops != -1 and config.metrics.peak_tflops <= 0:
        raise ConfigError(f"metrics.peak_tflops must be -1 (look up the GPU) or > 0, got {config.metrics.peak_tflops}")


def _check_core(config) -> None:
    """The core sections' own value rules."""

    def positive(key: str, minimum: int = 1) -> None:
        value = section_of(config, key)
        if value < minimum:
            raise ConfigError(f"{key} must be >= {minimum}, got {value}")

    for key in ("training.local_batch_size", "training.seq_len", "training.steps", "metrics.log_freq",
                "checkpoint.interval", "validation.freq", "parallelism.tensor_parallel_degree",
                "parallelism.pipeline_parallel_degree",
                "parallelism.pipeline_parallel_microbatch_size", "profiling.profile_freq",
                "checkpoint.max_failed_saves", "checkpoint.timeout_seconds", "comm.init_timeout_seconds",
                "comm.train_timeout_seconds", "checkpoint.preemption_check_steps"):
        positive(key)
    positive("lr_scheduler.warmup_steps", 0)
    positive("job.lock_stale_after_s", 0)
    positive("checkpoint.keep_latest_k", 0)
    t = config.training
    if t.global_batch_size != -1 and (t.global_batch_size < 1 or t.global_batch_size % t.local_batch_size):
        raise ConfigError(
            f"training.global_batch_size ({t.global_batch_size}) must be -1 or a positive multiple of "
            f"training.local_batch_size ({t.local_batch_size})"
        )
    for key in ("data_parallel_shard_degree", "data_parallel_replicate_degree"):
        value = getattr(config.parallelism, key)
        if value == 0 or value < -1:
            raise ConfigError(f"parallelism.{key} must be -1 or >= 1, got {value}")
    if config.optimizer.lr <= 0:
        raise ConfigError(f"optimizer.lr must be > 0, got {config.optimizer.lr}")
    if not 0.0 <= config.lr_scheduler.min_lr_factor <= 1.0:
        raise ConfigError(f"lr_scheduler.min_lr_factor must be in [0, 1], got {config.lr_scheduler.min_lr_factor}")
    if config.lr_scheduler.decay_ratio is not None and not 0.0 <= config.lr_scheduler.decay_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.decay_ratio must be in [0, 1] or None, got {config.lr_scheduler.decay_ratio}")
    if config.activation_checkpoint.mode == "selective":
        opt = config.activation_checkpoint.selective_ac_option
        if opt != "op" and not (opt.isdigit() and int(opt) >= 1):
            raise ConfigError(f"activation_checkpoint.selective_ac_option must be 'op' or a positive integer, got {opt!r}")
    if config.parallelism.pipeline_parallel_degree > 1 and config.validation.enable:
        raise ConfigError("validation.enable is not supported with pipeline_parallel_degree > 1 yet; "
                          "evaluate checkpoints with `trainer eval` instead")
    from trainer.parallel.pipeline import schedule_name

    schedule_name(config.parallelism.pipeline_parallel_schedule)
    f8 = config.quantize.linear.float8
    if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
        raise ConfigError('quantize.linear.float8.enable_fsdp_float8_all_gather needs recipe_name = "tensorwise"')
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        raise ConfigError("quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp precomputes the scales of "
                          "float8 all-gathers: it needs enable_fsdp_float8_all_gather = true")
    valid_converters = {"quantize.linear.float8"}
    for c in config.model.converters:
        if c not in valid_converters:
            raise ConfigError(f"model.converters: unknown converter {c!r}; valid: {sorted(valid_converters)}")


def _check_observability(config) -> None:
    """The profiling and watchdog settings that only make sense together."""
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


def _check_checkpoint(config) -> None:
    cfg = config.checkpoint
    if cfg.checksum == "xxh3_128" and importlib.util.find_spec("xxhash") is None:
        raise ConfigError("checkpoint.checksum xxh3_128 needs the xxhash package: pip install xxhash, or set "
                          "checkpoint.checksum sha256")
    if cfg.exclude_from_loading:  # imported only when needed: trainer.checkpoint imports torch
        from trainer.checkpoint.state import STATE_KEYS

        unknown = [k for k in cfg.exclude_from_loading if k not in STATE_KEYS]
        if unknown:
            raise ConfigError(f"checkpoint.exclude_from_loading: unknown entries {unknown}; valid: {list(STATE_KEYS)}")
    if cfg.initial_load_in_hf and not cfg.initial_load_path:
        raise ConfigError("checkpoint.initial_load_in_hf needs checkpoint.initial_load_path (the Hugging Face folder)")


def model_args(config):
    """The flavor's architecture with the [model] shape keys applied (vocabulary not resolved), or a
    ConfigError naming the key to fix."""
    from trainer.models import config_model_args

    return config_model_args(config)


def _check_model(config) -> None:
    model_args(config)


def _check_data(config) -> None:
    """Sources and names resolve (no file is opened; whether files exist is _check_paths')."""
    from trainer.data.c4 import DataNotLocal
    from trainer.data.checks import check_data_section
    from trainer.data.sources import training_specs, validation_spec

    check_data_section(config.data)
    try:
        training_specs(config)
        if config.validation.enable:
            validation_spec(config)
    except DataNotLocal:
        if not config.job.dry_run:  # torchtitan's c4 without a local copy: fine for a dry run, which reads none
            raise
    if config.validation.enable:
        if config.validation.local_batch_size < 1:
            raise ConfigError(f"validation.local_batch_size must be >= 1, got {config.validation.local_batch_size}")


def _check_paths(config) -> None:
    """What a run will read exists and the dump folder can be written: checked (stat only, nothing opened)
    before the launcher starts any process, so the mistake is one line, not a worker's failure."""
    from trainer.data.sources import training_specs, validation_spec

    m = config.model
    if m.tokenizer_path and not os.path.exists(os.path.expanduser(m.tokenizer_path)):
        key = "model.hf_assets_path" if m.tokenizer_path == m.hf_assets_path else "model.tokenizer_path"
        raise ConfigError(f"{key}: no such file or folder {m.tokenizer_path!r} (a folder with tokenizer.json, "
                          "or a tokenizer file)")
    specs = training_specs(config)[0] + ([validation_spec(config)] if config.validation.enable else [])
    for spec in specs:
        path = os.path.expanduser(spec.path)
        if spec.kind == "hf" or any(ch in path for ch in "*?["):
            continue  # hub names and globs resolve when the loader lists them
        if not os.path.exists(path):
            raise ConfigError(f"{spec.key}: no such file or folder {spec.path!r}")
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


def _check_layout(config, world_size: int) -> None:
    """Degrees against the world size, the batch and shards against the data-parallel degree, and the
    model's heads and layers against tensor and pipeline parallel."""
    from trainer.data.checks import grad_accum_steps
    from trainer.parallel.dims import resolve_degrees

    rep, shard, tp, pp = resolve_degrees(config.parallelism, world_size)
    dp = rep * shard
    grad_accum_steps(config, dp)
    if config.data.num_shards % dp:
        raise ConfigError(f"data.num_shards ({config.data.num_shards}) must be divisible by the data-parallel "
                          f"degree ({dp})")
    args = model_args(config)
    kv = args.num_kv_heads
    if tp > 1 and (args.n_heads % tp or kv % tp):
        raise ConfigError(f"parallelism.tensor_parallel_degree ({tp}) must divide the number of attention heads "
                          f"({args.n_heads}) and key/value heads ({kv})")
    if tp > 1 and config.training.seq_len % tp:
        raise ConfigError(f"training.seq_len ({config.training.seq_len}) must be a multiple of "
                          f"tensor_parallel_degree ({tp}): sequence parallel splits the sequence over the TP ranks")
    if tp > 1 and args.ffn_hidden_dim % tp:
        raise ConfigError(f"parallelism.tensor_parallel_degree ({tp}) must divide the SwiGLU hidden size "
                          f"({args.ffn_hidden_dim})")
    if pp > 1 and args.tie_word_embeddings:
        raise ConfigError(f"model.tie_word_embeddings (flavor {config.model.flavor}) cannot be trained with "
                          f"pipeline_parallel_degree {pp}: the embedding and the output layer live on different "
                          "stages; set model.tie_word_embeddings = false (trains them untied) or drop pipeline "
                          "parallel")
    if pp > 1:
        from trainer.parallel.pipeline import plan_stages

        plan_stages(config, args.n_layers)
    if config.checkpoint.create_seed_checkpoint and world_size != 1:
        raise ConfigError(f"checkpoint.create_seed_checkpoint runs on one process (NGPU=1), not {world_size}")
