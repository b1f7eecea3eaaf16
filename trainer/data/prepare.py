"""``trainer data prepare``: tokenize a corpus once into memory-mappable token files, in parallel.

Output folder layout (one set of files per input file, "unit"):

    meta.json              format, dtype, tokenizer fingerprint, partition rule, units, counters
    u00000.tokens          all documents' tokens, one flat uint16 (vocab <= 65536) or uint32 stream
    u00000.index.npy       int64 [D + 1]: document d is tokens[index[d]:index[d + 1]]
    u00000.coords.npy      int64 [2, D]: start and end coordinate of document d in the input file
    u00000.status.npy      uint8 [D]: OK / EMPTY / MALFORMED / UNDECODABLE (+ stripped-separator bits)

Tokens are stored without separators (the separator policy stays a training-time setting) and with any
BOS/EOS the tokenizer added removed. Every input document keeps its entry, bad ones with no tokens and
their status, and its original coordinates: a ``tokens`` source therefore splits into shards, blocks and
shuffles exactly like the text it came from, and training on it gives the same sequences, only faster.
meta.json is written last: a folder without it is incomplete.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.source_base import EMPTY, OK, UNDECODABLE, SourceOptions, SourceSpec, range_part
from trainer.data.sources import (
    STRIPPED_LEADING, STRIPPED_TRAILING, TOKENS_FORMAT, TOKENS_META, build_source, parse_source,
)

PIECE_BYTES = 32 << 20  # line files are tokenized in pieces of about this many bytes ...
PIECE_ROWS = 100_000  # ... and row-based files in pieces of this many rows
_STATUS_NAMES = {1: "skipped_empty", 2: "skipped_malformed", 3: "skipped_undecodable"}

_worker: dict[str, Any] = {}  # per-process: the source, tokenizer and output folder of the pool


def _init_worker(source, tokenizer, tmp_dir: str) -> None:
    _worker.update(source=source, tokenizer=tokenizer, tmp_dir=tmp_dir,
                   strip=tuple(t for t in (tokenizer.bos_id, tokenizer.eos_id) if t is not None))


def _tokenize_piece(task: tuple[int, int, int, int, str]) -> dict:
    """Tokenize the documents starting in [lo, hi) of one unit; tokens go to a temporary file."""
    piece, unit, lo, hi, dtype = task
    src, tok, strip = _worker["source"], _worker["tokenizer"], _worker["strip"]
    starts, ends, status, lengths = [], [], [], []
    path = os.path.join(_worker["tmp_dir"], f"piece{piece:06d}.tokens")
    buf: list[int] = []
    with open(path, "wb") as out:
        for coord, next_coord, payload in src.iter_docs(unit, lo, hi, lo, shard=0, num_shards=1, epoch=0):
            st, obj = src.decode(src.load(unit, coord, next_coord, payload))
            ids: list[int] = []
            if st == OK:
                try:
                    ids = tok.encode(obj)
                except Exception:  # noqa: BLE001 - counted like any undecodable document
                    st = UNDECODABLE
                else:
                    a, b = 0, len(ids)
                    while a < b and ids[a] in strip:
                        a += 1
                    while b > a and ids[b - 1] in strip:
                        b -= 1
                    flags = (STRIPPED_LEADING if a else 0) | (STRIPPED_TRAILING if b < len(ids) else 0)
                    ids = ids[a:b]
                    st = (EMPTY if not ids else OK) | flags
            starts.append(coord)
            ends.append(next_coord)
            status.append(st)
            lengths.append(len(ids))
            buf.extend(ids)
            if len(buf) >= 1 << 20:
                np.asarray(buf, dtype=dtype).tofile(out)
                buf = []
        if buf:
            np.asarray(buf, dtype=dtype).tofile(out)
    return {"piece": piece, "path": path, "starts": np.asarray(starts, dtype=np.int64),
            "ends": np.asarray(ends, dtype=np.int64), "status": np.asarray(status, dtype=np.uint8),
            "lengths": np.asarray(lengths, dtype=np.int64), "work": (hi - lo) if hi - lo < (1 << 40) else len(starts)}


def prepare(source: str | SourceSpec, output: str | os.PathLike, tokenizer, *, workers: int | None = None,
            text_field: str = "text", text_document: str = "line", overwrite: bool = False,
            progress: bool = True, piece_bytes: int = PIECE_BYTES, piece_rows: int = PIECE_ROWS) -> dict:
    """Tokenize `source` (a source spec such as "jsonl:/data/*.jsonl") into the folder `output`.

    `workers` processes tokenize pieces of the input in parallel (default: all CPUs; 0 or 1: in this
    process). They start from a fresh interpreter, not as forks: the source and the tokenizer must pickle
    (the bundled tokenizers do), and a script that calls this with several workers guards its top level
    with ``if __name__ == "__main__":``, as Python's multiprocessing requires. Returns the meta.json
    contents. Raises ConfigError for a bad source or an existing output folder (unless overwrite).
    """
    from trainer.errors import ConfigError
    from trainer.data.loader import tokenizer_fingerprint

    spec = parse_source(source, key="prepare source") if isinstance(source, str) else source
    if spec.kind in ("tokens", "megatron", "numpy"):
        raise ConfigError(f"{spec.label!r} is already pre-tokenized: train on it directly")
    out = Path(output).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output {out} is a file; name a folder for the prepared tokens")
    if (out / TOKENS_META).exists() and not overwrite:
        raise ConfigError(f"{out} already holds a prepared dataset; pass --overwrite to replace it")
    if out.is_dir() and not (out / TOKENS_META).exists() and any(out.iterdir()):
        # --overwrite replaces a prepared dataset only: never a folder of other files.
        raise ConfigError(f"--output {out} holds other files (no {TOKENS_META}); name a new or empty folder")
    opts = SourceOptions(text_field=text_field, text_document=text_document, seed=0, shuffle=False, shuffle_window=1)
    src = build_source(spec, 0, opts)
    if src.verbatim:
        raise ConfigError(f"{spec.label!r} holds token columns (data.tokens_field): train on it directly")
    dtype = "uint16" if tokenizer.vocab_size <= (1 << 16) else "uint32"

    if workers is None:
        workers = os.cpu_count() or 1
    tasks = _plan_pieces(src, workers, dtype, piece_bytes, piece_rows)
    if out.exists() and overwrite:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp_dir = out / ".pieces"
    tmp_dir.mkdir(exist_ok=True)
    results = _run_pieces(src, tokenizer, tasks, tmp_dir, max(1, min(workers, len(tasks))), progress)
    stats, units = _assemble_units(src, tasks, results, out)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    meta = {
        "format": TOKENS_FORMAT, "dtype": dtype, "tokenizer": tokenizer_fingerprint(tokenizer),
        "source": spec.label, "kind": src.kind, "text_field": text_field, "text_document": text_document,
        "partition": src.partition, "coords_are_bytes": bool(src.coords_are_bytes),
        "num_tokens": stats["tokens"], "stats": stats, "units": units,
    }
    tmp_meta = out / (TOKENS_META + ".tmp")
    tmp_meta.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp_meta, out / TOKENS_META)  # written last: its presence means the folder is complete
    return meta


def _plan_pieces(src, workers: int, dtype: str, piece_bytes: int, piece_rows: int) -> list[tuple]:
    """Tasks (piece, unit, lo, hi, dtype): about 4 per worker for small inputs, at most piece_bytes /
    piece_rows each. The output does not depend on them (pieces are contiguous and concatenated in order)."""
    total = sum(src.sizes) if src.kind != "hf" else 0
    if src.coords_are_bytes:
        piece = min(piece_bytes, max(1 << 20, total // (4 * max(1, workers)) + 1))
    else:
        piece = min(piece_rows, max(1000, total // (4 * max(1, workers)) + 1))
    tasks = []
    for unit, size in enumerate(src.sizes):
        n_pieces = 1 if src.kind == "hf" or src.partition == "modulo" else max(1, -(-size // piece))
        for p in range(n_pieces):
            lo, hi = range_part(size, p, n_pieces)
            tasks.append((len(tasks), unit, lo, hi, dtype))
    return tasks


def _run_pieces(src, tokenizer, tasks: list[tuple], tmp_dir: Path, workers: int, progress: bool) -> dict[int, dict]:
    """Tokenize every piece, in this process or a pool of ``workers``; results by piece index."""
    bar = _progress(sum(t[3] - t[2] if t[3] - t[2] < (1 << 40) else 0 for t in tasks) or None, progress, src.label)
    results: dict[int, dict] = {}
    try:
        if workers == 1:
            _init_worker(src, tokenizer, str(tmp_dir))
            for task in tasks:
                r = _tokenize_piece(task)
                results[r["piece"]] = r
                bar.update(r["work"])
        else:
            pool = _pool_context().Pool(workers, initializer=_init_worker, initargs=(src, tokenizer, str(tmp_dir)))
            with pool:
                for r in pool.imap_unordered(_tokenize_piece, tasks):
                    results[r["piece"]] = r
                    bar.update(r["work"])
    finally:
        bar.close()
    return results


def _pool_context():
    """Workers start from a fresh interpreter (forkserver, else spawn), never as a fork of this process: a
    fork inherits its signal handlers (one that returns on SIGTERM, such as the trainer's preemption
    handler, kept an idle worker alive through Pool.terminate, which then waited for it forever), the
    locks its other threads held at that moment, and its other state. The source and the tokenizer are
    pickled to each worker once; the time that costs is within the noise of a tokenizing run."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


