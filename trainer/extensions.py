"""The registry: the one place where the core meets the capabilities built on top of it.

The core (``trainer/``) never imports an extension package. Each package named in ``EXTENSION_PACKAGES``
exposes ``register(registry)``, which adds what the package brings:

- config sections (``[stability]``), declared as fields of a ``JobConfig`` subclass (``add_sections``): the
  parser builds that class, so extension code sees ``config.stability`` as a typed attribute, and the core
  never names it;
- former names of keys that moved into an extension's section (``add_alias``), still accepted;
- config rules, run by ``trainer.config.validate`` with every core rule (so the launcher's pre-flight
  sees them);
- callbacks, built per run from the config (``trainer.callbacks.Callback``);
- ``trainer`` subcommands.

Registration must stay light: no torch import. Callback factories and rules are given as
``"module:function"`` strings and imported on first use, so ``--help`` and the pre-flight stay fast.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

EXTENSION_PACKAGES: tuple[str, ...] = ("torchtitan_ext",)


def resolve(target: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass
class Registry:
    # The JobConfig subclass declaring the extensions' sections (None: trainer.config's JobConfig), and
    # one line of documentation per section it adds.
    job_config: type | None = None
    section_docs: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # former dotted key -> current dotted key
    rules: list[str] = field(default_factory=list)  # "module:function", called as f(config, world_size)
    callback_factories: list[str] = field(default_factory=list)  # "module:function", f(config) -> [Callback]
    commands: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (module with main, doc)

    def add_sections(self, job_config: type, docs: dict[str, str]) -> None:
        """``job_config`` subclasses the JobConfig in use so far (trainer.config's, or the previous
        package's), adding one field per section; ``docs`` has one line for each of them."""
        if self.job_config is not None and not issubclass(job_config, self.job_config):
            raise ValueError(f"{job_config.__name__} must subclass {self.job_config.__name__}, registered before it")
        for name in docs:
            if name in self.section_docs:
                raise ValueError(f"config section [{name}] registered twice")
        self.job_config = job_config
        self.section_docs.update(docs)

    def add_alias(self, former: str, current: str) -> None:
        """Accept ``former`` (a dotted key that moved) as ``current``, in TOML files and on the command line."""
        if former in self.aliases:
            raise ValueError(f"alias {former} registered twice")
        self.aliases[former] = current

    def add_rule(self, target: str) -> None:
        self.rules.append(target)

    def add_callbacks(self, target: str) -> None:
        self.callback_factories.append(target)

    def add_command(self, name: str, module: str, doc: str) -> None:
        if name in self.commands:
            raise ValueError(f"subcommand {name!r} registered twice")
        self.commands[name] = (module, doc)


_REGISTRY: Registry | None = None


def registry() -> Registry:
    """The registry, filled by every extension package on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        reg = Registry()
        for package in EXTENSION_PACKAGES:
            importlib.import_module(package).register(reg)
        _REGISTRY = reg
    return _REGISTRY


def callback_factories() -> list[Callable[[Any], list]]:
    """Every extension's callback factory, in registration order: ``f(config)`` -> its callbacks
    (``trainer.callbacks`` builds the run's list; the registry does not depend on it)."""
    return [resolve(target) for target in registry().callback_factories]


def check_config(config, world_size: int) -> None:
    """Run every extension's config rules (raise ConfigError on the first violation)."""
    for target in registry().rules:
        resolve(target)(config, world_size)
