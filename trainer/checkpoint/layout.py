"""The on-disk layout of checkpoints: folder names, the commit marker, validation and the one scanner.

Under ``<job.dump_folder>/<checkpoint.folder>/``::

    step-40/                  a committed checkpoint: complete, the only kind that is ever loaded
        .metadata             DCP metadata (global shapes, which file holds which shard)
        __0_0.distcp ...      DCP data, one file per writing rank
        dataloader.json       the merged (layout-free) data-loader state, written by rank 0
        checkpoint.json       the commit marker, written last: step, tokens, kind, files and their sizes
    step-60.tmp/              a save in progress, or one interrupted by a crash (ignored, removed on start)
    step-60.replaced/         the previous step-60 while a save of the same step replaces it
    final-step-80/            the final model-only save (checkpoint.last_save_model_only), next to the full
                              step-80 of the same step; a longer run later adds its own final-step-N
    replica_<id>/step-40/     a fault-tolerant job's replica group's own data-loader state (kind "data": no
                              DCP files); see trainer/checkpoint/replicas.py
    moved-aside/              folders that were in the way of a save but are not ours (no or partial commit
                              marker, or files the marker does not list): moved here, never deleted

The marker records every file with its size and checksum (see :mod:`trainer.checkpoint.integrity`).

A folder is complete only when its marker is readable and every file it lists is present with its
recorded size (checksums are verified when a checkpoint is loaded: by a run, by the tools through
:func:`trainer.checkpoint.offline.find_checkpoint`, by ``trainer checkpoint list`` for the checkpoint it
says a run resumes from, and by ``trainer checkpoint verify``).
Every place that lists or validates checkpoint folders (the manager, the command line,
the offline readers of ``trainer export/eval/generate``, the stability guard) goes through
:func:`scan_folder` / :func:`inspect_checkpoint`, so there is one naming rule and one notion of
"complete". Nothing here needs a process group.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from trainer.checkpoint.integrity import file_checksum, file_entry, verify_files
from trainer.errors import CheckpointError

logger = logging.getLogger("trainer")

FORMAT_VERSION = 1
MARKER = "checkpoint.json"
DATALOADER_JSON = "dataloader.json"
DATALOADER_PT = "dataloader.pt"
DCP_METADATA = ".metadata"
TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".replaced"
MOVED_ASIDE = "moved-aside"
FINAL_PREFIX = "final-"
DEFAULT_FOLDER = "checkpoint"  # checkpoint.folder's default, relative to the dump folder
RUN_CONFIG = "config.toml"  # the resolved config a run writes into its dump folder
DATA_ONLY = "data"  # the marker's kind of a replica group's data-only checkpoint (see checkpoint/replicas.py)
# The kinds a run resumes from (a folder holds one or the other): what keep_latest_k counts.
RESUMABLE_KINDS = ("full", DATA_ONLY)

_NAME_RE = re.compile(r"^(?:final-)?step-(\d+)(\.tmp|\.replaced)?$")


def step_dirname(step: int, suffix: str = "", final: bool = False) -> str:
    """The folder name of ``step``: ``step-N`` when committed, ``step-N.tmp`` while being written;
    ``final-step-N`` for a final model-only save."""
    return f"{FINAL_PREFIX if final else ''}step-{step}{suffix}"


def is_final(name: str) -> bool:
    """Whether ``name`` is a final model-only save (``final-step-N``)."""
    return name.startswith(FINAL_PREFIX) and parse_dirname(name) is not None


def step_list(infos) -> str:
    """The steps of ``infos`` for a message, each once, in order ("5, 10"): a step-N and its final-step-N
    are one step."""
    return ", ".join(str(step) for step in sorted({c.step for c in infos}))


def parse_dirname(name: str) -> tuple[int, str] | None:
    """(step, suffix) of a checkpoint folder name (suffix "" for a committed name), None for other names."""
    m = _NAME_RE.match(name)
    return (int(m.group(1)), m.group(2) or "") if m else None


@dataclass
class CheckpointInfo:
    """One checkpoint folder as found on disk (nothing loaded)."""

    path: Path
    step: int
    status: str  # "complete", "incomplete" (an interrupted save), "corrupt"
    reason: str = ""
    marker: dict = field(default_factory=dict)
    # No commit marker but DCP metadata: a finished plain ``dcp.save`` by another tool (DCP writes its
    # metadata last). Never resumed from; the offline tools and initial_load_path accept it.
    unmarked: bool = False

    @property
    def kind(self) -> str:
        return self.marker.get("kind", "?")

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    @property
    def leftover(self) -> bool:
        """A save in progress or its remains (``step-N.tmp``, ``step-N.replaced``), never a checkpoint."""
        return self.path.name.endswith((TMP_SUFFIX, OLD_SUFFIX))

    @property
    def final(self) -> bool:
        """A final model-only save (``final-step-N``): never resumed from exactly, never deleted by retention."""
        return is_final(self.path.name)

    @property
    def readable(self) -> bool:
        """DCP can load it: a committed checkpoint, or another tool's finished DCP save."""
        return self.complete or self.unmarked


