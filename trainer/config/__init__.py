"""Job configuration: dataclass sections, TOML + command-line parsing, every rule, and the reference.

- ``sections.py``: one dataclass per TOML section; the string under each field is its documentation.
- ``keys.py``: introspection: sections, dotted keys, field docs, type names.
- ``parse.py``: defaults < TOML file < command line, with unknown keys and wrong types refused.
- ``validate.py``: every rule, ``validate(config, world_size)``; the launcher runs it before torchrun.
- ``reference.py``: ``--help``, docs/config.md and the ``trainer config`` command.
"""

from trainer.config.keys import field_docs, iter_sections, iter_values, leaf_keys, section_of, type_name
from trainer.config.parse import load_config, parse_cli, to_toml
from trainer.config.reference import documented_keys, help_text, main, markdown_reference
from trainer.config.sections import (  # the core sections
    SECTION_DOC, ActivationCheckpoint, Checkpoint, Comm, Compile, Debug, Float8, Job, JobConfig, LRScheduler, Metrics,
    Model, Optimizer, Parallelism, Profiling, Quantize, QuantizeLinear, Training, Validation,
)
from trainer.config.validate import validate
from trainer.errors import ConfigError

__all__ = [
    "ActivationCheckpoint", "Checkpoint", "Comm", "Compile", "Debug", "Float8", "Job", "LRScheduler", "Metrics", "Model", "Optimizer", "Parallelism", "Profiling", "Quantize", "QuantizeLinear", "Training", "Validation",
    "ConfigError", "JobConfig", "SECTION_DOC", "documented_keys", "field_docs", "help_text",
    "iter_sections", "iter_values", "leaf_keys", "load_config", "main", "markdown_reference", "parse_cli",
    "section_of", "to_toml", "type_name", "validate",
]
