"""The registry: the one place where the core meets the capabilities built on top of it.

The core (``trainer/``) never imports an extension package. Each package named in ``EXTENSION_PACKAGES``
exposes ``register(registry)``, which adds what the package brings:

- config sections (``[stability]``), with their documentation, merged into ``JobConfig``;
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
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from trainer.callbacks import Callback

EXTENSION_PACKAGES: tuple[str, ...] = ("torchtitan_ext",)


def resolve(target: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass
class Registry:
    sections: dict[str, tuple[type, str]] = field(default_factory=dict)  # name -> (dataclass, doc)
    rules: list[str] = field(default_factory=list)  # "module:function", called as f(config, world_size)
    callback_factories: list[str] = field(default_factory=list)  # "module:function", f(config) -> [Callback]
    commands: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (module with main, doc)

    def add_section(self, name: str, cls: type, doc: str) -> None:
        if name in self.sections:
            raise ValueError(f"config section [{name}] registered twice")
        self.sections[name] = (cls, doc)

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


def build_callbacks(config) -> list["Callback"]:
    """Every extension's callbacks for this config, in registration order."""
    out: list[Callback] = []
    for target in registry().callback_factories:
        out += resolve(target)(config)
    return out


def check_config(config, world_size: int) -> None:
    """Run every extension's config rules (raise ConfigError on the first violation)."""
    for target in registry().rules:
        resolve(target)(config, world_size)
