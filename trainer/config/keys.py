"""Introspection of the config dataclasses: the JobConfig class in use, sections, dotted keys, field docs,
type names, and the former names of moved keys."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from trainer import extensions
from trainer.config.sections import SECTION_DOC, JobConfig


def job_config_class() -> type[JobConfig]:
    """The class the parser builds: ``JobConfig``, or the subclass the extensions registered with their
    sections."""
    return extensions.registry().job_config or JobConfig


def section_docs() -> dict[str, str]:
    """One line per section (``--help``, docs/config.md): the core's and the extensions'."""
    return {**SECTION_DOC, **extensions.registry().section_docs}


def aliases() -> dict[str, str]:
    """Former dotted key -> its current key; the parser accepts both (TOML and command line)."""
    return dict(extensions.registry().aliases)


def section_of(config, dotted: str) -> Any:
    """``section_of(config, "training.steps")`` -> the value; also works for a section's dotted name."""
    section: Any = config
    for part in dotted.split("."):
        section = getattr(section, part)
    return section


def field_docs(cls: type) -> dict[str, str]:
    """The string literal written under each field of a dataclass, by field name."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


@functools.cache
def field_types(cls: type) -> Mapping[str, Any]:
    """Each field's type, with string annotations resolved. Cached: resolving the annotations of every
    section costs a tenth of a second per config load, and a class's annotations do not change."""
    return types.MappingProxyType(typing.get_type_hints(cls))


def is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) and isinstance(tp, type)


def iter_sections(cls: type | None = None, prefix: str = ""):
    """Yield (dotted section name, dataclass type) for every section holding leaf keys."""
    cls = job_config_class() if cls is None else cls
    types_ = field_types(cls)
    leaves = [f for f in dataclasses.fields(cls) if not is_section(types_[f.name])]
    if prefix and leaves:
        yield prefix, cls
    for f in dataclasses.fields(cls):
        if is_section(types_[f.name]):
            yield from iter_sections(types_[f.name], f"{prefix}.{f.name}" if prefix else f.name)


def iter_values(config):
    """Yield (dotted key, value) for every leaf key of a config."""
    for key in leaf_keys():
        yield key, section_of(config, key)


def leaf_keys() -> dict[str, tuple[type, dataclasses.Field]]:
    """Every configurable key, dotted (e.g. "training.steps"), with its owning section and field."""
    keys = {}
    for section, cls in iter_sections():
        types_ = field_types(cls)
        for f in dataclasses.fields(cls):
            if not is_section(types_[f.name]):
                keys[f"{section}.{f.name}"] = (cls, f)
    return keys


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))
