"""``trainer checkpoint list|inspect|verify PATH`` (also ``python -m trainer.checkpoint ...``): what a dump
folder's checkpoints are and hold, from their commit markers and DCP metadata, without a process group;
``verify`` re-hashes every file against the checksums in its commit marker (exit 3 on corruption)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from trainer.checkpoint.agree import ERRORS, format_exception
from trainer.checkpoint.integrity import verify_files
from trainer.checkpoint.layout import (
    DCP_METADATA,
    MARKER,
    human_bytes,
    locate_folder,
    parse_dirname,
    scan_folder,
    tree_size,
    validate_checkpoint,
)
from trainer.errors import CheckpointError

_MARKER_FIELDS = ("step", "kind", "dtype", "tokens_seen", "skipped_steps", "lr", "layout", "world_size", "saved_at",
                  "save_seconds", "torch", "dataloader")


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return CheckpointError.exit_code


def _rows(folder: Path, verify: bool = True) -> list[dict[str, Any]]:
    """One row per checkpoint folder. With ``verify`` the checkpoint a run would resume from is re-hashed
    (as the run does before loading); one that fails is shown as corrupt and the next one is checked, so
    the resume claim is true. Only the checkpoints up to the first intact one are read."""
    rows, markers = [], {}
    for c in scan_folder(folder):
        m = c.marker
        markers[c.path.name] = m
        rows.append({"name": c.path.name, "step": c.step, "status": c.status, "kind": m.get("kind", "-"),
                     "tokens_seen": m.get("tokens_seen"), "bytes": m.get("bytes") if c.complete else tree_size(c.path),
                     "saved_at": m.get("saved_at", "-"), "layout": m.get("layout", "-"), "reason": c.reason,
                     "path": str(c.path)})
    while verify:
        claimed = _resume_row(rows)
        if claimed is None:
            break
        problem = verify_files(Path(claimed["path"]), markers[claimed["name"]])
        if problem is None:
            claimed["verified"] = True
            break
        claimed["status"], claimed["reason"] = "corrupt", problem
    return rows


def _resume_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row of the checkpoint a run with this folder resumes from (by commit markers and sizes, the
    run's own order: the newest complete one, or the newest full one after a newer model-only export)."""
    latest = [r for r in rows if r["status"] == "complete"]
    full = [r for r in latest if r["kind"] == "full"]
    return full[-1] if full else (latest[-1] if latest else None)


def _print_rows(folder: Path, rows: list[dict[str, Any]], verified: bool = True) -> None:
    print(f"checkpoints in {folder}:")
    print(f"{'step':>8}  {'status':<10}  {'kind':<10}  {'tokens':>14}  {'size':>10}  saved at")
    for r in rows:
        tokens = f"{r['tokens_seen']:,}" if isinstance(r["tokens_seen"], int) else "-"
        line = (f"{r['step']:>8}  {r['status']:<10}  {r['kind']:<10}  {tokens:>14}  {human_bytes(r['bytes']):>10}  "
                f"{r['saved_at']}")
        if r["reason"]:
            line += f"  ({r['name']}: {r['reason']})"
        print(line)
    latest = [r for r in rows if r["status"] == "complete"]
    claimed = _resume_row(rows)
    if not latest and any(not r["name"].endswith((".tmp", ".replaced")) for r in rows):
        print("no complete checkpoint: a run stops (exit 3) unless checkpoint.start_fresh_if_unloadable = true")
    elif not latest:
        print("no complete checkpoint: a run would start from scratch")
    elif not verified:  # checksums not read: the claim rests on the markers and sizes only
        print(f"newest committed checkpoint: step {claimed['step']} (checksums not read; "
              f"`trainer checkpoint verify` checks it)")
    elif claimed["step"] == latest[-1]["step"] or any(
            r["kind"] == "full" and r["step"] == latest[-1]["step"] for r in rows):
        # (the second: the full checkpoint next to the newest export failed its checksums; the run then
        # falls back to the previous full one whatever training.steps says)
        print(f"a run with this dump folder resumes from step {claimed['step']} (checksums verified)")
    else:
        print(f"step {latest[-1]['step']} holds only weights ({latest[-1]['kind']}): a run with this dump folder "
              f"and more training.steps resumes from step {claimed['step']}, the newest with optimizer state "
              "(checksums verified)")


def _list(args) -> int:
    path = Path(args.path)
    if not path.is_dir():
        return _error(f"no such folder: {path}")
    folder = locate_folder(path)
    rows = _rows(folder, verify=not args.no_verify)
    if args.json:
        print(json.dumps({"folder": str(folder), "checkpoints": rows}, indent=1))
    elif not rows:
        print(f"no checkpoints in {folder}")
    else:
        _print_rows(folder, rows, verified=not args.no_verify)
    return 0


