"""Checkpoint checksums: computed while DCP writes each file, recorded in the commit marker, verified on load.

Every ``.distcp`` file is hashed as its bytes go to disk (a hashing stream under DCP's writer, so nothing is
read back); the rank that wrote a file reports its size and checksum, rank 0 adds the small files it
wrote itself (``.metadata``, ``dataloader.json``) and records them all in ``checkpoint.json``::

    "checksum": "xxh3_128",
    "files": {"__0_0.distcp": {"size": 1234, "checksum": "9f..."}, ".metadata": {...}, ...}

Loading re-hashes the files (each rank a share of them) before DCP reads anything, so a flipped bit is
refused as corruption and the previous checkpoint is used instead. The offline readers (``trainer
export/generate/eval``, through ``trainer.checkpoint.offline.find_checkpoint``), ``trainer checkpoint
list`` (for the checkpoint it says a run resumes from) and ``trainer checkpoint verify`` do the same with
:func:`verify_files`. Markers written before checksums existed (``"files": {name: size}``) are checked by size only.

Algorithms: ``xxh3_128`` (the ``xxhash`` package; several GB/s per core), ``sha256`` (standard library,
cryptographic, slower), ``none`` (sizes only).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import threading
from pathlib import Path
from typing import Any

CHUNK = 8 << 20  # bytes read at a time when hashing a file

try:
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency, but keep working without it
    _xxhash = None

ALGORITHMS = ("xxh3_128", "sha256", "none")
DEFAULT_ALGORITHM = "xxh3_128" if _xxhash is not None else "sha256"


def available(algo: str) -> bool:
    return algo in ("sha256", "none") or (algo == "xxh3_128" and _xxhash is not None)


def new_hasher(algo: str):
    """A hashlib-like object (``update``, ``hexdigest``) for ``algo``."""
    if algo == "xxh3_128":
        if _xxhash is None:
            raise RuntimeError("checkpoint.checksum xxh3_128 needs the xxhash package (pip install xxhash)")
        return _xxhash.xxh3_128()
    if algo == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {algo!r}; one of {', '.join(ALGORITHMS)}")


def file_checksum(path: Path, algo: str) -> tuple[int, str]:
    """(size, hex digest) of a file, read in chunks."""
    h = new_hasher(algo)
    size = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def file_entry(value: Any) -> tuple[int | None, str | None]:
    """(size, checksum) of one ``files`` entry of a marker: ``{"size", "checksum"}`` or an older bare size."""
    if isinstance(value, dict):
        size, checksum = value.get("size"), value.get("checksum")
        return (size if isinstance(size, int) else None), (checksum if isinstance(checksum, str) else None)
    return (value if isinstance(value, int) else None), None


def verify_files(path: Path, marker: dict, names: list[str] | None = None) -> str | None:
    """Re-hash the files of the checkpoint ``path`` (all, or ``names``) against its marker. None when they
    match, else the reason naming the first bad file."""
    algo = marker.get("checksum", "none")
    files = marker.get("files") or {}
    for name in (sorted(files) if names is None else names):
        size, checksum = file_entry(files.get(name))
        p = Path(path) / name
        try:
            if checksum is None or algo == "none":
                actual = p.stat().st_size
                if size is not None and actual != size:
                    return f"{name} has {actual} bytes, {size} were written"
                continue
            actual, digest = file_checksum(p, algo)
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as e:
            return f"{name} is unreadable: {e}"
        except (RuntimeError, ValueError) as e:  # an algorithm this machine cannot compute
            return f"{name}: cannot verify ({e})"
        if size is not None and actual != size:
            return f"{name} has {actual} bytes, {size} were written"
        if digest != checksum:
            return f"{name} fails its {algo} checksum (recorded {checksum}, now {digest}): its content changed"
    return None


def share(names: list[str], rank: int, world: int) -> list[str]:
    """This rank's share of the files to verify (the biggest work split evenly over ranks)."""
    return [n for i, n in enumerate(sorted(names)) if i % world == rank]


# --------------------------------------------------------------------------------------------------
# Hashing while DCP writes
# --------------------------------------------------------------------------------------------------


class _HashingStream(io.RawIOBase):
    """A write-only stream that hashes every byte on its way to ``raw``."""

    def __init__(self, raw, hasher):
        self.raw = raw
        self.hasher = hasher
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = self.raw.write(b)
        view = memoryview(b).cast("B")
        self.hasher.update(view[:n] if n is not None else view)
        self.size += n if n is not None else len(view)
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:  # DCP closes the stream; the file itself is closed by the context manager
        with contextlib.suppress(Exception):
            self.raw.flush()
        super().close()


def hashing_filesystem(fs, algo: str):
    """Wrap DCP's ``FileSystem`` so that every ``.distcp`` file it creates for writing is hashed as written.
    Returns (the wrapped filesystem, a dict that fills with ``{name: {"size", "checksum"}}``)."""
    sums: dict[str, dict] = {}
    lock = threading.Lock()
    create = fs.create_stream

    @contextlib.contextmanager
    def create_stream(path, mode):
        if "w" not in mode or not str(path).endswith(".distcp"):
            with create(path, mode) as stream:
                yield stream
            return
        with create(path, mode) as raw:
            stream = _HashingStream(raw, new_hasher(algo))
            yield stream
            with lock:
                sums[Path(path).name] = {"size": stream.size, "checksum": stream.hasher.hexdigest()}

    fs.create_stream = create_stream
    return fs, sums
