"""Job configuration: the declared ``JobConfig``, TOML + command-line parsing, the reference, and
``validate`` which runs every layer's rules.

- ``sections.py``: the job-level sections and ``JobConfig``; each layer declares its own sections, with their
  rules, in ``trainer/<layer>/config.py`` (torch-free); extensions subclass ``JobConfig`` (registry).
- ``keys.py``: introspection: the JobConfig class in use, sections, dotted keys, field docs, type names, aliases.
- ``parse.py``: defaults < TOML file < command line, with unknown keys and wrong types refused; no validation.
- ``rules.py``: the job-level sections' rules. ``validate.py``: ``validate(config, world_size)`` runs every
  layer's rules in order; the launcher's pre-flight runs it once before torchrun, each worker once at start-up.
- ``derive.py``: ``derive(config, device_type)``: the run's config, a frozen copy with the derived values
  (seed, pinned memory, a replica group's folder) computed once; the trainer builds from it.
- ``reference.py``: ``--help``, docs/config.md and the ``trainer config`` command.
"""

from trainer.config.derive import FrozenConfigError, derive, run_seed
from trainer.config.keys import (
    aliases, field_docs, iter_sections, iter_values, job_config_class, leaf_keys, section_docs, section_of, type_name,
)
from trainer.config.parse import load_config, parse_cli, to_toml
from trainer.config.reference import documented_keys, help_text, main, markdown_reference
from trainer.config.sections import SECTION_DOC, JobConfig
from trainer.config.validate import validate
from trainer.errors import ConfigError

__all__ = [
    "ConfigError", "FrozenConfigError", "JobConfig", "SECTION_DOC", "aliases", "derive", "documented_keys",
    "field_docs", "help_text", "iter_sections", "iter_values", "job_config_class", "leaf_keys", "load_config", "main",
    "markdown_reference", "parse_cli", "run_seed", "section_docs", "section_of", "to_toml", "type_name", "validate",
]
