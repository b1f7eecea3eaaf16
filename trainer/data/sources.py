"""Data sources: from a "kind:path" spec to a Source (the table of kinds, ``KINDS``), and the kinds that read
text (JSON lines, plain text, parquet), prepared tokens and Hugging Face datasets.

A source is a list of *units* (files; one stream for a Hugging Face dataset). Each unit has a coordinate
space (byte offsets for line-based files, row numbers for columnar files, a running count for HF
streams) and every document has a start coordinate. A shard owns one contiguous coordinate range of
every unit (``part``), so N shards split each file N ways without anybody reading a byte twice, and a
reader can resume in the middle of a part from a coordinate alone (``iter_docs(start=...)``).

Documents come out raw (``payload``) and are decoded lazily by ``decode`` into ``(status, text)`` or
``(status, token array)``, so bad data is counted where it is consumed (see pipeline.DocumentTokenizer).

The pre-tokenized format written by ``prepare`` keeps the original coordinates of every document, so a
``tokens`` source splits into shards and blocks exactly as the text it came from: the same config gives
the same sequences on either path. Token files written by other trainers (megatron, numpy, token
columns of arrow files) are read by readers.py; what every kind shares is in source_base.py. A new kind is
its Source class and one entry in ``KINDS``.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from pathlib import Path

import numpy as np

from trainer.data.c4 import JSONL_SUFFIXES, SPLITS as C4_NAMES, c4_source, data_suffix
from trainer.data.readers import ArrowSource, MegatronSource, NumpySource
from trainer.data.source_base import (
    EMPTY, MALFORMED, MISSING_FIELD, OK, UNDECODABLE, Source, SourceOptions, SourceSpec, expand_files,
    import_pyarrow, text_status,
)
from trainer.errors import ConfigError, DataError

# Bits 2 and 3 of a prepared status byte: the tokenizer had added a leading / trailing separator that was
# removed at prepare time (kept so that audit counts the same on both paths).
STRIPPED_LEADING, STRIPPED_TRAILING = 4, 8

SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
# Registered dataset names -> {split: (kind, path)}.
REGISTRY: dict[str, dict[str, tuple[str, str]]] = {
    "shakespeare": {
        "train": ("jsonl", str(SAMPLE_DIR / "shakespeare_train.jsonl")),
        "validation": ("jsonl", str(SAMPLE_DIR / "shakespeare_val.jsonl")),
    },
}
# Files beside the data that say nothing of its kind (a datasets.save_to_disk folder's metadata).
_NOT_DATA = frozenset({"state.json", "dataset_info.json", "dataset_dict.json"})
TOKENS_META = "meta.json"
TOKENS_FORMAT = "trainer-tokens-v1"
_MISSING = object()


def parse_source(text: str, *, key: str, split: str = "train") -> SourceSpec:
    """Parse "kind:path", a registered name ("shakespeare", "shakespeare@validation") or a bare path.

    HF specs are "hf:NAME_OR_PATH[#CONFIG][@SPLIT]". A bare path's kind comes from its extension, or is
    "tokens" for a folder written by ``trainer data prepare``.
    """
    raw = text.strip()
    if not raw:
        raise ConfigError(f"{key}: empty source")
    name, _, at_split = raw.partition("@")
    if name in REGISTRY:
        use_split = at_split or split
        if use_split not in REGISTRY[name]:
            raise ConfigError(f"{key}: dataset {name!r} has no split {use_split!r}; splits: {sorted(REGISTRY[name])}")
        kind, path = REGISTRY[name][use_split]
        return SourceSpec(kind, path, key, raw)
    m = re.match(r"^([A-Za-z][A-Za-z0-9_]+):(.*)$", raw)
    if m and not os.path.exists(raw):
        kind, rest = m.group(1).lower(), m.group(2)
        if kind not in KINDS:
            raise ConfigError(
                f"{key}: unknown source kind {m.group(1)!r} in {raw!r}; kinds: {', '.join(KINDS)} "
                f"(or a registered dataset: {', '.join(REGISTRY)})"
            )
        if kind == "hf":
            rest, _, hf_split = rest.rpartition("@") if "@" in rest else (rest, "", "")
            rest, _, hf_config = rest.partition("#")
            default_split = "validation" if split == "validation" else "train"
            return SourceSpec("hf", rest, key, raw, hf_config or None, hf_split or default_split)
        return SourceSpec(kind, rest, key, raw)
    return SourceSpec(_infer_kind(raw, key), raw, key, raw)


def _infer_kind(path: str, key: str) -> str:
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        if os.path.isfile(os.path.join(expanded, TOKENS_META)):
            return "tokens"
        return _folder_kind(expanded, path, key)
    suffix = data_suffix(path)
    kind = _kind_of_suffix(suffix)
    if kind is not None:
        return kind
    if not os.path.exists(expanded) and os.path.isfile(expanded + ".idx"):
        return "megatron"  # a Megatron path prefix, as in --data-path
    raise ConfigError(
        f"{key}: cannot tell the source kind of {path!r}; write it as KIND:PATH with KIND one of {', '.join(KINDS)}"
    )


def _folder_kind(folder: str, shown: str, key: str) -> str:
    """The one kind of the data files in a folder (searched recursively); several kinds are an error."""
    found: dict[str, str] = {}
    for root, _, names in os.walk(folder):
        for name in names:
            if name in _NOT_DATA or name.lower().startswith("readme"):
                continue
            kind = _kind_of_suffix(data_suffix(name))
            if kind is not None and kind not in found:
                found[kind] = os.path.join(root, name)
                if len(found) > 1:
                    detail = ", ".join(f"{k} ({p})" for k, p in found.items())
                    raise ConfigError(f"{key}: folder {shown!r} holds files of several kinds: {detail}; point at "
                                      "one kind's files (a glob or sub-folder), or write KIND:PATH")
    if not found:
        raise ConfigError(f"{key}: folder {shown!r} holds no data file of a known kind; write it as KIND:PATH "
                          f"with KIND one of {', '.join(KINDS)}")
    return next(iter(found))


def training_specs(config) -> tuple[list[SourceSpec], list[float]]:
    """The training sources and their normalised weights, from data.sources or training.dataset."""
    d, t = config.data, config.training
    if d.sources:
        explicit = getattr(config, "explicitly_set", lambda _k: False)
        clash = [k for k in ("training.dataset", "training.dataset_path") if explicit(k)]
        if clash:
            raise ConfigError(f"set either data.sources or {' / '.join(clash)}, not both")
        sources, inline = _inline_weights(list(d.sources), bool(d.weights))
        specs = [parse_source(s, key=f"data.sources[{i}]") for i, s in enumerate(sources)]
    else:
        specs = [_single_spec(t.dataset, t.dataset_path, "training", "train")]
        inline = None
    weights = inline or (list(d.weights) if d.weights else [1.0] * len(specs))
    if len(weights) != len(specs):
        raise ConfigError(
            f"data.weights has {len(weights)} entries but there are {len(specs)} sources (data.sources); "
            "give one weight per source"
        )
    for i, w in enumerate(weights):
        if not (w >= 0.0) or w == float("inf"):
            key = f"data.sources[{2 * i}]" if inline else f"data.weights[{i}]"
            raise ConfigError(f"{key}: a weight must be a finite number >= 0, got {w}")
    total = sum(weights)
    if total <= 0:
        raise ConfigError("data.weights: at least one weight must be > 0")
    return specs, [w / total for w in weights]


def _is_weight(text) -> bool:
    """A number that is not the name of a file or folder."""
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return not os.path.exists(os.path.expanduser(str(text)))


def _inline_weights(sources: list, weights_set: bool) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path 0.3 A 0.7 B`` written as data.sources (``0.3,megatron:A,0.7,megatron:B``): the
    sources and their weights. Any other list with a number in it names data.weights."""
    numbers = [_is_weight(s) for s in sources]
    if not any(numbers):
        return [str(s) for s in sources], None
    megatron_form = len(sources) % 2 == 0 and all(numbers[0::2]) and not any(numbers[1::2])
    if megatron_form and not weights_set:
        return [str(s) for s in sources[1::2]], [float(w) for w in sources[0::2]]
    i = numbers.index(True)
    if megatron_form:
        why = "data.weights is set too: give the weights in one of the two places"
    else:
        why = ("give the weights with data.weights (--data.weights 0.3,0.7), or before each of its sources as "
               "Megatron's --data-path does (0.3,megatron:A,0.7,megatron:B)")
    raise ConfigError(f"data.sources[{i}]: {sources[i]!r} is a weight, not a source; {why}")


