"""Token files written by other trainers, read as pre-tokenized documents; the Arrow kind.

* ``megatron``: Megatron-LM indexed datasets, a ``.bin`` of tokens and its ``.idx`` (MMIDIDX: magic, version 1,
  dtype code, sequence lengths, byte pointers, document indices); a document is the run of sequences between
  two document indices.
* ``numpy``: OLMo-style flat token arrays (``.npy``, raw or with an NPY header); documents are delimited by
  the EOS id, or by the ``<name>.csv.gz`` sidecar (``start,end`` token offsets per line) when there is one.
* ``arrow``: Arrow IPC files (file or stream format). A ``data.tokens_field`` column of integer lists holds
  one document per row; an integer column holds one document per record batch (fms-fsdp's layout); without
  that column, ``data.text_field`` is text as before.

Every document of these kinds is a range of one file, read through a memory map as a zero-copy slice: the
coordinate of a document is its number in its file, so the same documents in the same order give the same
shards, blocks and batches whichever of the three formats holds them. They are trained as stored
(``Source.verbatim``): no separator is added.
"""

from __future__ import annotations

import glob
import gzip
import logging
import os
import struct
from typing import Any

import numpy as np

from trainer.data.source_base import (
    EMPTY, MALFORMED, MEGATRON_MAGIC, OK, Source, SourceOptions, SourceSpec, expand_files, import_pyarrow, range_part,
    text_status,
)
from trainer.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

# Megatron's dtype codes (megatron.core.datasets.indexed_dataset.DType).
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                   8: np.uint16}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document indices
_NPY_MAGIC = b"\x93NUMPY"
_SCAN = 1 << 24  # tokens per step when scanning a file for EOS or checking pointers (bounded memory)
_WIDTH_SAMPLE = 1 << 16  # uint16 halves read to tell a raw file's token width (4 places of 32 KiB)


def check_dtype(path: str, dtype, opts: SourceOptions) -> None:
    """A token file's type must be an integer type that holds every id of the tokenizer."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu":
        raise DataError(f"{path}: stores {dtype} values, not integer token ids")
    if opts.tokenizer_vocab and np.iinfo(dtype).max < opts.tokenizer_vocab - 1:
        raise DataError(f"{path}: stores {dtype} tokens, which cannot hold the tokenizer's {opts.tokenizer_vocab} "
                        "ids; the file was written for another tokenizer (model.tokenizer_path)")


class _TokenFileSource(Source):
    """Documents that are ranges of token arrays: coordinates are document numbers in a file; ``_doc``
    returns a document's tokens (a view of the memory map); every document is checked against the vocabulary."""

    verbatim = True

    def __init__(self, spec, index, opts):
        super().__init__(spec, index, opts)
        self._open: dict[int, Any] = {}
        self.dtypes: list[np.dtype] = []  # the token type of each unit

    def token_dtype(self) -> np.dtype | None:
        """The type every document of this source is stored in (None: the units differ, or text)."""
        found = set(self.dtypes)
        return found.pop() if self.verbatim and len(found) == 1 and len(self.dtypes) == len(self.units) else None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_open"] = {}  # memory maps stay in the process that opened them
        return state

    def iter_docs(self, unit, lo, hi, start, *, shard, num_shards, epoch):
        for d in range(start, hi):
            yield d, d + 1, None

    def load(self, unit, coord, next_coord, payload):
        tokens = self._doc(unit, coord)
        if tokens is not None and len(tokens) and self.opts.vocab_size:
            top = int(tokens.max())
            low = int(tokens.min()) if tokens.dtype.kind == "i" else 0  # unsigned: one pass
            if top >= self.opts.vocab_size or low < 0:
                bad = top if top >= self.opts.vocab_size else low
                hint = " (a raw .npy of another type: set data.numpy_dtype)" if self.kind == "numpy" else ""
                raise DataError(f"{self.units[unit]}: document {coord} holds token id {bad}, outside the model's "
                                f"vocabulary of {self.opts.vocab_size}; the file was written with another tokenizer "
                                f"(model.tokenizer_path){hint} or is damaged")
        return tokens

    def decode(self, payload):
        if payload is None:
            return MALFORMED, None
        return (OK, payload) if len(payload) else (EMPTY, None)

    def check_block(self, unit: int, first: int, last: int) -> bool:
        """True when every token of documents first..last (numbers in the file) is inside the model's
        vocabulary, found with one pass over a stretch of the file that holds them all; the reader then
        loads them with ``load_unchecked``. False (a bad id somewhere, or no such stretch) leaves the check
        to ``load``, document by document, which names the document."""
        if not self.opts.vocab_size:
            return True
        span = self._span(unit, first, last + 1)
        if span is None:
            return False
        if not len(span):
            return True
        if int(span.max()) >= self.opts.vocab_size:
            return False
        return span.dtype.kind != "i" or int(span.min()) >= 0

    def load_unchecked(self, unit: int, coord: int) -> np.ndarray | None:
        """A document of a block that check_block passed."""
        return self._doc(unit, coord)

    def _span(self, unit: int, lo: int, hi: int) -> np.ndarray | None:
        """A view of the file holding the tokens of documents lo..hi-1 (and maybe others), or None."""
        return None

    def layout(self, unit: int, lo: int, hi: int) -> tuple[Any, np.ndarray, np.ndarray] | None:
        """Where documents lo..hi-1 are, at once: (base array, starts, lengths), document d being
        ``base[start:start + length]``, or (list of the documents' arrays, None, lengths); None when one of
        them is null or the layout is not known (the reader then takes documents one by one)."""
        return None

    def _doc(self, unit: int, d: int) -> np.ndarray | None:
        raise NotImplementedError

    def _cached(self, unit: int, opener):
        value = self._open.get(unit)
        if value is None:
            if len(self._open) >= 32:
                self._open.pop(next(iter(self._open)))
            value = self._open[unit] = opener(unit)
        return value


