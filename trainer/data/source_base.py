"""What every source kind shares: the Source protocol, a parsed spec and the reading options, document status
codes, and the file helpers. The kinds are in sources.py (text, columns, prepared tokens, Hugging Face) and
readers.py (token files of other trainers); sources.py holds the table of kinds (``KINDS``).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from trainer.data.c4 import data_suffix
from trainer.errors import ConfigError

# Document status codes (also stored, in the low two bits, in a prepared dataset's status array).
OK, EMPTY, MALFORMED, UNDECODABLE = 0, 1, 2, 3
# decode()'s object with MALFORMED when a JSON line lacks data.text_field (counted as its own kind in training).
MISSING_FIELD = "missing field"
# A line-based block stops after this many bytes even if it holds fewer than shuffle_window documents.
BLOCK_BYTES = 8 << 20
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"  # the first bytes of a Megatron .idx


@dataclass(frozen=True)
class SourceSpec:
    """One parsed source: kind, location, and the config key it came from (for error messages)."""

    kind: str
    path: str
    key: str
    label: str
    hf_config: str | None = None
    split: str | None = None


@dataclass(frozen=True)
class SourceOptions:
    """Settings a source needs to read documents (all picklable, shipped to loader workers)."""

    text_field: str = "text"
    text_document: str = "line"
    seed: int = 0
    shuffle: bool = True
    shuffle_window: int = 1024
    tokens_field: str = "tokens"  # the token column of arrow files (pre-tokenized documents)
    numpy_dtype: str = "auto"  # the token type of headerless numpy files
    eos_id: int | None = None  # delimits the documents of numpy files without a .csv.gz sidecar
    vocab_size: int = 0  # the model's vocabulary: a stored token id at or above it is a data error (0: unchecked)
    tokenizer_vocab: int = 0  # the tokenizer's vocabulary: a token file's type must hold it


def expand_files(spec: SourceSpec, extensions: tuple[str, ...]) -> list[str]:
    """Files of a path, folder (searched recursively for `extensions`) or glob; sorted; never empty. Half of a
    Megatron .bin/.idx pair is refused: another kind would read it without its document boundaries."""
    path = os.path.expanduser(spec.path)
    if any(ch in path for ch in "*?["):
        files = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not files:
            raise ConfigError(f"{spec.key}: no files match {spec.path!r}")
    elif os.path.isdir(path):
        files = sorted(
            str(p) for p in Path(path).rglob("*") if p.is_file() and data_suffix(str(p)) in extensions
        )
        if not files:
            raise ConfigError(f"{spec.key}: folder {spec.path!r} holds no {'/'.join(extensions)} files")
    elif os.path.isfile(path):
        files = [path]
    else:
        hint = (f"; it is the prefix of a Megatron .idx/.bin pair: write megatron:{spec.path}"
                if megatron_pair(path + ".idx") else "")
        raise ConfigError(f"{spec.key}: no such file {spec.path!r}{hint}")
    refuse_megatron_halves(spec, files)
    return files


def refuse_megatron_halves(spec: SourceSpec, files: list[str]) -> None:
    """A ConfigError naming ``megatron:`` when one of a non-megatron source's files is half of a Megatron pair."""
    for f in files:
        prefix = megatron_pair(f)
        if prefix is not None:
            # (the user's own spelling where the spec is that one file)
            shown = spec.path[:-4] if f == os.path.expanduser(spec.path) else prefix
            raise ConfigError(f"{spec.key}: {f} is half of a Megatron .bin/.idx pair, which the {spec.kind} kind "
                              f"would read without the .idx's document boundaries; write megatron:{shown}")


def megatron_pair(path: str) -> str | None:
    """The prefix of the Megatron dataset a ``.bin`` or ``.idx`` file belongs to (its ``.idx`` starts with
    Megatron's magic and its ``.bin`` is there), else None."""
    stem, suffix = path[:-4], path[-4:]
    if suffix not in (".bin", ".idx") or not os.path.isfile(stem + ".bin"):
        return None
    try:
        with open(stem + ".idx", "rb") as f:
            return stem if f.read(len(MEGATRON_MAGIC)) == MEGATRON_MAGIC else None
    except OSError:
        return None


def range_part(size: int, shard: int, num_shards: int) -> tuple[int, int]:
    """Shard `shard`'s contiguous slice [lo, hi) of a unit with coordinates 0..size."""
    return size * shard // num_shards, size * (shard + 1) // num_shards