def validate_checkpoint(path: Path) -> tuple[str, str, dict]:
    """(status, reason, marker) of a committed ``step-N`` folder: complete only when the commit marker is
    readable and every file it lists is present with its recorded size."""
    path = Path(path)
    marker_path = path / MARKER
    if not marker_path.is_file():
        what = "DCP metadata present" if (path / DCP_METADATA).exists() else "no DCP metadata"
        return "incomplete", f"no commit marker {MARKER} ({what}): not written by a finished save", {}
    try:
        marker = json.loads(marker_path.read_text())
    except (OSError, ValueError) as e:
        return "corrupt", f"commit marker unreadable: {e}", {}
    if not isinstance(marker, dict) or marker.get("format") != FORMAT_VERSION:
        found = marker.get("format") if isinstance(marker, dict) else marker
        return "corrupt", f"commit marker has an unknown format ({found!r})", {}
    parsed = parse_dirname(path.name)
    if parsed and parsed[0] != marker.get("step"):
        return "corrupt", f"commit marker says step {marker.get('step')}, the folder is {path.name}", marker
    files = marker.get("files") or {}
    if DCP_METADATA not in files and marker.get("kind") != DATA_ONLY:
        return "corrupt", "commit marker lists no DCP metadata", marker
    for name, entry in files.items():
        size, _ = file_entry(entry)
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return "corrupt", f"{name} is missing", marker
        if actual != size:
            return "corrupt", f"{name} has {actual} bytes, {size} were written (truncated or overwritten)", marker
    return "complete", "", marker


def inspect_checkpoint(path: Path) -> CheckpointInfo:
    """One checkpoint folder, validated. Its name need not be ``step-N`` (a folder given on the command
    line or as initial_load_path); the step is then the marker's (0 without one)."""
    path = Path(path)
    parsed = parse_dirname(path.name)
    if parsed and parsed[1] == TMP_SUFFIX:
        return CheckpointInfo(path, parsed[0], "incomplete", "interrupted save (never committed)")
    if parsed and parsed[1] == OLD_SUFFIX:
        return CheckpointInfo(path, parsed[0], "incomplete", "left over from replacing a checkpoint")
    status, reason, marker = validate_checkpoint(path)
    step = parsed[0] if parsed else marker.get("step", 0)
    step = step if isinstance(step, int) else 0
    unmarked = not (path / MARKER).exists() and (path / DCP_METADATA).is_file()
    return CheckpointInfo(path, step, status, reason, marker, unmarked)