def _token_map(path: str, dtype, offset: int = 0) -> np.ndarray:
    """The tokens of a file as a plain array over a read-only memory map (slices of it copy nothing)."""
    return np.memmap(path, dtype=dtype, mode="r", offset=offset).view(np.ndarray)


# --------------------------------------------------------------------------------------------------
# Megatron .bin/.idx
# --------------------------------------------------------------------------------------------------


def megatron_prefixes(spec: SourceSpec) -> list[str]:
    """The dataset prefixes of a megatron spec: a prefix, an .idx or .bin file, a folder of pairs or a glob."""
    path = os.path.expanduser(spec.path)
    if any(ch in path for ch in "*?["):
        files = [p for p in glob.glob(path, recursive=True) if p.endswith((".idx", ".bin"))]
    elif os.path.isdir(path):
        files = [os.path.join(root, n) for root, _, names in os.walk(path) for n in names
                 if n.endswith((".idx", ".bin"))]
        if not files:
            raise ConfigError(f"{spec.key}: folder {spec.path!r} holds no Megatron .idx/.bin files")
    elif path.endswith((".idx", ".bin")):
        files = [path]
    else:
        files = [path + ".idx"]
    prefixes = sorted({f[:-4] for f in files})
    if not prefixes:
        raise ConfigError(f"{spec.key}: no files match {spec.path!r}")
    for prefix in prefixes:
        idx, bin_ = prefix + ".idx", prefix + ".bin"
        if not os.path.isfile(idx):
            if os.path.isfile(bin_):
                raise DataError(f"{bin_}: its index {os.path.basename(idx)} is missing; copy it beside the .bin")
            raise ConfigError(f"{spec.key}: no such Megatron dataset {spec.path!r} (no {idx})")
        if not os.path.isfile(bin_):
            raise DataError(f"{idx}: its token file {os.path.basename(bin_)} is missing; copy it beside the .idx")
    return prefixes