def validation_spec(config) -> SourceSpec:
    v = config.validation
    return _single_spec(v.dataset, v.dataset_path, "validation", "validation")


def _single_spec(dataset: str, dataset_path: str, section: str, split: str) -> SourceSpec:
    key = f"{section}.dataset"
    prefixed = _kind_prefix(dataset_path)
    if prefixed is not None:  # "megatron:/data/x" as the path: the kind it names is the source's
        path_key = f"{section}.dataset_path"
        if dataset in KINDS and dataset != prefixed or dataset in C4_NAMES:
            raise ConfigError(f"{path_key} {dataset_path!r} names the kind {prefixed!r} but {key} is {dataset!r}; "
                              f"set {key} {prefixed}")
        return parse_source(dataset_path, key=path_key, split=split)
    if dataset in C4_NAMES:  # torchtitan's names, from local files (trainer/data/c4.py)
        kind, path, path_key = c4_source(dataset, dataset_path, section)
        return SourceSpec(kind, path, path_key, f"{dataset}:{dataset_path}")
    if dataset in REGISTRY:
        if dataset_path:
            kind = REGISTRY[dataset][split][0]
            return SourceSpec(kind, dataset_path, f"{section}.dataset_path", f"{kind}:{dataset_path}")
        return parse_source(dataset, key=key, split=split)
    if dataset in KINDS:
        if not dataset_path:
            raise ConfigError(f"{section}.dataset_path is required when {key} is the source kind {dataset!r}")
        return parse_source(f"{dataset}:{dataset_path}", key=f"{section}.dataset_path", split=split)
    if ":" in dataset and not dataset_path:
        return parse_source(dataset, key=key, split=split)
    raise ConfigError(
        f"{key}: unknown dataset or source kind {dataset!r}; registered datasets: {', '.join([*REGISTRY, *C4_NAMES])}; "
        f"source kinds (with {section}.dataset_path): {', '.join(KINDS)}"
    )