def scan_folder(folder: Path) -> list[CheckpointInfo]:
    """Every ``step-N``-like entry of a checkpoint folder, oldest first (committed ones validated)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    out = [inspect_checkpoint(entry) for entry in folder.iterdir()
           if parse_dirname(entry.name) is not None and entry.is_dir()]
    out.sort(key=lambda c: (c.step, c.final, c.path.name))  # a final save after the full one of its step
    return out


def foreign_files(path: Path, marker: dict) -> list[str]:
    """Files in a committed checkpoint folder that its marker does not list (put there by someone else)."""
    listed = set(marker.get("files") or {}) | {MARKER}
    try:
        return sorted(p.name for p in Path(path).iterdir() if p.name not in listed)
    except OSError:
        return []


def move_aside(path: Path, reason: str) -> Path:
    """Move a folder that is in the way but not ours into ``<its parent>/moved-aside/`` (never deleted);
    returns where it went."""
    path = Path(path)
    dest_dir = path.parent / MOVED_ASIDE
    dest_dir.mkdir(exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    dest = dest_dir / f"{path.name}.{stamp}"
    n = 1
    while dest.exists():
        dest, n = dest_dir / f"{path.name}.{stamp}.{n}", n + 1
    os.rename(path, dest)
    fsync_dir(path.parent)
    logger.warning("%s is in the way of a save (%s): moved aside to %s, not deleted", path, reason, dest)
    return dest


def configured_folder(dump_folder: Path) -> str:
    """checkpoint.folder of the run whose dump folder this is (from its config.toml), else the default."""
    cfg = Path(dump_folder) / RUN_CONFIG
    if not cfg.is_file():
        return DEFAULT_FOLDER
    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        name = tomllib.loads(cfg.read_text()).get("checkpoint", {}).get("folder", DEFAULT_FOLDER)
    except (OSError, ValueError):  # an unreadable config: the default name
        return DEFAULT_FOLDER
    return name if isinstance(name, str) and name else DEFAULT_FOLDER


def checkpoint_folders(path: Path) -> list[Path]:
    """Where the checkpoints of ``path`` may be, in the order to look: ``path`` itself (a checkpoint
    folder), the folder its config.toml names (a dump folder), the default folder name."""
    path = Path(path)
    return list(dict.fromkeys([path, path / configured_folder(path), path / DEFAULT_FOLDER]))


def locate_folder(path: Path) -> Path:
    """The checkpoint folder of ``path`` (a checkpoint folder or a dump folder): the first of
    :func:`checkpoint_folders` holding step folders, else the one its run would write to."""
    path = Path(path)
    return next((f for f in checkpoint_folders(path) if scan_folder(f)), path / configured_folder(path))


# --------------------------------------------------------------------------------------------------
# Sizes and atomic writes
# --------------------------------------------------------------------------------------------------


def tree_size(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed; vanished files skipped)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def human_bytes(n: float) -> str:
    """``n`` bytes as e.g. ``12.3 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fsync_dir(path: Path) -> None:
    """Make a rename or new file in ``path`` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` so that a crash leaves either the old file or the whole new one, never a part (and a
    write that fails in this process leaves no ``.part`` file either)."""
    tmp = path.with_name(path.name + ".part")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def commit(tmp: Path, final: Path, marker: dict, sums: dict | None = None, algo: str = "none") -> None:
    """Turn a finished save in ``tmp`` into the committed checkpoint ``final``: record every file with its
    size and checksum in the marker (written last), then rename. ``sums`` holds the checksums computed
    while the ranks wrote; files not in it (rank 0's small files) are hashed here. A checkpoint of the same
    step already there is replaced (moved aside first, so that one of them is always complete); a folder
    there that is not ours, ours but damaged (it may still hold intact weights), or an earlier final
    export is moved into ``moved-aside/`` instead of being deleted."""
    sums = sums or {}
    files: dict[str, dict] = {}
    for p in sorted(tmp.iterdir()):
        if not p.is_file() or p.name == MARKER:
            continue
        size = p.stat().st_size
        entry = sums.get(p.name)
        if algo == "none":
            files[p.name] = {"size": size}
            continue
        if entry is None:
            size, digest = file_checksum(p, algo)
            entry = {"size": size, "checksum": digest}
        elif entry["size"] != size:
            raise CheckpointError(f"{p} has {size} bytes on disk but {entry['size']} were written")
        files[p.name] = entry
    if DCP_METADATA not in files and marker.get("kind") != DATA_ONLY:
        raise CheckpointError(f"{tmp} has no DCP metadata after the save")
    marker["checksum"] = algo
    marker["files"] = files
    marker["bytes"] = sum(f["size"] for f in files.values())
    marker["saved_at"] = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    write_file_atomic(tmp / MARKER, json.dumps(marker, indent=1).encode())
    fsync_dir(tmp)
    old = None
    if final.exists():  # the same step saved again (e.g. a resumed run passing it once more)
        status, reason, old_marker = validate_checkpoint(final)
        extra = foreign_files(final, old_marker) if old_marker and final.is_dir() else []
        if status == "complete" and not extra:
            reason = verify_files(final, old_marker)  # damaged content: kept as evidence, not deleted
            if reason is None and is_final(final.name):
                reason = "an earlier run's final export"
        if status != "complete" or extra or reason:
            move_aside(final, reason or f"files its commit marker does not list: {', '.join(extra[:5])}")
        else:
            old = final.with_name(final.name + OLD_SUFFIX)
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