def _assemble_units(src, tasks: list[tuple], results: dict[int, dict], out: Path) -> tuple[dict, list[dict]]:
    """Concatenate each unit's pieces in order into its token file and indexes; the counts over all units."""
    stats = {"documents": 0, "tokens": 0, "skipped_empty": 0, "skipped_malformed": 0, "skipped_undecodable": 0,
             "stripped_separators": 0}
    units = []
    for unit, size in enumerate(src.sizes):
        pieces = [results[t[0]] for t in tasks if t[1] == unit]
        name = f"u{unit:05d}"
        with open(out / f"{name}.tokens", "wb") as f:
            for r in pieces:
                with open(r["path"], "rb") as piece_file:
                    shutil.copyfileobj(piece_file, f)
        lengths = np.concatenate([r["lengths"] for r in pieces])
        status = np.concatenate([r["status"] for r in pieces])
        np.save(out / f"{name}.index.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        np.save(out / f"{name}.coords.npy", np.stack([np.concatenate([r["starts"] for r in pieces]),
                                                      np.concatenate([r["ends"] for r in pieces])]))
        np.save(out / f"{name}.status.npy", status)
        base = status & 3
        stats["documents"] += int((base == OK).sum())
        stats["tokens"] += int(lengths.sum())
        for code, key in _STATUS_NAMES.items():
            stats[key] += int((base == code).sum())
        stats["stripped_separators"] += int(((status & STRIPPED_LEADING) > 0).sum() + ((status & STRIPPED_TRAILING) > 0).sum())
        units.append({"name": name, "origin": src.units[unit],
                      "size": int(size if src.kind != "hf" else len(lengths)),
                      "num_docs": int(len(lengths)), "num_tokens": int(lengths.sum())})
    return stats, units


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int | None, enabled: bool, label: str):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency of the trainer
        return _NoBar()
    return tqdm(total=total, unit="B" if total else "doc", unit_scale=True, desc=f"prepare {label}", file=sys.stderr)