class Source:
    """Base class. Subclasses set ``kind``, ``units`` (names), ``sizes`` and implement iter_docs/decode; a new
    kind is its class and its entry in sources.KINDS.

    What a kind can do is declared by the class attributes below, never probed: the reader reads a ``verbatim``
    source's blocks as ranges of document numbers and asks it for ``check_block`` and ``layout``."""

    kind = "?"
    extensions: tuple[str, ...] = ()  # file suffixes that make a bare path (or a folder's files) this kind
    coords_are_bytes = False  # blocks are also limited by BLOCK_BYTES when coordinates are byte offsets
    partition = "range"  # "range": each shard gets a coordinate slice of every unit; "modulo": unit u -> shard u % N
    # Documents are stored token arrays, trained as stored (no separator added), whose coordinates are their
    # numbers in the file (document d of a unit is coordinate d, the next one d + 1): see readers.py.
    verbatim = False

    def __init__(self, spec: SourceSpec, index: int, opts: SourceOptions):
        self.spec, self.index, self.opts = spec, index, opts
        self.units: list[str] = []
        self.sizes: list[int] = []

    @property
    def label(self) -> str:
        return self.spec.label

    def part(self, unit: int, shard: int, num_shards: int) -> tuple[int, int]:
        if self.partition == "modulo":
            return (0, self.sizes[unit]) if unit % num_shards == shard else (0, 0)
        return range_part(self.sizes[unit], shard, num_shards)

    def iter_docs(self, unit: int, lo: int, hi: int, start: int, *, shard: int, num_shards: int,
                  epoch: int) -> Iterator[tuple[int, int, Any]]:
        """(coordinate, next coordinate, payload) of the documents starting in [start, hi); `start == lo`
        means "from the beginning of the part" (which may need aligning to a document start)."""
        raise NotImplementedError

    def load(self, unit: int, coord: int, next_coord: int, payload: Any) -> Any:
        """The payload of a document whose payload iter_docs left lazy (None)."""
        return payload

    def shard_is_empty(self, shard: int, num_shards: int) -> bool | None:
        """Whether no document starts in the shard's parts (None: unknown without reading)."""
        return all(lo >= hi for lo, hi in (self.part(u, shard, num_shards) for u in range(len(self.units))))

    def check_cost(self) -> float:
        """Relative cost of shard_is_empty (checked at start-up only when small)."""
        return len(self.units)

    def decode(self, payload: Any) -> tuple[int, Any]:
        """(status, text) or (status, token array); status is OK, EMPTY, MALFORMED or UNDECODABLE."""
        raise NotImplementedError

    def token_dtype(self):
        """The numpy type every document is stored in, for sources of stored token arrays; None otherwise."""
        return None

    def uid(self, unit: int, coord: int, shard: int) -> int:
        """A document id, unique in the source mixture: source index, unit and start coordinate."""
        return (self.index << 56) | (unit << 40) | (coord & ((1 << 40) - 1))

    def fingerprint(self) -> dict:
        """What must not change between a checkpoint and its resumption."""
        return {"kind": self.kind, "label": self.label, "units": len(self.units), "size": int(sum(self.sizes))}

    # Verbatim sources only (the reader asks nothing of the others).

    def check_block(self, unit: int, first: int, last: int) -> bool:
        """True when every token of documents first..last is inside the model's vocabulary, checked at once; the
        reader then loads them with ``load_unchecked``. False leaves the check to ``load``, document by document."""
        return False

    def load_unchecked(self, unit: int, coord: int) -> Any:
        """A document of a block that check_block passed."""
        raise NotImplementedError

    def layout(self, unit: int, lo: int, hi: int) -> tuple[Any, Any, Any] | None:
        """Where documents lo..hi-1 are, at once: (base array, starts, lengths), document d being
        ``base[start:start + length]``, or (list of the documents' arrays, None, lengths); None when one of
        them is null or the layout is not known (the reader then takes documents one by one)."""
        return None


def text_status(text: Any) -> tuple[int, Any]:
    """(status, text) of a text payload (str, or bytes that must be UTF-8)."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            return UNDECODABLE, None
    if not isinstance(text, str):
        return MALFORMED, None
    if not text.strip():
        return EMPTY, None
    return OK, text


def import_pyarrow(spec: SourceSpec):
    """pyarrow (with its IPC module), or a ConfigError naming the source that needs it."""
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
    except ImportError:
        raise ConfigError(f"{spec.key}: reading {spec.kind} files needs pyarrow: pip install pyarrow") from None
    return pyarrow