def _entries(path: Path) -> dict[str, Any]:
    """Every DCP entry of a checkpoint: shape and dtype of tensors, ``object`` for the rest."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries: dict[str, Any] = {}
    for key, value in FileSystemReader(str(path)).read_metadata().state_dict_metadata.items():
        if isinstance(value, TensorStorageMetadata):
            entries[key] = {"shape": list(value.size), "dtype": str(value.properties.dtype).replace("torch.", "")}
        else:
            entries[key] = {"object": True}
    return entries


def _groups(entries: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Entry, tensor and element counts per top-level entry (model, optimizer, ...)."""
    groups: dict[str, dict[str, int]] = {}
    for key, v in entries.items():
        g = groups.setdefault(key.split(".", 1)[0], {"entries": 0, "tensors": 0, "elements": 0})
        g["entries"] += 1
        if "shape" in v:
            g["tensors"] += 1
            g["elements"] += math.prod(v["shape"])
    return groups


def _describe(path: Path, keys: bool) -> dict[str, Any]:
    """What ``inspect`` reports of one checkpoint folder."""
    status, reason, marker = validate_checkpoint(path)
    out: dict[str, Any] = {"path": str(path), "status": status, "reason": reason, "marker": marker}
    entries: dict[str, Any] = {}
    try:
        entries = _entries(path)
    except ERRORS as e:
        out["metadata_error"] = format_exception(e)
        if status == "complete":
            out["status"] = "corrupt"
            out["reason"] = f"DCP metadata unreadable: {out['metadata_error']}"
    out["groups"] = _groups(entries)
    if keys:
        out["entries"] = entries
    return out


def _print_description(out: dict[str, Any]) -> None:
    marker = out["marker"]
    print(f"{out['path']}: {out['status'].upper()}" + (f" ({out['reason']})" if out["reason"] else ""))
    for k in _MARKER_FIELDS:
        if k in marker:
            print(f"  {k:<14} {marker[k]}")
    if "bytes" in marker:
        print(f"  {'size':<14} {human_bytes(marker['bytes'])} in {len(marker.get('files', {}))} files")
    if "metadata_error" in out:
        print(f"  DCP metadata unreadable: {out['metadata_error']}")
    for name, g in out["groups"].items():
        extra = f", {g['elements']:,} elements" if g["tensors"] else ""
        print(f"  [{name}] {g['entries']} entries, {g['tensors']} tensors{extra}")
    for key, v in out.get("entries", {}).items():
        print(f"    {key}  " + (f"{v['dtype']} {v['shape']}" if "shape" in v else "(object)"))


def _inspect(args) -> int:
    path = Path(args.path)
    if not path.is_dir():
        return _error(f"no such folder: {path}")
    if parse_dirname(path.name) is None and not (path / MARKER).exists() and not (path / DCP_METADATA).exists():
        infos = [c for c in scan_folder(locate_folder(path)) if c.complete]
        if not infos:
            return _error(f"no complete checkpoint under {path}")
        path = infos[-1].path
    out = _describe(path, args.keys)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        _print_description(out)
    return 0 if out["status"] == "complete" else CheckpointError.exit_code


def _verify(args) -> int:
    """Verify one checkpoint (a step folder) or every checkpoint of a dump/checkpoint folder."""
    path = Path(args.path)
    if not path.is_dir():
        return _error(f"no such folder: {path}")
    if parse_dirname(path.name) is not None or (path / MARKER).exists() or (path / DCP_METADATA).exists():
        targets = [path]
    else:
        targets = [c.path for c in scan_folder(locate_folder(path)) if not c.leftover]
        if not targets:
            return _error(f"no checkpoint under {path}")
    bad = 0
    for target in targets:
        status, reason, marker = validate_checkpoint(target)
        if status == "complete":
            algo = marker.get("checksum", "none")
            problem = verify_files(target, marker)
            if problem is None:
                files = len(marker.get("files") or {})
                how = f"{algo} checksums match" if algo != "none" else "sizes match (no checksums recorded)"
                print(f"ok       {target}: {files} files, {how}")
                continue
            status, reason = "corrupt", problem
        bad += 1
        print(f"{status.upper():<8} {target}: {reason}")
    if bad:
        print(f"{bad} of {len(targets)} checkpoint(s) failed verification", file=sys.stderr)
    return 3 if bad else 0


def main(argv: list[str] | None = None) -> int:
    """``trainer checkpoint list PATH`` / ``trainer checkpoint inspect PATH``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="trainer checkpoint", description="List, inspect and verify checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="the checkpoints of a dump folder or checkpoint folder")
    p.add_argument("path", help="a job.dump_folder or its checkpoint folder")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-verify", dest="no_verify", action="store_true",
                   help="do not re-hash the checkpoint a run would resume from (markers and sizes only)")
    p = sub.add_parser("inspect", help="one checkpoint: its marker, completeness and contents")
    p.add_argument("path", help="a step-N folder (or a dump folder: its latest complete checkpoint)")
    p.add_argument("--keys", action="store_true", help="list every entry with its shape and dtype")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("verify", help="re-hash checkpoint files against their recorded checksums (exit 3 if bad)")
    p.add_argument("path", help="a step-N folder, or a dump/checkpoint folder (every checkpoint in it)")
    args = parser.parse_args(argv)
    try:
        return {"list": _list, "inspect": _inspect, "verify": _verify}[args.command](args)
    except BrokenPipeError:  # pragma: no cover - e.g. piped into head
        return 0


if __name__ == "__main__":
    sys.exit(main())
