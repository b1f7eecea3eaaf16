"""Checkpoint checksums: computed while DCP writes each file, recorded in the commit marker, verified on load.

Every ``.distcp`` file is hashed as its bytes go to disk (a hashing stream under DCP's writer, so nothing is
read back); the rank that wrote a file reports its size and checksum, rank 0 adds the small files it
wrote itself (``.metadata``, ``dataloader.json``) and records them all in ``checkpoint.json``::

    "checksum": "xxh3_128",
    "files": {"__0_0.distcp": {"size": 1234, "checksum": "9f..."}, ".metadata": {...}, ...}

Loading hashes the files (each rank a share of them) from the bytes DCP reads while it loads them (a
hashing stream under DCP's reader: the parts of a file DCP does not read, such as other ranks' shards,
are read and hashed when the file is closed, and a file of the share DCP does not open is read after
the load), and checks them before anything but the tensors DCP writes in place is restored, so a flipped
bit is refused as corruption and the previous checkpoint is loaded over it instead. The offline readers (``trainer
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
import os
import re
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
        bad = check_digest(name, marker, actual, digest)
        if bad:
            return bad
    return None


_WRITER = re.compile(r"^__(\d+)_\d+\.distcp$")


def share(names: list[str], rank: int, world: int) -> list[str]:
    """This rank's share of the files to verify: every file exactly once over the ranks. A rank's data files
    (``__<k>_<i>.distcp``, written by rank k) go to rank k mod ``world``, which under an unchanged layout is
    the rank that reads them (so it verifies them from the bytes it reads); the other files round-robin."""
    mine, others = [], []
    for n in sorted(names):
        m = _WRITER.match(n)
        if m is not None:
            if int(m[1]) % world == rank:
                mine.append(n)
        else:
            others.append(n)
    return mine + [n for i, n in enumerate(others) if i % world == rank]


# --------------------------------------------------------------------------------------------------
# Hashing while DCP writes
# --------------------------------------------------------------------------------------------------


OVERLAP = 1 << 20  # writes at least this large are hashed on a helper thread while they are written


class _HashingStream(io.RawIOBase):
    """A write-only stream that hashes every byte on its way to ``raw``. A large write to a buffered file
    (which writes all of it or raises) is hashed on a helper thread while the caller's thread writes it (the
    hash and the copy into the page cache run side by side, each releasing the GIL); the write returns when
    both are done, so the bytes are hashed in order and the buffer is not reused before it is hashed."""

    def __init__(self, raw, hasher):
        self.raw = raw
        self.hasher = hasher
        self.size = 0
        self._overlap = isinstance(raw, io.BufferedIOBase)
        self._pool = None

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        if self._overlap and len(view) >= OVERLAP:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-hash")
            hashed = self._pool.submit(self.hasher.update, view)
            try:
                n = self.raw.write(view)
            finally:
                hashed.result()
            if n is not None and n != len(view):  # not what a buffered file does; the hash no longer matches
                raise OSError(f"short write: {n} of {len(view)} bytes")
        else:
            n = self.raw.write(b)
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
        self.stop_helper()
        super().close()

    def stop_helper(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


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
            try:
                yield stream
            finally:
                stream.stop_helper()
            with lock:
                sums[Path(path).name] = {"size": stream.size, "checksum": stream.hasher.hexdigest()}

    fs.create_stream = create_stream
    return fs, sums


# --------------------------------------------------------------------------------------------------
# Hashing while DCP reads
# --------------------------------------------------------------------------------------------------

GAP = 64 << 10  # bytes skipped by a reader (zip headers, padding) that are read and hashed to keep going
PENDING = 1 << 20  # bytes read ahead of the hashed prefix (zip directories) kept until the prefix reaches them


class _HashingReader(io.RawIOBase):
    """A read stream that hashes the file it reads from the beginning, in order, whatever order the reads come
    in: bytes at the hashed prefix's end extend it; a small jump ahead is bridged by reading the gap; small
    reads further ahead are kept until the prefix reaches them; everything else is read at :meth:`finish`."""

    def __init__(self, raw, hasher):
        self.raw = raw
        self.hasher = hasher
        self.pos = raw.tell()
        self.done = 0  # bytes [0, done) are hashed
        self.pending: dict[int, bytes] = {}
        self.pending_bytes = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = self.raw.seek(offset, whence)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def fileno(self) -> int:
        return self.raw.fileno()

    def readinto(self, b) -> int:
        n = self.raw.readinto(b)
        if n:
            self._seen(self.pos, memoryview(b).cast("B")[:n])
            self.pos += n
        return n

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        if data:
            self._seen(self.pos, memoryview(data))
            self.pos += len(data)
        return data

    def _pread(self, start: int, end: int) -> memoryview:
        data = os.pread(self.raw.fileno(), end - start, start)
        if len(data) != end - start:
            raise OSError(f"short read at byte {start} (the file shrank while it was read)")
        return memoryview(data)

    def _seen(self, start: int, data: memoryview) -> None:
        end = start + len(data)
        if end <= self.done:
            return
        if start > self.done:
            if start - self.done <= GAP:
                self._seen(self.done, self._pread(self.done, start))
            else:
                if len(data) <= PENDING and self.pending_bytes + len(data) <= 8 * PENDING:
                    self.pending[start] = bytes(data)
                    self.pending_bytes += len(data)
                return
        self.hasher.update(data[self.done - start:])
        self.done = end
        while self.pending:
            first = min(self.pending)
            if first > self.done:
                break
            kept = self.pending.pop(first)
            self.pending_bytes -= len(kept)
            if first + len(kept) > self.done:
                self.hasher.update(memoryview(kept)[self.done - first:])
                self.done = first + len(kept)

    def finish(self) -> tuple[int, str]:
        """(size, digest) of the whole file: what was not read yet is read now."""
        size = os.fstat(self.raw.fileno()).st_size
        while self.done < size:
            self._seen(self.done, self._pread(self.done, min(size, self.done + CHUNK)))
        return size, self.hasher.hexdigest()

    def close(self) -> None:  # the file itself is closed by the filesystem's context manager
        super().close()


def verifying_filesystem(fs, algo: str, names: set[str]):
    """Wrap DCP's reading ``FileSystem`` so that each file of ``names`` it opens is hashed from the bytes it
    reads (and the rest of the file when DCP closes it). Returns (the wrapped filesystem, a dict that
    fills with ``{name: (size, digest)}``)."""
    results: dict[str, tuple[int, str]] = {}
    create = fs.create_stream

    @contextlib.contextmanager
    def create_stream(path, mode):
        name = Path(path).name
        if "r" not in mode or name not in names or name in results:
            with create(path, mode) as stream:
                yield stream
            return
        with create(path, mode) as raw:
            stream = _HashingReader(raw, new_hasher(algo))
            yield stream
            results[name] = stream.finish()

    fs.create_stream = create_stream
    return fs, results


def check_digest(name: str, marker: dict, size: int, digest: str) -> str | None:
    """The reason ``name`` (hashed to ``size`` bytes and ``digest``) does not match ``marker``, or None."""
    expected_size, checksum = file_entry((marker.get("files") or {}).get(name))
    if expected_size is not None and size != expected_size:
        return f"{name} has {size} bytes, {expected_size} were written"
    if checksum is not None and digest != checksum:
        return (f"{name} fails its {marker.get('checksum')} checksum (recorded {checksum}, now {digest}): its "
                f"content changed")
    return None
