"""Sections that exist so that torchtitan v0.2.x config files load unchanged.

Each of these is torchtitan's section with its key names, types and defaults. Most of them configure a
feature this trainer does not have (MX or grouped-GEMM quantisation, FSDP memory
estimation, custom JobConfig modules; the MX and grouped-GEMM [quantize] sections live with float8 in
trainer/parallel/config.py): such a key is accepted at its default and refused, in one line
naming it and why, when set otherwise (the table of reasons is ``trainer/compat.py``). The loader-worker
section ``[training.dataloader]`` is honoured (it maps onto ``[data]``). See docs/coming_from_torchtitan.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoaderWorkers:
    num_workers: int = 0
    """torchtitan's name for loader worker processes per rank; training: the same as data.num_workers (set
    one of the two), validation: must stay 0 (the validation pass runs in the training process)."""
    persistent_workers: bool = False
    """Keep loader workers alive between epochs. This trainer's workers always live for the whole run (the
    data stream crosses epochs without restarting them); true needs num_workers > 0, as in PyTorch."""
    pin_memory: bool = False
    """torchtitan's name for data.pin_memory (training loader; validation: must stay false)."""
    prefetch_factor: int | None = None
    """torchtitan's name for data.prefetch_factor (training loader; needs num_workers > 0, as in PyTorch).
    None: data.prefetch_factor."""


@dataclass
class MemoryEstimation:
    enable: bool = False
    """Refused unless false: torchtitan's FSDP memory estimator is not here; `trainer plan` estimates
    parameters, FLOPs and memory per GPU for a config and GPU count without running it."""
    disable_fake_mode: bool = False
    """Refused unless false (only used by the memory estimator, see memory_estimation.enable)."""


@dataclass
class Experimental:
    custom_import: str = ""
    """Refused unless empty: modules are not imported by name from the config; capabilities attach through
    the extension registry (trainer/extensions.py)."""
    custom_args_module: str = ""
    """Refused unless empty (torchtitan's deprecated name of job.custom_config_module)."""


SECTION_DOC = {
    "training.dataloader": "torchtitan's loader-worker keys for training (the same as their [data] namesakes).",
    "memory_estimation": "torchtitan's FSDP memory estimator (not here: use `trainer plan`; defaults only).",
    "experimental": "torchtitan's custom imports (extensions use trainer/extensions.py; defaults only).",
    "validation.dataloader": "torchtitan's loader-worker keys for validation (defaults only: it runs in-process).",
}