def _kind_prefix(path: str) -> str | None:
    """The kind of a data path written "KIND:PATH" (a known kind, and no file of that literal name), else None."""
    m = re.match(r"^([A-Za-z][A-Za-z0-9_]+):", path.strip())
    if m is None or m.group(1).lower() not in KINDS or os.path.exists(os.path.expanduser(path.strip())):
        return None
    return m.group(1).lower()


class _LineFileSource(Source):
    """Files where every line starting inside a shard's byte range is one of its documents."""

    coords_are_bytes = True

    def __init__(self, spec, index, opts):
        super().__init__(spec, index, opts)
        self.units = expand_files(spec, self.extensions)
        # Gzipped files (allenai/c4's .json.gz): coordinates are offsets in the decompressed stream, whose
        # size the gzip trailer gives (modulo 4 GiB: the last part of a file reads on to its end).
        self.gz = [p.lower().endswith(".gz") for p in self.units]
        self.sizes = [_gzip_size(p) if gz else os.path.getsize(p) for p, gz in zip(self.units, self.gz)]
        self._fds: dict[int, int] = {}

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fds"] = {}  # file descriptors stay in the process that opened them
        return state

    def iter_docs(self, unit, lo, hi, start, *, shard, num_shards, epoch):
        gz = self.gz[unit]
        if gz and hi >= self.sizes[unit]:
            hi = float("inf")
        try:
            with (gzip.open if gz else open)(self.units[unit], "rb") as f:  # gzip seeks forward by decompressing
                if start == lo and lo > 0:
                    f.seek(lo - 1)
                    f.readline()  # the rest of the line holding byte lo-1 belongs to the previous part
                else:
                    f.seek(start)
                pos = f.tell()
                while pos < hi:
                    line = f.readline()
                    if not line:
                        return
                    # Plain files: the payload is read again on use (blocks hold offsets only); gzip: kept.
                    yield pos, pos + len(line), (line if gz else None)
                    pos += len(line)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # a download cut short, a damaged archive
            raise DataError(f"{self.units[unit]}: damaged or truncated gzip file ({e}); download or compress "
                            "it again, or leave it out of the dataset path") from None

    def shard_is_empty(self, shard, num_shards):
        if any(self.gz):
            return None  # would mean decompressing up to every part's start
        for unit, path in enumerate(self.units):
            lo, hi = self.part(unit, shard, num_shards)
            if lo >= hi:
                continue
            if lo == 0:
                return False
            with open(path, "rb") as f:  # the first line start at or after lo
                f.seek(lo - 1)
                f.readline()
                if f.tell() < hi:
                    return False
        return True

    def check_cost(self):
        # Seeks: only worth it for small data, where too many shards is a likely mistake.
        return len(self.units) if sum(self.sizes) < (256 << 20) else float("inf")

    def load(self, unit, coord, next_coord, payload):
        if payload is not None:
            return payload
        fd = self._fds.get(unit)
        if fd is None:
            if len(self._fds) >= 32:
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = self._fds[unit] = os.open(self.units[unit], os.O_RDONLY)
        data = os.pread(fd, next_coord - coord, coord)  # pread: no shared file offset across forks
        if len(data) != next_coord - coord:
            raise DataError(f"{self.units[unit]} changed while reading (short read at byte {coord})")
        return data


