"""The data layer's config rules ([data], the training and validation sources) and batch geometry: no
torch, so that the launcher's pre-flight (``validate``) runs them in a fraction of a second. The [data]
section itself is declared in config.py."""

from __future__ import annotations

import json
import logging
import os

from trainer.data.c4 import DataNotLocal
from trainer.data.source_base import refuse_megatron_halves
from trainer.data.sources import training_specs, validation_spec
from trainer.errors import ConfigError


def prefer_command_line_sources(config) -> None:
    """``--data.sources`` on the command line over a config file's ``training.dataset`` (the presets set one):
    the command line wins, as it does for any key, and the log says so. Both in the same place stay a
    mistake (validation refuses it). Runs right after parsing (``load_config``)."""
    cli = config.command_line_keys
    if "data.sources" not in cli:
        return
    from_file = [k for k in ("training.dataset", "training.dataset_path") if config.explicitly_set(k) and k not in cli]
    for key in from_file:
        config.explicit_keys.discard(key)
    if from_file:
        values = {"training.dataset": config.training.dataset, "training.dataset_path": config.training.dataset_path}
        logging.getLogger("trainer").info(
            "data.sources from the command line replaces %s of %s",
            " and ".join(f"{k} = {json.dumps(values[k])}" for k in from_file), config.job.config_file)


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


def check_config(config) -> None:
    """[data] bounds, and the sources and dataset names resolve (no file is opened: check_paths does that)."""
    check_data_section(config.data)
    try:
        training_specs(config)
        if config.validation.enable:
            validation_spec(config)
    except DataNotLocal:
        if not config.job.dry_run:  # torchtitan's c4 without a local copy: fine for a dry run, which reads none
            raise


def check_layout(config, dp: int) -> None:
    """The batch and the shards against the data-parallel degree."""
    grad_accum_steps(config, dp)
    if config.data.num_shards % dp:
        raise ConfigError(f"data.num_shards ({config.data.num_shards}) must be divisible by the data-parallel "
                          f"degree ({dp})")


def check_paths(config) -> None:
    """What the run will read exists (stat only, and the magic of a Megatron .idx beside a file another kind would
    read): one line before any process starts, not a worker's failure."""
    specs = training_specs(config)[0] + ([validation_spec(config)] if config.validation.enable else [])
    for spec in specs:
        path = os.path.expanduser(spec.path)
        if spec.kind == "hf" or any(ch in path for ch in "*?["):
            continue  # hub names and globs resolve when the loader lists them
        if spec.kind == "megatron" and os.path.isfile(path + ".idx"):
            continue  # a Megatron path prefix ("..._text_document" for its .idx/.bin pair)
        if spec.kind != "megatron" and os.path.isfile(path):
            refuse_megatron_halves(spec, [path])
        if not os.path.exists(path):
            hint = ""
            if os.path.isfile(path + ".idx"):  # a Megatron prefix read as another kind (training.dataset left as is)
                section = spec.key.split(".")[0]
                fix = f"write megatron:{spec.path}"
                if spec.key.endswith(".dataset_path"):
                    fix = f"set {section}.dataset megatron (or {fix})"
                hint = f"; it is the prefix of a Megatron .idx/.bin pair: {fix}"
            raise ConfigError(f"{spec.key}: no such file or folder {spec.path!r}{hint}")
