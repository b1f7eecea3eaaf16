"""``trainer bench data-files``: the loader on token files other trainers write (Megatron .bin/.idx, OLMo numpy,
fms-fsdp Arrow), per kind, against reading the same tokens with plain numpy memmap slicing, in the same run.

The same documents (random lengths, mean ``mean_doc`` tokens, each ending in EOS) are written in the three
formats into a temporary folder. For each seq_len, the contenders are measured in turns (two rounds, best
round kept), each for ``seconds``:

* *plain numpy memmap*: consecutive windows of seq_len + 1 tokens sliced from the memory-mapped array,
  stacked into int64 micro-batches of ``local_batch_size`` (what a loader with no documents, no shuffling,
  no state and no checks costs: the floor);
* *megatron*, *numpy*, *arrow*: one rank's training loader (``TrainLoader``, in the process, no prefetch
  thread): documents in the seeded shuffled order, packed into windows, the vocabulary check, the micro-batch
  tensors with their fingerprint, and the exact-resume state (read from its shards when asked for: without a
  prefetch thread nothing is made ahead).

Tokens/s count input tokens of micro-batches (local_batch_size x seq_len each).
"""

from __future__ import annotations

import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.loader import TrainLoader, build_plan
from trainer.data.sources import SourceSpec

from .common import load_bench_config

KINDS = ("megatron", "numpy", "arrow")


def write_token_files(folder: Path, n_tokens: int, *, vocab: int, eos: int, mean_doc: int = 1024,
                      files: int = 2, seed: int = 0) -> dict[str, Path]:
    """The same documents in the three formats: {kind: folder}. Megatron's MMIDIDX index is written here
    directly (uint16 tokens, one sequence per document); Arrow with one record batch per document."""
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    out = {k: folder / k for k in KINDS}
    for path in out.values():
        path.mkdir(parents=True, exist_ok=True)
    per_file = n_tokens // files
    for f in range(files):
        tokens = rng.integers(2, vocab, size=per_file, dtype=np.uint16)
        tokens[tokens == eos] = eos + 1
        lengths = np.maximum(1, rng.exponential(mean_doc, size=2 * per_file // mean_doc + 2).astype(np.int64))
        ends = np.cumsum(lengths)
        ends = np.append(ends[ends < per_file], per_file)
        tokens[ends - 1] = eos
        starts = np.concatenate([[0], ends[:-1]])
        tokens.tofile(out["numpy"] / f"part{f}.npy")
        prefix = out["megatron"] / f"part{f}_text_document"
        tokens.tofile(f"{prefix}.bin")
        n = len(ends)
        with open(f"{prefix}.idx", "wb") as idx:
            idx.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n, n + 1))
            idx.write((ends - starts).astype(np.int32).tobytes() + (starts * 2).astype(np.int64).tobytes()
                      + np.arange(n + 1, dtype=np.int64).tobytes())
        schema = pa.schema([("tokens", pa.uint16())])
        with pa.OSFile(str(out["arrow"] / f"part{f}.arrow"), "wb") as sink, \
                pa.ipc.RecordBatchFileWriter(sink, schema) as writer:
            for a, b in zip(starts, ends):
                writer.write_batch(pa.record_batch([pa.array(tokens[a:b])], schema=schema))
    return out


def _plain_rate(files: list[Path], seq_len: int, batch: int, seconds: float) -> float:
    arrays = [np.memmap(p, dtype=np.uint16, mode="r") for p in files]
    width, tokens, f, pos = seq_len + 1, 0, 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        rows = []
        for _ in range(batch):
            if pos + width > len(arrays[f]):
                f, pos = (f + 1) % len(arrays), 0
            rows.append(arrays[f][pos:pos + width])
            pos += width
        window = np.stack(rows).astype(np.int64)
        inputs = np.ascontiguousarray(window[:, :-1])
        np.ascontiguousarray(window[:, 1:])  # the labels, as a loader makes them
        tokens += inputs.size
    return tokens / (time.perf_counter() - start)


def _loader_rate(config, tokenizer, kind: str, path: Path, seconds: float) -> float:
    d, b = config.data, int(config.training.local_batch_size)
    spec = SourceSpec(kind, str(path), "bench", f"{kind}:{path}")
    plan = build_plan(config, tokenizer, [spec], [1.0], num_shards=d.num_shards, shuffle=True, max_epochs=None)
    loader = TrainLoader(plan, dp_rank=0, dp_world_size=1, local_batch_size=b, global_batch_size=b)
    next(loader)  # start-up (opening the files, the first blocks) is not throughput
    tokens = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        tokens += next(loader)["input"].numel()
    rate = tokens / (time.perf_counter() - start)
    loader.close()
    return rate


def measure_token_files(config, tokenizer, *, seconds: float = 2.0, seq_lens=(4096, 8192), n_tokens: int = 32 << 20,
                        workdir: str | None = None) -> list[dict[str, Any]]:
    """Rows {seq_len, kind, tokens_per_s, plain_tokens_per_s, vs_plain} (kind "plain" is the memmap floor)."""
    rows = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        paths = write_token_files(Path(tmp), n_tokens, vocab=int(tokenizer.vocab_size), eos=int(tokenizer.eos_id))
        plain_files = sorted(paths["numpy"].glob("*.npy"))
        for seq_len in seq_lens:
            config.training.seq_len = seq_len
            best: dict[str, float] = {}
            for _ in range(2):  # rounds: a burst of load from other processes hits one round, not every contender
                best["plain"] = max(best.get("plain", 0.0), _plain_rate(plain_files, seq_len,
                                                                        config.training.local_batch_size, seconds))
                for kind in KINDS:
                    best[kind] = max(best.get(kind, 0.0), _loader_rate(config, tokenizer, kind, paths[kind], seconds))
            for kind, rate in best.items():
                rows.append({"seq_len": seq_len, "kind": kind, "tokens_per_s": rate,
                             "plain_tokens_per_s": best["plain"], "vs_plain": rate / best["plain"]})
    return rows


def bench_data_files(args, overrides: list[str], workdir: str) -> dict[str, Any]:
    small = args.steps == "small"
    config = load_bench_config(args, overrides, ["--training.local_batch_size", "4", "--data.num_shards", "8"],
                               f"{workdir}/data_files")
    from tokenizer import DEBUG_TOKENIZER_PATH, build_tokenizer

    tokenizer = build_tokenizer(config.model.tokenizer_path or DEBUG_TOKENIZER_PATH)
    rows = measure_token_files(config, tokenizer, seconds=0.3 if small else args.data_seconds,
                               seq_lens=(256,) if small else (4096, 8192), n_tokens=(1 << 20) if small else 32 << 20,
                               workdir=workdir)
    return {"local_batch_size": config.training.local_batch_size, "num_shards": config.data.num_shards,
            "rows": rows, "slowest_vs_plain": min(r["vs_plain"] for r in rows),
            "slowest_tokens_per_s": min(r["tokens_per_s"] for r in rows)}


def format_rows(result: dict[str, Any]) -> str:
    lines = [f"{'seq_len':>8} {'kind':<10} {'tokens/s':>14} {'vs plain memmap':>16}"]
    for r in result["rows"]:
        lines.append(f"{r['seq_len']:>8} {r['kind']:<10} {r['tokens_per_s']:>14,.0f} {r['vs_plain']:>16.3f}")
    return "\n".join(lines)