def read_megatron_index(idx: str) -> dict:
    """The header and arrays (memory-mapped) of an MMIDIDX index; damage is a DataError naming the file."""
    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(_HEADER.size)
    if len(head) < _HEADER.size or not head.startswith(MEGATRON_MAGIC):
        raise DataError(f"{idx}: not a Megatron index (it does not start with {MEGATRON_MAGIC!r})")
    _, version, code, n_seq, n_doc = _HEADER.unpack(head)
    if version != 1:
        raise DataError(f"{idx}: Megatron index version {version}; only version 1 is known")
    if code not in MEGATRON_DTYPES:
        raise DataError(f"{idx}: unknown token dtype code {code} (known: {sorted(MEGATRON_DTYPES)})")
    need = _HEADER.size + 12 * n_seq + 8 * n_doc
    if size < need:
        raise DataError(f"{idx}: {size} bytes, but its header announces {n_seq} sequences and {n_doc} document "
                        f"indices ({need} bytes); the index is truncated")
    o = _HEADER.size
    lengths = np.memmap(idx, np.int32, "r", o, (n_seq,)) if n_seq else np.zeros(0, np.int32)
    pointers = np.memmap(idx, np.int64, "r", o + 4 * n_seq, (n_seq,)) if n_seq else np.zeros(0, np.int64)
    docs = np.memmap(idx, np.int64, "r", o + 12 * n_seq, (n_doc,)) if n_doc else np.zeros(0, np.int64)
    # Plain arrays over the maps: indexing an np.memmap element by element goes through its Python __getitem__.
    return {"dtype": np.dtype(MEGATRON_DTYPES[code]), "lengths": lengths.view(np.ndarray),
            "pointers": pointers.view(np.ndarray), "docs": docs.view(np.ndarray)}


def _check_megatron_pair(prefix: str, index: dict) -> bool:
    """Pointers inside the .bin (truncated files are a DataError); True when sequences are contiguous."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    lengths, pointers, docs, item = index["lengths"], index["pointers"], index["docs"], index["dtype"].itemsize
    if len(docs) < 2 or len(lengths) == 0:
        raise DataError(f"{idx}: holds no documents (an empty dataset); leave it out of the data path")
    if int(docs[0]) != 0 or int(docs[-1]) != len(lengths) or np.any(np.diff(docs) < 0):
        raise DataError(f"{idx}: its document indices do not cover its {len(lengths)} sequences; the index is damaged")
    bin_size = os.path.getsize(bin_)
    contiguous = True
    for a in range(0, len(lengths), _SCAN):
        p = np.asarray(pointers[a:a + _SCAN], dtype=np.int64)
        ends = p + np.asarray(lengths[a:a + _SCAN], dtype=np.int64) * item
        worst = int(np.argmax(ends))
        if ends[worst] > bin_size or int(p.min()) < 0:
            raise DataError(f"{bin_}: {bin_size} bytes, but {os.path.basename(idx)} points to byte {int(ends[worst])} "
                            f"(sequence {a + worst}); the .bin is truncated or belongs to another index")
        nxt = pointers[a + 1:a + _SCAN + 1]
        contiguous = contiguous and bool(np.array_equal(ends[:len(nxt)], nxt))
    return contiguous


class MegatronSource(_TokenFileSource):
    kind = "megatron"
    extensions = (".idx", ".bin")

    def __init__(self, spec, index, opts):
        super().__init__(spec, index, opts)
        self.units = megatron_prefixes(spec)
        self.contiguous: list[bool] = []
        for prefix in self.units:
            meta = read_megatron_index(prefix + ".idx")
            check_dtype(prefix + ".bin", meta["dtype"], opts)
            self.dtypes.append(np.dtype(meta["dtype"]))
            self.contiguous.append(_check_megatron_pair(prefix, meta))
            self.sizes.append(len(meta["docs"]) - 1)

    def _unit(self, unit: int) -> dict:
        def opener(u):
            meta = read_megatron_index(self.units[u] + ".idx")
            meta["tokens"] = _token_map(self.units[u] + ".bin", meta["dtype"])
            return meta
        return self._cached(unit, opener)

    def _doc(self, unit, d):
        m = self._unit(unit)
        s0, s1 = int(m["docs"][d]), int(m["docs"][d + 1])
        if s0 == s1:
            return m["tokens"][:0]
        item = m["dtype"].itemsize
        if self.contiguous[unit]:
            start = int(m["pointers"][s0]) // item
            end = int(m["pointers"][s1 - 1]) // item + int(m["lengths"][s1 - 1])
            return m["tokens"][start:end]
        parts = [m["tokens"][int(m["pointers"][s]) // item:][:int(m["lengths"][s])] for s in range(s0, s1)]
        return np.concatenate(parts)

    def layout(self, unit, lo, hi):
        if not self.contiguous[unit] or lo >= hi:
            return None
        m = self._unit(unit)
        s0, s1 = m["docs"][lo:hi], m["docs"][lo + 1:hi + 1]
        if np.any(s0 == s1):  # a document without sequences
            return None
        item = m["dtype"].itemsize
        starts = m["pointers"][s0] // item
        ends = m["pointers"][s1 - 1] // item + m["lengths"][s1 - 1]
        return m["tokens"], starts, ends - starts

    def _span(self, unit, lo, hi):
        if not self.contiguous[unit]:
            return None
        m = self._unit(unit)
        s0, s1 = int(m["docs"][lo]), int(m["docs"][hi])
        if s0 == s1:
            return m["tokens"][:0]
        item = m["dtype"].itemsize
        end = int(m["pointers"][s1 - 1]) // item + int(m["lengths"][s1 - 1])
        return m["tokens"][int(m["pointers"][s0]) // item:end]


# --------------------------------------------------------------------------------------------------
# OLMo numpy token arrays
# --------------------------------------------------------------------------------------------------


def numpy_sidecar(path: str) -> str:
    """OLMo's metadata file of a token array: ``x.npy`` -> ``x.csv.gz`` (``start,end,...`` per document)."""
    return path[:-4] + ".csv.gz" if path.endswith(".npy") else path + ".csv.gz"


