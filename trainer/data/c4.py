"""torchtitan's dataset names (c4, c4_test, c4_validation), read from local files.

torchtitan streams allenai/c4 from the Hugging Face hub unless ``dataset_path`` points at a local copy;
here data is always local, so the name needs the path. A path may be:

- a file or glob: JSON lines (``.json``/``.jsonl``, gzipped or not) or parquet, with a ``text`` field
  (allenai/c4's rows also carry ``timestamp`` and ``url``, which are ignored);
- a folder in the allenai/c4 layout (``en/c4-train.00000-of-01024.json.gz``, ``en/c4-validation.*``):
  the files of the name's split, from ``en/`` when present (torchtitan reads the ``en`` configuration);
- any other folder (torchtitan's c4_test is a folder holding one JSON-lines file): all its data files.

This module only names files (it imports nothing from the readers); ``sources._single_spec`` uses it.
"""

from __future__ import annotations

import glob
import os

from trainer.errors import ConfigError

class DataNotLocal(ConfigError):
    """A torchtitan dataset name without dataset_path: refused, except by a dry run (which reads no data)."""


# Name -> the allenai/c4 split its files are taken from (c4_test is torchtitan's 2K-row sample of train).
SPLITS = {"c4": "train", "c4_test": "train", "c4_validation": "validation"}
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz")


def data_suffix(path: str) -> str:
    """".json.gz" for "x.json.gz", ".parquet" for "x.parquet": the suffix that tells the format."""
    name = os.path.basename(path.rstrip("*")).lower()
    stem, dot, last = name.rpartition(".")
    if not dot:
        return ""
    if last == "gz" and "." in stem:
        return "." + stem.rpartition(".")[2] + ".gz"
    return "." + last


def _kind_of(files: list[str], key: str, shown: str) -> str:
    kinds = {"parquet" if data_suffix(f) == ".parquet" else "jsonl" for f in files}
    if len(kinds) > 1:
        raise ConfigError(f"{key}: {shown!r} mixes JSON-lines and parquet files; point at one kind")
    return kinds.pop()


def c4_source(name: str, path: str, section: str) -> tuple[str, str, str]:
    """(kind, path or glob, config key) for torchtitan dataset ``name`` read from ``path``."""
    key = f"{section}.dataset_path"
    if not path:
        raise DataNotLocal(
            f"{section}.dataset = {name!r} is torchtitan's Hugging Face dataset (allenai/c4), which is read from "
            f"local files only here: set {key} to a local copy (a folder in the allenai/c4 layout, or JSON-lines "
            "or parquet files with a text field)"
        )
    expanded = os.path.expanduser(path)
    if any(ch in path for ch in "*?[") or os.path.isfile(expanded):
        suffix = data_suffix(path)
        if suffix != ".parquet" and suffix not in JSONL_SUFFIXES:
            raise ConfigError(f"{key}: {path!r} is neither JSON lines (.json, .jsonl, optionally .gz) nor parquet")
        return ("parquet" if suffix == ".parquet" else "jsonl"), path, key
    if not os.path.isdir(expanded):
        raise ConfigError(f"{key}: no such file or folder {path!r}")
    split = SPLITS[name]
    root = os.path.join(expanded, "en") if os.path.isdir(os.path.join(expanded, "en")) else expanded
    for pattern in (os.path.join(root, f"c4-{split}.*"), os.path.join(root, "**", f"c4-{split}.*")):
        files = [f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f)]
        if files:
            return _kind_of(files, key, path), pattern, key
    files = [f for f in glob.glob(os.path.join(expanded, "**", "*"), recursive=True)
             if os.path.isfile(f) and (data_suffix(f) in JSONL_SUFFIXES or data_suffix(f) == ".parquet")]
    if not files:
        raise ConfigError(f"{key}: folder {path!r} holds no c4-{split}.* files and no JSON-lines or parquet files")
    return _kind_of(files, key, path), path, key
