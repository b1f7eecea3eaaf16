"""The config reference (``--help`` and docs/config.md, both generated from the sections' field docs) and
the ``trainer config`` command, which also serves as the launcher's pre-flight check."""

from __future__ import annotations

import dataclasses
import os
import sys

from trainer.config.keys import (
    aliases, field_docs, field_types, is_section, iter_sections, job_config_class, section_docs, section_of, type_name,
)
from trainer.config.parse import load_config, to_toml, toml_value
from trainer.config.validate import validate
from trainer.errors import ConfigError


def documented_keys():
    """Yield (section, field name, type, default, doc) for every key, in declaration order."""
    defaults = job_config_class()()
    for section, cls in iter_sections():
        docs = field_docs(cls)
        obj = section_of(defaults, section)
        for f in dataclasses.fields(cls):
            tp = field_types(cls)[f.name]
            if not is_section(tp):
                yield section, f.name, tp, getattr(obj, f.name), docs.get(f.name, "")


def _former_names() -> dict[str, list[str]]:
    """Current dotted key -> the former names it is still accepted under."""
    out: dict[str, list[str]] = {}
    for old, new in aliases().items():
        out.setdefault(new, []).append(old)
    return out


def help_text() -> str:
    lines = [
        "usage: run_train.sh [--section.key value | --section.key=value | --section.bool_key | --section.no_bool_key] ...",
        "",
        "Keys are read from the TOML file given by CONFIG_FILE (or --job.config_file), then overridden on",
        "the command line. Lists are comma-separated. Every key, with its default:",
    ]
    current = None
    docs, former = section_docs(), _former_names()
    for section, name, tp, default, doc in documented_keys():
        if section != current:
            lines += ["", f"[{section}]  {docs.get(section, '')}"]
            current = section
        lines.append(f"  --{section}.{name}  ({type_name(tp)}, default {default!r})")
        lines += [f"      {doc_line}" for doc_line in doc.splitlines()]
        lines += [f"      Also accepted under its former name --{old}." for old in former.get(f"{section}.{name}", [])]
    return "\n".join(lines) + "\n"


def markdown_reference() -> str:
    """docs/config.md; a test checks the committed file equals this output."""
    out = [
        "# Configuration reference",
        "",
        "Generated from `trainer/config/` by `python -m trainer.config --markdown > docs/config.md`;",
        "a test fails when this file and the code disagree.",
        "",
        "Keys are set in a TOML file (`CONFIG_FILE=path ./run_train.sh` or `--job.config_file path`) and",
        "overridden on the command line as `--section.key value` or `--section.key=value` (booleans also as",
        "a bare `--section.key`, and false as `--section.no_key` or `--section.no-key`, as in torchtitan; lists",
        "comma-separated). Precedence: command line > TOML > defaults. torchtitan v0.2.x files load unchanged:",
        "see docs/coming_from_torchtitan.md.",
        "",
        "Each section is declared, with its rules, next to the code that uses it (`trainer/<layer>/config.py`;",
        "the job-level ones in `trainer/config/`); `trainer/config/validate.py` lists where each rule lives. A",
        "key that moved to another section stays accepted under its former name (an alias, noted in its row).",
    ]
    current = None
    docs, former = section_docs(), _former_names()
    for section, name, tp, default, doc in documented_keys():
        doc += "".join(f" Also accepted under its former name `{old}` (alias)." for old in former.get(f"{section}.{name}", []))
        if section != current:
            out += ["", f"## [{section}]", "", docs.get(section, ""), "", "| key | type | default | meaning |",
                    "| --- | --- | --- | --- |"]
            current = section
        shown = "None" if default is None else toml_value(default)
        tname = type_name(tp).replace("|", "\\|")
        doc = doc.replace("\n", " ").replace("|", "\\|")
        out.append(f"| `{name}` | {tname} | `{shown}` | {doc} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--markdown"]:
        print(markdown_reference(), end="")
        return 0
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        return 0
    check_only = "--check" in argv
    argv = [a for a in argv if a != "--check"]
    try:
        config = load_config(argv)
        if check_only:
            # The launcher's pre-flight: fail in a fraction of a second, before torchrun starts.
            validate(config, int(os.environ.get("WORLD_SIZE", "1")))
            return 0
        validate(config)  # `trainer config` prints a config only once its rules pass, as before
        print(to_toml(config))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0