def open_numpy_tokens(path: str, opts: SourceOptions, *, check_width: bool = False) -> np.ndarray:
    """A flat token file as an array over a memory map: the NPY header's dtype, else data.numpy_dtype (auto:
    uint16 when the model's vocabulary fits in 16 bits, else uint32). ``check_width``: a raw file that looks
    written at the other width is a DataError naming data.numpy_dtype (a sample is read; done once per source)."""
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(f"{path}: empty file (no tokens); leave it out of the data path")
    with open(path, "rb") as f:
        head = f.read(len(_NPY_MAGIC))
    if head == _NPY_MAGIC:
        try:
            arr = np.load(path, mmap_mode="r")
        except ValueError as e:
            raise DataError(f"{path}: unreadable NPY file ({e})") from None
        if arr.ndim != 1:
            raise DataError(f"{path}: holds an array of shape {arr.shape}; a token file is one flat array")
        check_dtype(path, arr.dtype, opts)
        if arr.size == 0:
            raise DataError(f"{path}: empty array (no tokens); leave it out of the data path")
        return arr.view(np.ndarray)
    name = opts.numpy_dtype
    if name == "auto":
        name = "uint16" if max(opts.vocab_size, opts.tokenizer_vocab) <= 1 << 16 else "uint32"
    dtype = np.dtype(name)
    check_dtype(path, dtype, opts)
    if size % dtype.itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {dtype} tokens (a truncated file, or not "
                        f"{dtype}: set data.numpy_dtype)")
    if check_width:
        _check_raw_width(path, size, dtype, opts)
    return _token_map(path, dtype)


