"""float8 training for Linear layers via torchao."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from torch import nn

from trainer.errors import ConfigError
from trainer.torch_compat import PYTREE_LOGGER

if TYPE_CHECKING:
    from trainer.config import JobConfig

logger = logging.getLogger("trainer")

# torchao's wheels carry compiled extensions this trainer never calls (MX formats, CUTLASS kernels); where one
# cannot load (a CPU machine, another Python build) torchao warns on every import, as does torch about an Enum
# torchao registers. Neither changes float8 training, which goes through torch's own scaled matmul.
_IMPORT_NOISE = ("torchao", PYTREE_LOGGER)


@contextlib.contextmanager
def quiet_torchao_import():
    """Import torchao modules inside this without its harmless load-time warnings (see _IMPORT_NOISE)."""
    loggers = [logging.getLogger(name) for name in _IMPORT_NOISE]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def convert_to_float8(model: nn.Module, config: JobConfig) -> None:
    """Swap eligible Linear layers for torchao's Float8Linear (in place, on the meta model).

    Eligible: not matched by ``filter_fqns`` and both dimensions divisible by 16 (the float8 matmul's
    alignment requirement).
    """
    cfg = config.quantize.linear.float8
    try:
        with quiet_torchao_import():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ConfigError(f"model.converters has quantize.linear.float8 but torchao is not importable: {e}") from None
    if cfg.enable_fsdp_float8_all_gather:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "quantize.linear.float8.enable_fsdp_float8_all_gather needs NCCL on GPUs: gloo cannot all-gather "
                "float8 tensors; set it to false on CPU"
            )
    if cfg.recipe_name == "tensorwise":
        f8_config = Float8LinearConfig(enable_fsdp_float8_all_gather=cfg.enable_fsdp_float8_all_gather,
                                       emulate=cfg.emulate)
    else:
        f8_config = Float8LinearConfig.from_recipe_name(cfg.recipe_name)
        if cfg.emulate:
            import dataclasses

            f8_config = dataclasses.replace(f8_config, emulate=True)

    def eligible(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if any(f in fqn for f in cfg.filter_fqns):
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, config=f8_config, module_filter_fn=eligible)
    logger.info("float8 (%s) applied to Linear layers", cfg.recipe_name)


def register_float8_scale_precompute(optimizer, model_parts: list[nn.Module], config: "JobConfig") -> bool:
    """quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp: after every optimizer step, compute
    the float8 scales of all FSDP-sharded weights at once (one amax all-reduce for the whole model instead of
    one per weight at each all-gather). Returns whether the hook was registered."""
    cfg = config.quantize.linear.float8
    if "quantize.linear.float8" not in config.model.converters or not cfg.precompute_float8_dynamic_scale_for_fsdp:
        return False
    with quiet_torchao_import():
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def precompute(*_):
        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)

    optimizer.register_step_post_hook(precompute)
    return True
