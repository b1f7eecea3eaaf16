"""Pre-tokenized documents written by the writers users have: megatron-core's IndexedDatasetBuilder (Megatron
.bin/.idx), numpy (OLMo's flat token arrays, with or without the .csv.gz sidecar), pyarrow's
RecordBatchFileWriter (fms-fsdp's one record batch per document, or a list column with a row per document).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import struct
import sys
import types
from pathlib import Path
from typing import Sequence

import numpy as np

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None


ASSETS = Path(__file__).resolve().parents[1] / "assets" / "token_files"


@functools.lru_cache(maxsize=1)
def megatron_builder():
    """megatron-core's IndexedDatasetBuilder, loaded from its own module file. ``import megatron.core`` runs the
    package's __init__, which imports its model-parallel layers (5-30 s on a loaded 2-core machine); the
    builder's module needs none of it: it is loaded under bare package stand-ins (and megatron.core.utils'
    logging helper taken from megatron.core._rank_utils), which are removed again afterwards."""
    root = Path(importlib.util.find_spec("megatron").submodule_search_locations[0])
    names = ("megatron", "megatron.core", "megatron.core.datasets", "megatron.core.utils")
    saved = {n: sys.modules.get(n) for n in names}
    try:
        for name, folder in zip(names[:3], (root, root / "core", root / "core" / "datasets")):
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(folder)]
            sys.modules[name] = pkg
        from megatron.core._rank_utils import log_single_rank

        utils = types.ModuleType("megatron.core.utils")
        utils.log_single_rank = log_single_rank
        sys.modules["megatron.core.utils"] = utils
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    finally:
        for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
            del sys.modules[name]
        sys.modules.update({n: m for n, m in saved.items() if m is not None})
    return IndexedDatasetBuilder


def documents(n: int, *, seed: int = 0, vocab: int = 2048, eos: int = 1, min_len: int = 3, max_len: int = 90,
              bos: int | None = 0) -> list[np.ndarray]:
    """n random documents of token ids (no EOS or BOS inside), each ending in EOS."""
    rng = np.random.default_rng(seed)
    special = {eos} | ({bos} if bos is not None else set())
    out = []
    for _ in range(n):
        ids = rng.integers(2, vocab, size=int(rng.integers(min_len, max_len + 1)))
        ids = np.array([t for t in ids if t not in special] + [eos], dtype=np.int64)
        out.append(ids)
    return out


def write_megatron(prefix: str | Path, docs: Sequence[np.ndarray], dtype=np.uint16) -> Path:
    """``prefix.bin`` / ``prefix.idx`` written by megatron-core's IndexedDatasetBuilder (one sequence per
    document, as Megatron's preprocess_data.py writes without sentence splitting)."""
    prefix = str(prefix)
    if HAVE_MEGATRON:
        import torch

        builder = megatron_builder()(prefix + ".bin", dtype=dtype)
        for doc in docs:
            builder.add_item(torch.from_numpy(np.asarray(doc, dtype=np.int64)))
            builder.end_document()
        builder.finalize(prefix + ".idx")
    else:
        write_mmidx(prefix, docs, dtype)
    return Path(prefix)


def write_mmidx(prefix: str, docs: Sequence[np.ndarray], dtype=np.uint16, *, version: int = 1,
                magic: bytes = b"MMIDIDX\x00\x00") -> None:
    """The MMIDIDX layout written directly (for damaged variants, and where megatron-core is not installed)."""
    codes = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}
    item = np.dtype(dtype).itemsize
    lengths = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = (np.cumsum(lengths.astype(np.int64) * item) - lengths.astype(np.int64) * item).astype(np.int64)
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, dtype=dtype).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(magic + struct.pack("<Q", version) + struct.pack("<B", codes[dtype]))
        f.write(struct.pack("<Q", len(docs)) + struct.pack("<Q", len(docs) + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(docs) + 1, dtype=np.int64).tobytes())


def write_numpy(path: str | Path, docs: Sequence[np.ndarray], dtype=np.uint16, *, header: bool = False,
                sidecar: bool = False) -> Path:
    """The documents concatenated into one flat token array: raw (OLMo's np.memmap files) or with an NPY
    header (np.save); with ``sidecar``, OLMo's ``<name>.csv.gz`` of ``start,end`` per document."""
    path = Path(path)
    flat = np.concatenate([np.asarray(d, dtype=dtype) for d in docs])
    if header:
        with open(path, "wb") as f:
            np.save(f, flat)
    else:
        mm = np.memmap(path, mode="w+", dtype=dtype, shape=(len(flat),))
        mm[:] = flat
        mm.flush()
        del mm
    if sidecar:
        ends = np.cumsum([len(d) for d in docs])
        with gzip.open(str(path)[:-4] + ".csv.gz", "wt") as f:
            for start, end in zip(np.concatenate([[0], ends[:-1]]), ends):
                f.write(f"{start},{end},doc,src\n")
    return path


def write_arrow(path: str | Path, docs: Sequence[np.ndarray], *, per_batch: bool = True, column: str = "tokens",
                stream: bool = False) -> Path:
    """An Arrow IPC file (RecordBatchFileWriter, or the stream writer): per_batch, one record batch per
    document with an integer column (fms-fsdp's layout); else one list row per document in one batch."""
    import pyarrow as pa

    path = Path(path)
    if per_batch:
        schema = pa.schema([(column, pa.uint32())])
        batches = [pa.record_batch([pa.array(np.asarray(d, dtype=np.uint32))], schema=schema) for d in docs]
    else:
        schema = pa.schema([(column, pa.list_(pa.int32()))])
        batches = [pa.record_batch([pa.array([list(map(int, d)) for d in docs], type=pa.list_(pa.int32()))],
                                   schema=schema)]
    writer_cls = pa.ipc.RecordBatchStreamWriter if stream else pa.ipc.RecordBatchFileWriter
    with pa.OSFile(str(path), "wb") as sink, writer_cls(sink, schema) as writer:
        for b in batches:
            writer.write_batch(b)
    return path


def write_all(folder: Path, docs: Sequence[np.ndarray], files: int = 2) -> dict[str, Path]:
    """The same documents, in the same order and split into the same files, in the three formats:
    {"megatron": folder, "numpy": folder, "arrow": folder}."""
    out = {}
    chunks = np.array_split(np.arange(len(docs)), files)
    for kind in ("megatron", "numpy", "arrow"):
        sub = folder / kind
        sub.mkdir(parents=True, exist_ok=True)
        for i, idx in enumerate(chunks):
            part = [docs[j] for j in idx]
            if kind == "megatron":
                write_megatron(sub / f"part{i}_text_document", part)
            elif kind == "numpy":
                write_numpy(sub / f"part{i}.npy", part)
            else:
                write_arrow(sub / f"part{i}.arrow", part)
        out[kind] = sub
    return out


def asset_documents() -> list[np.ndarray]:
    """The documents of tests/assets/token_files (the multi-process and launcher runs read them)."""
    return documents(400, seed=11, max_len=100)


def write_assets(folder: Path = ASSETS) -> dict[str, Path]:
    """(Re)write tests/assets/token_files: ``python -m tests.support.token_files``."""
    return write_all(folder, asset_documents())


if __name__ == "__main__":
    print(write_assets())
