"""Helpers of the Hugging Face interop tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def import_toml_args(text: str) -> list[str]:
    """The keys of `trainer import`'s import.toml as command-line overrides (as if pasted into the training
    config), nested tables ([model.moe]) included."""
    out = []

    def walk(prefix: str, table: dict) -> None:
        for k, v in table.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            else:
                out.append(f"--{prefix}{k}={json.dumps(v) if isinstance(v, bool) else v}")

    walk("", tomllib.loads(text))
    return out


def assert_import_refused(folder: Path, tmp_path: Path, change: dict, named: str, capsys) -> None:
    """`trainer import` of ``folder`` with its config.json changed by ``change`` (the weights linked) exits 2
    with one line naming ``named``, and writes nothing."""
    from torchtitan_ext.hf_import import main as import_main

    hf = tmp_path / "hf"
    hf.mkdir()
    for f in folder.iterdir():
        (hf / f.name).symlink_to(f)
    (hf / "config.json").unlink()
    cfg = json.loads((folder / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, **change}))
    assert import_main(["--hf", str(hf), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
    assert not (tmp_path / "out").exists()