def _width_sample(path: str, size: int) -> np.ndarray:
    """Up to _WIDTH_SAMPLE uint16 halves of a raw file, in aligned pairs, from four evenly spaced places."""
    halves = (size // 4) * 2  # whole uint32 words only, so that pairs line up
    if halves <= _WIDTH_SAMPLE:
        return np.fromfile(path, dtype=np.uint16, count=halves)
    every = np.memmap(path, dtype=np.uint16, mode="r", shape=(halves,))
    piece = _WIDTH_SAMPLE // 4
    starts = np.linspace(0, halves - piece, 4).astype(np.int64) // 2 * 2
    return np.concatenate([np.asarray(every[a:a + piece]) for a in starts])


def _check_raw_width(path: str, size: int, dtype: np.dtype, opts: SourceOptions) -> None:
    """A raw file read at the wrong width trains garbage without any other error, so a sample of it is checked:
    uint32 tokens of a 16-bit vocabulary read as uint16 make every second uint16 (the high halves) 0, which
    also puts every EOS at an even position followed by a 0 (read as BOS where BOS is 0); uint16 tokens read
    as uint32 make ids far above the vocabulary."""
    sample = _width_sample(path, size)
    if len(sample) < 16:
        return  # too few tokens to tell
    low, high = sample[0::2], sample[1::2]
    high_zero = float(np.mean(high == 0))
    if dtype == np.uint16 and high_zero >= 0.99 and float(np.mean(low == 0)) < 0.5:
        raise DataError(f"{path}: looks like uint32 tokens, read here as uint16 ({high_zero:.0%} of its odd uint16 "
                        "values are 0); set data.numpy_dtype = uint32 (a raw file carries no type)")
    vocab = opts.vocab_size or opts.tokenizer_vocab
    if dtype == np.uint32 and 0 < vocab <= 1 << 16:
        outside = float(np.mean(sample.view(np.uint32) >= vocab))
        if outside >= 0.5 and float(np.mean(sample < vocab)) >= 0.99:
            raise DataError(f"{path}: looks like uint16 tokens, read here as uint32 ({outside:.0%} of its ids are at "
                            f"or above the vocabulary of {vocab}, its uint16 values are not); set data.numpy_dtype = "
                            "uint16 (a raw file carries no type)")


def numpy_documents(path: str, tokens: np.ndarray, eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the documents of a token array: from its .csv.gz sidecar, else one document up to
    and including every EOS (and a last one without EOS if the array does not end with it)."""
    sidecar = numpy_sidecar(path)
    n = len(tokens)
    if os.path.isfile(sidecar):
        starts, ends = [], []
        try:
            with gzip.open(sidecar, "rt") as f:
                for line in f:
                    if line.strip():
                        a, b, *_ = line.split(",", 2)
                        starts.append(int(a))
                        ends.append(int(b))
        except (OSError, EOFError, ValueError) as e:
            raise DataError(f"{sidecar}: unreadable document index ({e})") from None
        s, e = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        bad = np.flatnonzero((s < 0) | (e < s) | (e > n))
        if len(bad):
            raise DataError(f"{sidecar}: document {int(bad[0])} spans tokens {int(s[bad[0]])}..{int(e[bad[0]])}, "
                            f"outside {os.path.basename(path)}'s {n} tokens; the sidecar belongs to another file")
        return s, e
    if eos_id is None:
        raise ConfigError(f"{path}: no {os.path.basename(sidecar)} sidecar and the tokenizer has no EOS id to "
                          "find documents by")
    found = [np.flatnonzero(tokens[a:a + _SCAN] == eos_id) + (a + 1) for a in range(0, n, _SCAN)]
    ends = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
    if not len(ends) or ends[-1] != n:
        ends = np.append(ends, n)
    ends = ends.astype(np.int64)
    return np.concatenate([[0], ends[:-1]]).astype(np.int64), ends


class NumpySource(_TokenFileSource):
    """Coordinates are document numbers; a file's documents are found when it is first read (a pass over its
    tokens for EOS, in bounded memory) or taken from its sidecar. ``sizes`` are token counts."""

    kind = "numpy"
    extensions = (".npy",)

    def __init__(self, spec, index, opts):
        super().__init__(spec, index, opts)
        self.units = expand_files(spec, self.extensions)
        self._counts: dict[int, int] = {}
        for path in self.units:
            tokens = open_numpy_tokens(path, opts, check_width=True)
            self.sizes.append(len(tokens))
            self.dtypes.append(tokens.dtype)
        asked = np.dtype(opts.numpy_dtype) if opts.numpy_dtype != "auto" else None
        other = [(p, d) for p, d in zip(self.units, self.dtypes) if asked is not None and d != asked]
        if other:  # (only files with an NPY header can differ: it names their type)
            logger.warning("%s: data.numpy_dtype = %s is for raw files; %d file(s) have an NPY header of another type "
                           "and are read as it says (e.g. %s: %s)", spec.key, asked, len(other), other[0][0],
                           other[0][1])

    def _unit(self, unit: int) -> tuple:
        def opener(u):
            tokens = open_numpy_tokens(self.units[u], self.opts)
            starts, ends = numpy_documents(self.units[u], tokens, self.opts.eos_id)
            self._counts[u] = len(starts)
            return tokens, starts, ends
        return self._cached(unit, opener)

    def documents(self, unit: int) -> int:
        if unit not in self._counts:
            self._unit(unit)
        return self._counts[unit]

    def part(self, unit, shard, num_shards):
        return range_part(self.documents(unit), shard, num_shards)

    def check_cost(self):
        return len(self.units) if sum(self.sizes) < (64 << 20) else float("inf")

    def _doc(self, unit, d):
        tokens, starts, ends = self._unit(unit)
        return tokens[int(starts[d]):int(ends[d])]

    def layout(self, unit, lo, hi):
        tokens, starts, ends = self._unit(unit)
        return tokens, starts[lo:hi], ends[lo:hi] - starts[lo:hi]

    def _span(self, unit, lo, hi):
        tokens, starts, ends = self._unit(unit)
        if lo >= hi:
            return tokens[:0]
        # (a sidecar's documents need not be in order or adjacent: the stretch from the first start to the last end)
        return tokens[int(starts[lo:hi].min()):int(ends[lo:hi].max())]


# --------------------------------------------------------------------------------------------------
# Arrow IPC: text, or token lists (a row per document), or token columns (a record batch per document)
# --------------------------------------------------------------------------------------------------


def _arrow_batches(pa, path: str, source=None) -> list:
    """The record batches of an Arrow IPC file (file or stream format), memory-mapped (nothing is copied)."""
    source = pa.memory_map(path, "r") if source is None else source
    try:
        reader = pa.ipc.open_file(source)
        return [reader.get_batch(i) for i in range(reader.num_record_batches)]
    except pa.ArrowInvalid:
        source.seek(0)
        try:
            return list(pa.ipc.open_stream(source))
        except pa.ArrowInvalid as e:
            raise DataError(f"{path}: not an Arrow IPC file or stream ({e})") from None


def arrow_mode(pa, schema, path: str, opts: SourceOptions, key: str) -> str:
    """"rows" (a list column of token ids), "batches" (an integer column: one document per record batch) or
    "text" (data.text_field)."""
    if opts.tokens_field in schema.names:
        t = schema.field(opts.tokens_field).type
        if (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type):
            return "rows"
        if pa.types.is_integer(t):
            return "batches"
        raise ConfigError(f"data.tokens_field: column {opts.tokens_field!r} of {path} holds {t}, not token ids "
                          "(a list of integers per row, or integers with one record batch per document)")
    if opts.text_field in schema.names:
        return "text"
    raise ConfigError(f"{key}: {path} has neither a token column data.tokens_field={opts.tokens_field!r} nor a text "
                      f"column data.text_field={opts.text_field!r} (columns: {schema.names})")


def _batch_tokens(source, batches: list, field: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """For a file of one document per record batch: (the file's tokens as one array over its memory map,
    each document's start in it, its length), from where each batch's token buffer lies in the map; None when
    a buffer is not in the map (compressed batches) or not aligned to the token type, or a document is null."""
    if not batches:
        return None
    dtype = np.dtype(batches[0].schema.field(field).type.to_pandas_dtype())
    source.seek(0)
    raw = np.frombuffer(source.read_buffer(source.size()), dtype=np.uint8)  # the whole map, no copy
    origin, size = raw.ctypes.data, len(raw)
    starts, lens = np.empty(len(batches), dtype=np.int64), np.empty(len(batches), dtype=np.int64)
    for i, batch in enumerate(batches):
        column = batch.column(field)
        if column.null_count:
            return None
        buf = column.buffers()[1]
        at = buf.address - origin if buf is not None else 0
        if buf is not None and (at < 0 or at + buf.size > size or at % dtype.itemsize):
            return None
        starts[i], lens[i] = at // dtype.itemsize + column.offset, len(column)
    base = raw[:size - size % dtype.itemsize].view(dtype)
    return base, starts, lens


class ArrowSource(_TokenFileSource):
    """Arrow IPC files (file or stream format, e.g. the .arrow files of datasets.save_to_disk or fms-fsdp's
    token shards), memory-mapped: only the rows being read are paged in."""

    kind = "arrow"
    extensions = (".arrow",)

    def __init__(self, spec, index, opts):
        super().__init__(spec, index, opts)
        pa = import_pyarrow(spec)
        self.units = expand_files(spec, self.extensions)
        self.modes: list[str] = []
        for path in self.units:
            batches = _arrow_batches(pa, path)
            if not batches:
                raise DataError(f"{path}: holds no record batch (an empty file); leave it out of the data path")
            mode = arrow_mode(pa, batches[0].schema, path, opts, spec.key)
            self.modes.append(mode)
            self.sizes.append(len(batches) if mode == "batches" else sum(b.num_rows for b in batches))
            if mode == "rows":
                dtype = batches[0].schema.field(opts.tokens_field).type.value_type.to_pandas_dtype()
            elif mode == "batches":
                dtype = batches[0].schema.field(opts.tokens_field).type.to_pandas_dtype()
            if mode in ("rows", "batches"):
                check_dtype(path, dtype, opts)
                self.dtypes.append(np.dtype(dtype))
        if len({m == "text" for m in self.modes}) > 1:
            raise ConfigError(f"{spec.key}: {spec.path!r} mixes files with token columns and text-only files; "
                              "give each its own source")
        self.verbatim = self.modes[0] != "text"

    def _unit(self, unit: int) -> dict:
        def opener(u):
            pa = import_pyarrow(self.spec)
            source = pa.memory_map(self.units[u], "r")
            batches = _arrow_batches(pa, self.units[u], source)
            starts = np.cumsum([0] + [b.num_rows for b in batches])
            flat = _batch_tokens(source, batches, self.opts.tokens_field) if self.modes[u] == "batches" else None
            return {"batches": batches, "starts": starts, "columns": {}, "flat": flat}
        return self._cached(unit, opener)

    def iter_docs(self, unit, lo, hi, start, *, shard, num_shards, epoch):
        if self.verbatim:
            yield from _TokenFileSource.iter_docs(self, unit, lo, hi, start, shard=shard, num_shards=num_shards,
                                                  epoch=epoch)
            return
        u = self._unit(unit)
        for b, batch in enumerate(u["batches"]):
            first, n = int(u["starts"][b]), batch.num_rows
            begin, end = max(start, first), min(hi, first + n)
            if begin < end:
                values = batch.column(self.opts.text_field).slice(begin - first, end - begin).to_pylist()
                for i, value in enumerate(values):
                    yield begin + i, begin + i + 1, value
            if first + n >= hi:
                return

    def load(self, unit, coord, next_coord, payload):
        return _TokenFileSource.load(self, unit, coord, next_coord, payload) if self.verbatim else payload

    def decode(self, payload):
        return _TokenFileSource.decode(self, payload) if self.verbatim else text_status(payload)

    def _doc(self, unit, d):
        u = self._unit(unit)
        field = self.opts.tokens_field
        if self.modes[unit] == "batches":
            column = u["batches"][d].column(field)
            return None if column.null_count else column.to_numpy(zero_copy_only=True)
        b = int(np.searchsorted(u["starts"], d, side="right")) - 1
        cached = u["columns"].get(b)
        if cached is None:
            column = u["batches"][b].column(field)
            valid = column.is_valid().to_numpy(zero_copy_only=False) if column.null_count else None
            if column.values.null_count:
                raise DataError(f"{self.units[unit]}: record batch {b} holds null token ids")
            cached = u["columns"][b] = (column.offsets.to_numpy(), column.values.to_numpy(zero_copy_only=True), valid)
        offsets, values, valid = cached
        r = d - int(u["starts"][b])
        if valid is not None and not valid[r]:
            return None
        return values[int(offsets[r]):int(offsets[r + 1])]

    def check_block(self, unit, first, last):
        if self.modes[unit] != "batches":
            return super().check_block(unit, first, last)
        if not self.opts.vocab_size:
            return True
        flat = self._unit(unit)["flat"]
        if flat is not None:  # each document's largest (and smallest) id in one pass over the stretch
            base, starts, lens = flat
            a, n = starts[first:last + 1], lens[first:last + 1]
            if not n.all():
                return False
            lo = int(a[0])
            bounds = np.empty(2 * len(a), dtype=np.int64)
            bounds[0::2], bounds[1::2] = a - lo, a + n - lo
            if np.any(np.diff(bounds) < 0):  # batches not in file order: reduceat would miss tokens
                return False
            span = base[lo:int(bounds[-1]) + lo]
            bounds = bounds[:-1]
            if int(np.maximum.reduceat(span, bounds)[0::2].max()) >= self.opts.vocab_size:
                return False
            return span.dtype.kind != "i" or int(np.minimum.reduceat(span, bounds)[0::2].min()) >= 0
        for d in range(first, last + 1):  # one record batch per document: no stretch of the file holds them all
            tokens = self._doc(unit, d)
            if tokens is not None and len(tokens) and (
                    int(tokens.max()) >= self.opts.vocab_size or (tokens.dtype.kind == "i" and int(tokens.min()) < 0)):
                return False
        return True

    def layout(self, unit, lo, hi):
        if not self.verbatim or lo >= hi:
            return None
        if self.modes[unit] == "batches":
            flat = self._unit(unit)["flat"]
            if flat is not None:
                return flat[0], flat[1][lo:hi], flat[2][lo:hi]
            views = [self._doc(unit, d) for d in range(lo, hi)]
            if any(v is None for v in views):
                return None
            return views, None, np.fromiter(map(len, views), dtype=np.int64, count=len(views))
        u = self._unit(unit)
        b = int(np.searchsorted(u["starts"], lo, side="right")) - 1
        if hi > int(u["starts"][b + 1]):
            return None
        self._doc(unit, lo)
        offsets, values, valid = u["columns"][b]
        first = int(u["starts"][b])
        if valid is not None and not valid[lo - first:hi - first].all():
            return None
        starts = offsets[lo - first:hi - first].astype(np.int64)
        return values, starts, offsets[lo - first + 1:hi - first + 1] - starts

    def _span(self, unit, lo, hi):
        if self.modes[unit] != "rows" or lo >= hi:
            return None
        u = self._unit(unit)
        b = int(np.searchsorted(u["starts"], lo, side="right")) - 1
        if hi > int(u["starts"][b + 1]):
            return None  # the documents lie in two record batches
        self._doc(unit, lo)  # (caches the batch's offsets and values)
        offsets, values, _ = u["columns"][b]
        first = int(u["starts"][b])
        return values[int(offsets[lo - first]):int(offsets[hi - first])]
