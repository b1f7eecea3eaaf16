"""``validate(config, world_size)``: runs every layer's config rules, in order; it holds no rule itself.

Where a rule lives: next to the section it checks. The job-level sections' rules are in ``rules.py``, the
torchtitan keys accepted only at their default in ``trainer/compat.py``, and each layer's in its
``config.py`` (``trainer/{models,optim,parallel,checkpoint,observability,fault_tolerance}/config.py``; the data layer's in
``trainer/data/checks.py``); extensions add theirs through the registry. All of them are torch-free.

The launcher's pre-flight (``python -m trainer.config --check``) validates once before torchrun starts, and
every worker once at start-up (``trainer.train.main``), so a mistake is one line naming the key, before any
work. ``load_config`` only parses: a caller that needs a valid config calls this.
"""

from __future__ import annotations

import trainer.checkpoint.config as checkpoint
import trainer.config.rules as job
import trainer.data.checks as data
import trainer.fault_tolerance.config as fault_tolerance
import trainer.models.config as models
import trainer.observability.config as observability
import trainer.optim.config as optim
import trainer.parallel.config as parallel
from trainer import compat, extensions

# The rules that need no world size, in the order they run (the first broken one is reported).
_RULES = (job.check_numbers, compat.check, job.check_config, optim.check_config, parallel.check_config,
          observability.check_config, checkpoint.check_config, models.check_config, data.check_config,
          fault_tolerance.check_config)


def validate(config, world_size: int | None = None, *, files: bool = True) -> None:
    """Raise ConfigError for the first rule the config breaks. Rules that need the world size (degrees,
    batch geometry, shards, the model's heads and layers against the layout) run when it is given.
    ``files`` False (dry runs and simulations, which read no file) skips the checks that the tokenizer,
    data and dump folder are there."""
    for rule in _RULES:
        rule(config)
    if world_size is not None:
        dp = parallel.check_layout(config, world_size)
        data.check_layout(config, dp)
        checkpoint.check_layout(config, world_size)
        if files and not config.job.dry_run:  # presets can be checked on any machine
            models.check_paths(config)
            data.check_paths(config)
            job.check_dump_folder(config)
            checkpoint.check_paths(config)
    extensions.check_config(config, world_size)