def _gzip_size(path: str) -> int:
    """Decompressed size from the gzip trailer (ISIZE: the size modulo 2**32)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() < 18:
            return 0
        f.seek(-4, os.SEEK_END)
        return int.from_bytes(f.read(4), "little")


class JsonlSource(_LineFileSource):
    kind = "jsonl"
    extensions = JSONL_SUFFIXES

    def decode(self, payload):
        try:
            line = payload.decode("utf-8")
        except UnicodeDecodeError:
            return UNDECODABLE, None
        if not line.strip():
            return EMPTY, None
        try:
            obj = json.loads(line)
        except ValueError:
            return MALFORMED, None
        if not isinstance(obj, dict):
            return MALFORMED, None
        text = obj.get(self.opts.text_field, _MISSING)
        if text is _MISSING:
            return MALFORMED, MISSING_FIELD
        if not isinstance(text, str):
            return MALFORMED, None
        try:
            text.encode("utf-8")  # JSON escapes can encode lone surrogates, which are not text
        except UnicodeEncodeError:
            return UNDECODABLE, None
        return (OK, text) if text.strip() else (EMPTY, None)


class TextSource(_LineFileSource):
    kind = "text"
    extensions = (".txt", ".text", ".md")

    def __init__(self, spec, index, opts):
        super().__init__(spec, index, opts)
        if opts.text_document == "file":
            # One document per file: files are dealt to shards round-robin; coordinates 0..1.
            self.partition, self.coords_are_bytes = "modulo", False
            self.sizes = [1] * len(self.units)

    def shard_is_empty(self, shard, num_shards):
        if self.partition == "modulo":
            return Source.shard_is_empty(self, shard, num_shards)
        return super().shard_is_empty(shard, num_shards)

    def iter_docs(self, unit, lo, hi, start, *, shard, num_shards, epoch):
        if self.partition == "modulo":
            if start < hi:
                yield 0, 1, None
            return
        yield from super().iter_docs(unit, lo, hi, start, shard=shard, num_shards=num_shards, epoch=epoch)

    def load(self, unit, coord, next_coord, payload):
        if self.partition == "modulo":
            with open(self.units[unit], "rb") as f:
                return f.read()
        return super().load(unit, coord, next_coord, payload)

    def decode(self, payload):
        if self.partition != "modulo":
            payload = payload.rstrip(b"\r\n")
        return text_status(payload)


class _ColumnSource(Source):
    """Row-based files (parquet, arrow): row r of a file is a document; shards own row ranges."""

    def decode(self, payload):
        if payload is None:
            return MALFORMED, None
        return text_status(payload)


class ParquetSource(_ColumnSource):
    kind = "parquet"
    extensions = (".parquet",)

    def __init__(self, spec, index, opts):
        super().__init__(spec, index, opts)
        pq = _import_pyarrow_parquet(spec)
        self.units = expand_files(spec, self.extensions)
        for path in self.units:
            meta = pq.ParquetFile(path)
            if opts.text_field not in meta.schema_arrow.names:
                raise ConfigError(
                    f"data.text_field: column {opts.text_field!r} not in {path} (columns: {meta.schema_arrow.names})"
                )
            self.sizes.append(meta.metadata.num_rows)

    def iter_docs(self, unit, lo, hi, start, *, shard, num_shards, epoch):
        pq = _import_pyarrow_parquet(self.spec)
        pf = pq.ParquetFile(self.units[unit])
        first_row = 0
        for rg in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(rg).num_rows
            if first_row + n > start and first_row < hi:
                column = pf.read_row_group(rg, columns=[self.opts.text_field]).column(0)
                begin, end = max(start, first_row), min(hi, first_row + n)
                for i, value in enumerate(column.slice(begin - first_row, end - begin).to_pylist()):
                    yield begin + i, begin + i + 1, value
            first_row += n
            if first_row >= hi:
                return


class TokenSource(Source):
    """A folder written by ``trainer data prepare``: per input unit a flat token file (uint16/uint32
    memmap) plus document boundaries, original coordinates and statuses."""

    kind = "tokens"

    def __init__(self, spec, index, opts):
        super().__init__(spec, index, opts)
        folder = os.path.expanduser(spec.path)
        meta_path = os.path.join(folder, TOKENS_META)
        if not os.path.isfile(meta_path):
            if not os.path.exists(folder):
                raise ConfigError(f"{spec.key}: no such folder {spec.path!r}")
            raise ConfigError(f"{spec.key}: {spec.path!r} is not a prepared token folder (no {TOKENS_META})")
        with open(meta_path, encoding="utf-8") as f:
            self.meta = json.load(f)
        if self.meta.get("format") != TOKENS_FORMAT:
            raise ConfigError(f"{spec.key}: {meta_path} has format {self.meta.get('format')!r}, want {TOKENS_FORMAT!r}")
        self.folder = folder
        self.units = [u["name"] for u in self.meta["units"]]
        self.sizes = [int(u["size"]) for u in self.meta["units"]]
        self.partition = self.meta.get("partition", "range")
        self.coords_are_bytes = bool(self.meta.get("coords_are_bytes", False))
        self.dtype = np.dtype(self.meta["dtype"])
        self._arrays: dict[int, tuple] = {}

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_arrays"] = {}
        return state

    def _unit(self, unit):
        arrays = self._arrays.get(unit)
        if arrays is None:
            arrays = self._arrays[unit] = self._read_unit(os.path.join(self.folder, self.units[unit]))
        return arrays

    def _read_unit(self, base: str) -> tuple:
        """Memory maps of one unit's files, checked against each other: a file cut short (a copy or a
        prepare that did not finish) is a data error naming it, never documents read past its end."""
        tokens_path = base + ".tokens"
        redo = f"run trainer data prepare again for {self.folder}"
        size = os.path.getsize(tokens_path)
        if size % self.dtype.itemsize:
            raise DataError(f"{tokens_path}: {size} bytes is not a whole number of {self.dtype} tokens (the file "
                            f"was cut short); {redo}")
        tokens = np.memmap(tokens_path, dtype=self.dtype, mode="r") if size else np.zeros(0, dtype=self.dtype)
        try:
            index = np.load(base + ".index.npy", mmap_mode="r")
            coords = np.load(base + ".coords.npy", mmap_mode="r")
            status = np.load(base + ".status.npy", mmap_mode="r")
        except ValueError as e:  # numpy's words for a truncated .npy file
            raise DataError(f"{base}.*.npy: unreadable ({e}); {redo}") from None
        if len(index) and int(index[-1]) > len(tokens):
            raise DataError(f"{tokens_path}: holds {len(tokens)} tokens but its index ends at {int(index[-1])} (the "
                            f"file was cut short); {redo}")
        if not (len(index) == len(status) + 1 == coords.shape[-1] + 1):
            raise DataError(f"{base}: its index, coords and status files disagree on the number of documents; {redo}")
        return tokens, index, coords, status

    def shard_is_empty(self, shard, num_shards):
        for unit in range(len(self.units)):
            lo, hi = self.part(unit, shard, num_shards)
            starts = self._unit(unit)[2][0]
            if np.searchsorted(starts, lo, side="left") < np.searchsorted(starts, hi, side="left"):
                return False
        return True

    def iter_docs(self, unit, lo, hi, start, *, shard, num_shards, epoch):
        _, _, coords, _ = self._unit(unit)
        starts = coords[0]
        d = int(np.searchsorted(starts, start, side="left"))
        end = int(np.searchsorted(starts, hi, side="left"))
        for i in range(d, end):
            yield int(starts[i]), int(coords[1][i]), i  # payload: the document's row in this unit

    def load(self, unit, coord, next_coord, payload):
        tokens, index, _, status = self._unit(unit)
        return int(status[payload]), np.asarray(tokens[index[payload]:index[payload + 1]], dtype=np.int64)

    def decode(self, payload):
        status, tokens = payload
        return status & 3, (tokens, status)  # the high bits record separators removed at prepare time

    def fingerprint(self):
        return {"kind": self.kind, "label": self.label, "units": len(self.units), "size": int(sum(self.sizes)),
                "tokens": int(self.meta.get("num_tokens", 0))}


class HFSource(_ColumnSource):
    """A Hugging Face dataset (hub name or local folder) read in streaming mode. Shard j of N reads
    ``split_dataset_by_node(ds, rank=j, world_size=N)`` (whole dataset files per shard when their number
    is a multiple of N, else every N-th example); coordinates count examples in that stream, so resuming
    skips that many examples (read, not tokenized) before continuing."""

    kind = "hf"

    def __init__(self, spec, index, opts):
        super().__init__(spec, index, opts)
        _import_datasets(spec)
        path = os.path.expanduser(spec.path)
        if spec.path.startswith((".", "/", "~")) and not os.path.exists(path):
            raise ConfigError(f"{spec.key}: no such dataset folder {spec.path!r}")
        self.units = [spec.path]
        self.sizes = [1 << 40]  # unknown length: the stream ends when the dataset does

    def _dataset(self, shard: int, num_shards: int, epoch: int):
        datasets = _import_datasets(self.spec)
        from datasets.distributed import split_dataset_by_node

        path = os.path.expanduser(self.spec.path)
        if os.path.isdir(path) and (os.path.isfile(os.path.join(path, "state.json"))
                                    or os.path.isfile(os.path.join(path, "dataset_dict.json"))):
            ds = datasets.load_from_disk(path)  # a save_to_disk folder: Arrow files, memory-mapped
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[self.spec.split or "train"]
            ds = ds.to_iterable_dataset()
        else:
            ds = datasets.load_dataset(path if os.path.exists(path) else self.spec.path, name=self.spec.hf_config,
                                       split=self.spec.split or "train", streaming=True)
        # No HF-level shuffle: the reader's block shuffle applies, and an example's coordinate (its number
        # in this shard's stream) stays the same every epoch, which keeps document ids stable.
        return split_dataset_by_node(ds, rank=shard, world_size=num_shards)

    def iter_docs(self, unit, lo, hi, start, *, shard, num_shards, epoch):
        ds = self._dataset(shard, num_shards, epoch)
        if start > 0:
            ds = ds.skip(start)
        field_name = self.opts.text_field
        for i, example in enumerate(ds, start=start):
            yield i, i + 1, example.get(field_name) if isinstance(example, dict) else None

    def part(self, unit, shard, num_shards):
        return 0, self.sizes[unit]  # every shard reads its own stream (split_dataset_by_node) from its start

    def shard_is_empty(self, shard, num_shards):
        return None

    def uid(self, unit, coord, shard):
        return (self.index << 56) | (shard << 40) | (coord & ((1 << 40) - 1))


def _import_pyarrow_parquet(spec: SourceSpec):
    import_pyarrow(spec)
    import pyarrow.parquet as pq

    return pq


def _import_datasets(spec: SourceSpec):
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{spec.key}: the hf source kind needs the Hugging Face 'datasets' package: pip install datasets"
        ) from None
    return datasets


# The source kinds, in the order error messages list them: a kind's name is its class's ``kind``, and a bare
# path is this kind when it ends with one of the class's ``extensions``.
KINDS: dict[str, type[Source]] = {cls.kind: cls for cls in (
    JsonlSource, TextSource, ParquetSource, ArrowSource, TokenSource, HFSource, MegatronSource, NumpySource)}


def _kind_of_suffix(suffix: str) -> str | None:
    """The kind whose files end with ``suffix`` (a bare path's kind), from the table."""
    return next((kind for kind, cls in KINDS.items() if suffix in cls.extensions), None)


def build_source(spec: SourceSpec, index: int, opts: SourceOptions) -> Source:
    """Resolve a spec to a Source; a missing file or a glob matching nothing is a ConfigError naming it,
    damaged token files a DataError."""
    cls = KINDS.get(spec.kind)
    if cls is None:
        raise ConfigError(f"{spec.key}: unknown source kind {spec.kind!r}; kinds: {', '.join(KINDS)}")
    return cls(spec, index, opts)
