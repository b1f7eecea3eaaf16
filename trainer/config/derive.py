"""The run's config: a validated config with its derived values filled in, then frozen.

Some keys' values follow from other keys or from the machine. Each is computed here, once, before anything
reads it, and the run's config.toml records the result:

- ``debug.seed``: unset means 0 (:func:`run_seed`, the only place this default lives; ``data.seed`` unset
  follows it);
- ``data.pin_memory``: on CUDA, pinned unless the user set it (pinned batches make the step's
  ``non_blocking`` host-to-device copies asynchronous; from pageable memory they are synchronous copies
  through a staging buffer);
- ``job.dump_folder``: a replica group of a fault-tolerant job writes its outputs under
  ``<job.dump_folder>/replica_<id>`` (trainer/fault_tolerance/config.py: ``group_dump_folder``).

After that the config is frozen: setting a key raises :class:`FrozenConfigError`, so no layer can change
what another already read. The caller's config is left as it was (:func:`derive` works on a copy).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from trainer.fault_tolerance.config import group_dump_folder


class FrozenConfigError(AttributeError):
    """A key was set on the run's config after its derived values were computed (a bug, not user input)."""


def run_seed(config) -> int:
    """``debug.seed``, or 0 where it is unset."""
    return 0 if config.debug.seed is None else int(config.debug.seed)


def derive(config, device_type: str):
    """A frozen copy of ``config`` (validated) with its derived values: see the module's docstring.
    ``device_type`` is the device the run trains on ("cuda", "cpu")."""
    config = copy.deepcopy(config)
    config.debug.seed = run_seed(config)
    if device_type == "cuda" and not config.explicitly_set("data.pin_memory"):
        config.data.pin_memory = True
    config.job.dump_folder = group_dump_folder(config)
    freeze(config)
    return config


# Each config class's frozen variant: the same class (isinstance, dataclasses.fields and asdict see no
# difference) whose instances refuse assignment.
_FROZEN: dict[type, type] = {}


def _refuse(self, name: str, value: Any = None) -> None:
    raise FrozenConfigError(f"the run's config is frozen: {type(self).__name__}.{name} cannot change once the "
                            "derived values are set (compute a derived value in trainer/config/derive.py)")


def _thawed_copy(cls: type, state: dict) -> Any:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def _frozen_class(cls: type) -> type:
    if cls not in _FROZEN:
        _FROZEN[cls] = type(cls.__name__, (cls,), {
            "__setattr__": _refuse, "__delattr__": _refuse, "__module__": cls.__module__,
            # A copy or a pickle (another process) is an ordinary, unfrozen config.
            "__reduce__": lambda self: (_thawed_copy, (cls, dict(self.__dict__))),
        })
    return _FROZEN[cls]


def freeze(config) -> None:
    """Make ``config`` and every section in it refuse assignment, in place."""
    object.__setattr__(config, "explicit_keys", frozenset(config.explicit_keys))
    stack = [config]
    while stack:
        obj = stack.pop()
        stack += [v for f in dataclasses.fields(obj) if dataclasses.is_dataclass(v := getattr(obj, f.name))]
        if type(obj) not in _FROZEN.values():
            object.__setattr__(obj, "__class__", _frozen_class(type(obj)))

