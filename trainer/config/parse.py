"""Reading a config: TOML file + command line over the defaults, and writing it back as TOML.

Precedence: command line > TOML file > defaults. Anything a user can get wrong (unknown key, wrong type)
raises :class:`ConfigError` naming the key. Parsing does not validate: the value rules run in
``validate.py``, called once by whoever needs a valid config (the launcher's pre-flight, each worker at
start-up, the command-line tools). A key that moved keeps its former name as an alias (``keys.aliases``).
Right after parsing, the layers' precedence rules between keys (trainer/data/checks.py) and torchtitan's
names (trainer/compat.py) are applied; the values derived from others or from the machine come last, once,
on the validated config (``derive.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from trainer import compat
from trainer.config.keys import aliases, field_types, iter_sections, job_config_class, leaf_keys, section_of, type_name
from trainer.config.sections import JobConfig
from trainer.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


# --------------------------------------------------------------------------------------------------
# Value conversion
# --------------------------------------------------------------------------------------------------

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _convert(key: str, tp: Any, value: Any, from_cli: bool) -> Any:
    """Check (TOML) or parse (command-line string) one value against a field's type."""
    origin = typing.get_origin(tp)
    expected = type_name(tp)

    def fail(extra: str = "") -> typing.NoReturn:
        raise ConfigError(f"{key}: expected {expected}, got {value!r}{extra}")

    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and (value is None or (from_cli and str(value).lower() in ("none", "null"))):
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(key, arg, value, from_cli)
            except ConfigError as e:
                errors.append(e)
        close = re.search(r" \(did you mean '[^']*'\?\)", " ".join(map(str, errors)))
        fail(close.group(0) if close else "")  # a choice's suggestion (a Literal or None) is kept
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        if from_cli:
            for c in choices:
                if str(c) == str(value):
                    return c
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        fail(f" (did you mean {close[0]!r}?)" if close else "")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if from_cli and isinstance(value, str):
            value = _split_cli_list(value, item_tp)
        if not isinstance(value, list):
            fail()
        return [_convert(f"{key}[{i}]", item_tp, v, from_cli) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and str(value).lower() in _TRUE | _FALSE:
            return str(value).lower() in _TRUE
        fail(" (use true or false)")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli:
            try:
                return int(str(value).replace("_", ""))
            except ValueError:
                pass
        fail()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_cli:
            try:
                return float(value)
            except ValueError:
                pass
        fail()
    if tp is str:
        if isinstance(value, str):
            return value
        if from_cli:
            return str(value)
        fail()
    raise TypeError(f"unsupported config type {tp} for {key}")  # a bug in this file, not user input


def _split_cli_list(value: str, item_tp: Any) -> list:
    """CLI lists are comma-separated; nested lists use JSON (e.g. '[["a","b"],["c"]]')."""
    value = value.strip()
    if value.startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"cannot parse list {value!r}: {e}") from None
    if value == "":
        return []
    items = [v.strip() for v in value.split(",")]
    if typing.get_origin(item_tp) is list:
        # Inclusive integer ranges: "10-20,25" -> [[10, 20], [25, 25]].
        ranges = []
        for item in items:
            lo, _, hi = item.partition("-")
            try:
                ranges.append([int(lo), int(hi or lo)])
            except ValueError:
                raise ConfigError(f"cannot parse range {item!r} in {value!r}; use e.g. 10-20,25-30") from None
        return ranges
    return items


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _unknown_key(key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:
        # A typo in the section name but a correct key name: match on the last part.
        tail = key.rsplit(".", 1)[-1]
        close = [k for k in known if k.rsplit(".", 1)[-1] == tail][:1] or difflib.get_close_matches(
            tail, [k.rsplit(".", 1)[-1] for k in known], n=1
        )
        close = [k for k in known if k.endswith("." + close[0])][:1] if close else []
    hint = f"; did you mean '{close[0]}'?" if close else "; run with --help for the list of keys"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _flatten_toml(data: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    sections = {s for s, _ in iter_sections()}
    for k, v in data.items():
        dotted = f"{prefix}.{k}" if prefix else k
        is_section_prefix = any(s == dotted or s.startswith(dotted + ".") for s in sections)
        if isinstance(v, dict) and is_section_prefix:
            flat.update(_flatten_toml(v, dotted))
        else:
            flat[dotted] = v
    return flat


def parse_cli(argv: list[str]) -> dict[str, str | bool]:
    """``--section.key value``, ``--section.key=value`` or a bare ``--section.bool_key`` -> {key: value}."""
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.key value")
        body = arg[2:]
        if "=" in body:
            key, value = body.split("=", 1)
            i += 1
        else:
            key = body
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or (nxt.startswith("--") and len(nxt) > 2 and not _is_number(nxt)):
                value = True  # bare flag; only valid for booleans (checked on conversion)
                i += 1
            else:
                value = nxt
                i += 2
        out[key.replace("-", "_")] = value
    return out


def _negated_flag(key: str, value: str | bool, known: dict) -> tuple[str, bool]:
    """``--section.no_key`` (or ``--section.no-key``) sets the boolean ``section.key`` to false, as in
    torchtitan's command lines; anything else unknown is a ConfigError with the closest key."""
    section, _, name = key.rpartition(".")
    target = f"{section}.{name[3:]}"
    if name.startswith("no_") and target in known:
        cls, f = known[target]
        if field_types(cls)[f.name] in (bool, bool | None):  # e.g. model.tie_word_embeddings (None: the flavor's)
            if value is not True:
                raise ConfigError(f"--{key} takes no value (it sets {target} to false)")
            return target, False
    raise _unknown_key(key, list(known))


def _renamed(keys: list[str], where: str) -> dict[str, str]:
    """Each key -> its current name (a former name maps to the key it became). Giving both names of one key
    in the same place is refused: which one wins would be a guess."""
    former = aliases()
    out = {key: former.get(key, key) for key in keys}
    for old, new in out.items():
        if old != new and new in keys:
            raise ConfigError(f"{where}{old} is the former name of {new}; set only {new}")
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def load_config(argv: list[str] | None = None, env: dict[str, str] | None = None) -> JobConfig:
    """Build the JobConfig from defaults, the TOML file (``--job.config_file`` or $CONFIG_FILE) and CLI.
    Not validated: call ``validate`` (once) where a valid config is needed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if env is None else env
    known = leaf_keys()
    cli = {}
    given = parse_cli(argv)
    current = _renamed(list(given), "--")
    for key, value in given.items():
        key = current[key]
        if key not in known:
            key, value = _negated_flag(key, value, known)
        cli[key] = value

    values: dict[str, tuple[Any, bool]] = {}
    config_file = cli.get("job.config_file") or env.get("CONFIG_FILE") or None
    if config_file:
        path = Path(str(config_file))
        if path.is_dir():
            tomls = sorted(p.name for p in path.glob("*.toml"))[:5]
            inside = f" ({', '.join(tomls)})" if tomls else ""
            raise ConfigError(f"job.config_file: '{path}' is a folder; name a TOML file, such as one in it{inside}")
        if not path.is_file():
            raise ConfigError(f"job.config_file: no such file '{path}'{_relative_hint(path)}")
        try:
            text = path.read_text(encoding="utf-8")
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            hint = ("; it starts with a UTF-8 byte-order mark (some Windows editors add one): save it as UTF-8 "
                    "without BOM" if text.startswith("\ufeff") else "")
            raise ConfigError(f"job.config_file: '{path}' is not valid TOML: {e}{hint}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"job.config_file: '{path}' is not UTF-8 text (TOML must be): byte {e.object[e.start]:#x} "
                              f"at offset {e.start}") from None
        except OSError as e:
            raise ConfigError(f"job.config_file: cannot read '{path}': {e.strerror}") from None
        flat = _flatten_toml(data)
        current = _renamed(list(flat), f"{path}: ")
        for key, value in flat.items():
            key = current[key]
            if key not in known:
                raise ConfigError(f"{path}: {_unknown_key(key, list(known))}")
            values[key] = (value, False)
        values["job.config_file"] = (str(path.resolve()), True)
    for key, value in cli.items():
        values[key] = (value, True)
    if config_file:  # the file read, recorded absolute in config.toml (relative: to this working directory)
        values["job.config_file"] = (str(Path(str(config_file)).resolve()), True)

    config = job_config_class()()
    for key, (value, from_cli) in values.items():
        cls, f = known[key]
        tp = field_types(cls)[f.name]
        if value is True and from_cli and tp is not bool and typing.get_origin(tp) is None:
            raise ConfigError(f"{key}: expected a value ({type_name(tp)})")
        converted = _convert(key, tp, value, from_cli)
        section = config
        for part in key.split(".")[:-1]:
            section = getattr(section, part)
        setattr(section, f.name, converted)
    config.explicit_keys = set(values)
    config.command_line_keys = {key for key, (_, from_cli) in values.items() if from_cli}
    for resolve in _after_parsing():
        resolve(config)
    return config


def _after_parsing():
    """What runs on every parsed config, in order: layers' precedence rules between keys, then torchtitan's
    names (hf_assets_path, [training.dataloader]) mapped onto ours."""
    from trainer.data.checks import prefer_command_line_sources  # the data layer imports the config package

    return (prefer_command_line_sources, compat.resolve)


def _relative_hint(path: Path) -> str:
    """For a relative path not found: where it was looked for, and the repository's file of that name."""
    if path.is_absolute():
        return ""
    bundled = Path(__file__).resolve().parents[2] / path
    also = f"; the repository has {bundled}" if bundled.is_file() else ""
    return f" (relative to the working directory {os.getcwd()}){also}"


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(v)


def to_toml(config: JobConfig) -> str:
    """The resolved config as TOML (keys whose value is None are written as comments)."""
    lines = []
    for section, _ in iter_sections():
        obj = section_of(config, section)
        lines.append(f"[{section}]")
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                continue
            lines.append(f"# {f.name} = None" if v is None else f"{f.name} = {toml_value(v)}")
        lines.append("")
    return "\n".join(lines)
