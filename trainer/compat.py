"""torchtitan v0.2.x compatibility: the keys accepted only at their default, and torchtitan's aliases.

Every key of torchtitan v0.2.2's JobConfig loads here (docs/coming_from_torchtitan.md has the table). A key
that configures a feature this trainer does not have is accepted at torchtitan's default, so that its
config files load unchanged, and refused in one line naming the key and why as soon as it is set to
anything else: no key is ever silently ignored. ``resolve`` maps torchtitan's names onto ours right after
parsing (``load_config``), before any rule runs.

This module imports nothing heavy: ``validate`` (the launcher's pre-flight) runs ``check``. The value rules
of supported keys live with their sections (trainer/config/validate.py says where).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from trainer.errors import ConfigError
from trainer.fault_tolerance.config import TORCHTITAN_FT_CONFIG_MODULE
from trainer.models.llama.flavors import TORCHTITAN_FLAVORS

logger = logging.getLogger("trainer")

_NO_MX = "MX (microscaling) quantisation is not implemented; model.converters takes quantize.linear.float8"

# Key -> why it cannot take another value than torchtitan's default. The defaults are the JobConfig's.
REFUSED: dict[str, str] = {
    "job.custom_config_module": "extending JobConfig from a module is not supported (except "
                                f"{TORCHTITAN_FT_CONFIG_MODULE}, whose keys [fault_tolerance] has); extensions "
                                "add sections through trainer/extensions.py",
    "experimental.custom_import": "modules are not imported from the config; extensions attach through "
                                  "trainer/extensions.py",
    "experimental.custom_args_module": "extending JobConfig from a module is not supported; extensions add "
                                       "sections through trainer/extensions.py",
    "metrics.save_for_all_ranks": "metrics are written once per run, not per rank",
    "optimizer.early_step_in_backward": "stepping the optimizer inside backward is not implemented",
    "training.dtype": "pure bf16 training is not supported; use training.mixed_precision_param = \"bfloat16\"",
    "parallelism.pipeline_parallel_first_stage_less_layers": "the automatic split already spares the first "
                                                             "stage; use module_fqns_per_model_part",
    "parallelism.pipeline_parallel_last_stage_less_layers": "the automatic split already spares the last stage; "
                                                            "use module_fqns_per_model_part",
    "parallelism.pipeline_parallel_schedule_csv": "schedules are chosen by name (pipeline_parallel_schedule)",
    "parallelism.pipeline_parallel_expert_parallel_overlap": "overlapping the pipeline's stages with the expert "
                                                             "exchange is not implemented",
    "parallelism.expert_parallel_comm_backend": "the expert exchange is torch.distributed's all-to-all (DeepEP is "
                                                "not here)",
    "checkpoint.enable_ft_dataloader_checkpoints": "with fault_tolerance.enable every replica group always saves "
                                                   "its own loader state (docs/multinode.md)",
    "checkpoint.initial_load_in_hf_quantized": "quantized Hugging Face checkpoints are not read",
    "checkpoint.last_save_in_hf": "the last save is a DCP checkpoint; `trainer export` converts it to "
                                  "Hugging Face safetensors",
    "checkpoint.enable_first_step_checkpoint": "not implemented; checkpoint.interval = 1 checks saving early",
    "checkpoint.load_only": "not implemented; checkpoint.enable = false with checkpoint.initial_load_path "
                            "loads without saving",
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": "forcing the recomputation of "
                                                                         "chosen matmul shapes is not implemented",
    "activation_checkpoint.early_stop": "not wired to torch.utils.checkpoint's early stop",
    "activation_checkpoint.memory_budget": "the memory_budget mode is not implemented",
    "activation_checkpoint.visualize_memory_budget_pareto": "the memory_budget mode is not implemented",
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": _NO_MX,
    "quantize.linear.mx.recipe_name": _NO_MX,
    "comm.mode": "fake-backend and local-tensor modes are not here; job.dry_run checks a layout without devices",
    "memory_estimation.enable": "torchtitan's FSDP memory estimator is not here; `trainer plan` estimates memory "
                                "per GPU",
    "memory_estimation.disable_fake_mode": "torchtitan's FSDP memory estimator is not here; `trainer plan` "
                                           "estimates memory per GPU",
    "validation.dataloader.num_workers": "the validation pass runs in the training process",
    "validation.dataloader.persistent_workers": "the validation pass runs in the training process",
    "validation.dataloader.pin_memory": "the validation pass runs in the training process",
    "validation.dataloader.prefetch_factor": "the validation pass runs in the training process",
    "debug.moe_force_load_balance": "forced round-robin expert routing is not implemented",
}
# Values of a key in REFUSED that are accepted all the same: what torchtitan's module would add is here already.
ACCEPTED_VALUES: dict[tuple[str, Any], str] = {
    ("job.custom_config_module", TORCHTITAN_FT_CONFIG_MODULE): "its keys are [fault_tolerance]'s own",
}
# Values refused inside a key that is otherwise supported.
REFUSED_VALUES: dict[tuple[str, Any], str] = {
    ("activation_checkpoint.mode", "memory_budget"): "torch.compile's memory-budget partitioner is not wired; "
                                                      "use selective or full",
}
# torchtitan's other converters: a clearer word than "unknown converter".
REFUSED_CONVERTERS = {
    "quantize.linear.mx": _NO_MX,
    "quantize.grouped_mm.float8": "float8 grouped GEMMs for the experts are not implemented yet (the experts run "
                                  "in the training precision)",
    "quantize.grouped_mm.mx": _NO_MX,
}
# The modules each refused converter would convert: the only reader of these keys, which therefore load with
# any value (torchtitan's llama4 files set them without the converter).
CONVERTER_MODULES = {
    "quantize.linear.mx": "quantize.linear.mx.filter_fqns",
    "quantize.grouped_mm.float8": "quantize.grouped_mm.float8.fqns",
    "quantize.grouped_mm.mx": "quantize.grouped_mm.mx.fqns",
}
# Converter names torchtitan's own files use for a converter this trainer has (its llama3_405b.toml says
# "float8", which its parallelize code reads as float8 linear layers).
CONVERTER_NAMES = {"float8": "quantize.linear.float8"}


def _get(config, dotted: str) -> Any:
    obj = config
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _default(config, dotted: str) -> Any:
    section, _, name = dotted.rpartition(".")
    fresh = type(_get(config, section))()
    return getattr(fresh, name)


def check(config) -> None:
    """Refuse, in one line, any torchtitan key set to a value this trainer cannot honour."""
    for key, why in REFUSED.items():
        value, default = _get(config, key), _default(config, key)
        if isinstance(value, str) and (key, value) in ACCEPTED_VALUES:
            continue
        if value != default and not (value in (None, "") and default in (None, "")):  # torchtitan: both mean unset
            raise ConfigError(f"{key} = {json.dumps(value)} is not supported: {why}; leave it at "
                              f"{json.dumps(default)}")
    for (key, value), why in REFUSED_VALUES.items():
        if _get(config, key) == value:
            raise ConfigError(f"{key} = {json.dumps(value)} is not supported: {why}")
    for c in config.model.converters:
        if c in REFUSED_CONVERTERS:
            key = CONVERTER_MODULES[c]
            raise ConfigError(f"model.converters: {c!r} (for {key} = {json.dumps(_get(config, key))}) is not "
                              f"supported: {REFUSED_CONVERTERS[c]}")
    _check_loader_workers(config)


def _check_loader_workers(config) -> None:
    """torchtitan's [training.dataloader] against its [data] namesakes, with PyTorch's own rules."""
    w, d = config.training.dataloader, config.data
    explicit = config.explicitly_set
    for name in ("num_workers", "pin_memory", "prefetch_factor"):
        ours, theirs = getattr(d, name), getattr(w, name)
        if explicit(f"data.{name}") and explicit(f"training.dataloader.{name}") and ours != theirs:
            raise ConfigError(f"data.{name} ({ours}) and training.dataloader.{name} ({theirs}) disagree; set one")
    if w.num_workers < 0:
        raise ConfigError(f"training.dataloader.num_workers must be >= 0, got {w.num_workers}")
    workers = w.num_workers if explicit("training.dataloader.num_workers") else d.num_workers
    if w.persistent_workers and workers == 0:
        raise ConfigError("training.dataloader.persistent_workers needs num_workers > 0 (as in PyTorch)")
    if w.prefetch_factor is not None and workers == 0:
        raise ConfigError("training.dataloader.prefetch_factor needs num_workers > 0 (as in PyTorch); leave it "
                          "unset")


# torchtitan's flavors whose attention is limited to each document (its flex and varlen attention types).
_BLOCK_CAUSAL_SUFFIXES = ("_flex_attn", "_varlen_attn", "_flex", "_varlen")


def resolve(config) -> None:
    """Map torchtitan's names onto this trainer's, in place (called once, right after parsing)."""
    explicit = config.explicitly_set
    m = config.model
    # torchtitan's document-masked flavors ("debugmodel_flex_attn", "8B_varlen", ...) are its base flavor
    # with attn_mask_type block_causal (the kernel is this trainer's choice: docs/data.md); an explicit
    # model.attn_mask_type wins.
    for suffix in _BLOCK_CAUSAL_SUFFIXES:
        if m.flavor.endswith(suffix):
            m.flavor = m.flavor[:-len(suffix)]
            if not explicit("model.attn_mask_type"):
                m.attn_mask_type = "block_causal"
            break
    # torchtitan's flavor names ("8B"): every consumer of model.flavor then sees the one table's name.
    m.flavor = TORCHTITAN_FLAVORS.get(m.name, {}).get(m.flavor, m.flavor)
    # torchtitan reads the tokenizer from hf_assets_path; model.tokenizer_path, when given, wins.
    if m.hf_assets_path and not m.tokenizer_path:
        m.tokenizer_path = m.hf_assets_path
    # torchtitan loads Hugging Face weights from hf_assets_path when no initial_load_path is given.
    c = config.checkpoint
    if c.initial_load_in_hf and not c.initial_load_path and m.hf_assets_path:
        c.initial_load_path = m.hf_assets_path
    converters = [CONVERTER_NAMES.get(c, c) for c in m.converters]
    m.converters = list(dict.fromkeys(converters))  # "float8" beside its full name is still one converter
    # torchtitan's [training.dataloader] keys are the user's [data] keys: marked as given, so that a default
    # derived later (data.pin_memory on CUDA) does not override them. Both given and different: left for
    # check to refuse.
    w = config.training.dataloader
    for name in ("num_workers", "pin_memory", "prefetch_factor"):
        if (explicit(f"training.dataloader.{name}") and getattr(w, name) is not None
                and not explicit(f"data.{name}")):
            setattr(config.data, name, getattr(w, name))
            config.explicit_keys.add(f"data.{name}")


def announce(config, rank: int) -> None:
    """job.print_config: log the resolved config; job.save_config_file: write it as JSON (rank 0)."""
    as_dict = dataclasses.asdict(config)
    if config.job.print_config and rank == 0:
        logger.info("Running with configs: %s", json.dumps(as_dict, indent=2, ensure_ascii=False))
    if config.job.save_config_file is not None and rank == 0:
        path = os.path.join(config.job.dump_folder, config.job.save_config_file)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(as_dict, f, indent=2)
        logger.info("Saved job configs to %s", path)
