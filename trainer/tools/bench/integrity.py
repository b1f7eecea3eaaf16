"""Checkpoint integrity cost: checksum throughput and the time checksums add to a DCP save and a load check.

``trainer bench integrity [--integrity-mb 256] [--checkpoint-repeats 3]`` (or ``python -m
trainer.tools.bench.integrity [--mb 256] [--repeats 3] [--folder DIR]``) prints a table:

- hashing an in-memory buffer (the algorithm alone) and a file on disk (read + hash), in MB/s, for each of
  ``xxh3_128`` and ``sha256``;
- a single-process DCP save of the debug model's weights and AdamW state (plain, and with each checksum
  computed while writing as the trainer does), and verifying that checkpoint as a resume does.

Numbers are medians over the repeats; the folder defaults to a temporary one (put it on the filesystem
whose checkpoints you care about: a page-cache-hot file on tmpfs measures the hash, not the disk).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from trainer.checkpoint import integrity
from trainer.checkpoint.layout import commit


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _debug_state() -> dict:
    """The debug model's weights plus AdamW's two moments per parameter (a full checkpoint's tensors)."""
    from trainer.models.llama.model import build_llama

    with torch.device("meta"):
        model = build_llama("debug_gqa", vocab_size=2048)  # the bundled debug tokenizer's size
    gen = torch.Generator().manual_seed(0)
    state = {}
    for name, p in model.named_parameters():
        for kind in ("model", "exp_avg", "exp_avg_sq"):
            state[f"{kind}.{name}"] = torch.randn(p.shape, generator=gen)
    return state


def _save(state: dict, folder: Path, algo: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    tmp = folder / "step-1.tmp"
    shutil.rmtree(folder, ignore_errors=True)
    writer = FileSystemWriter(str(tmp))
    sums: dict = {}
    if algo != "none":
        writer.fs, sums = integrity.hashing_filesystem(writer.fs, algo)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in one process"
        dcp.save(state, storage_writer=writer)
    commit(tmp, folder / "step-1", {"format": 1, "step": 1, "kind": "full"}, sums, algo)


def _hash_rows(mb: int, repeats: int, folder: Path, algos: list[str]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    data = os.urandom(mb << 20)
    path = folder / "blob.bin"
    path.write_bytes(data)
    for algo in algos:
        def in_memory(algo=algo):
            h = integrity.new_hasher(algo)
            h.update(data)
            h.hexdigest()

        t = _median_time(in_memory, repeats)
        rows.append((f"hash {mb} MiB in memory", algo, f"{mb / t:,.0f} MiB/s"))
        t = _median_time(lambda algo=algo: integrity.file_checksum(path, algo), repeats)
        rows.append((f"read + hash {mb} MiB file", algo, f"{mb / t:,.0f} MiB/s"))
    path.unlink()
    return rows


def run(mb: int, repeats: int, folder: Path) -> list[tuple[str, str, str]]:
    algos = [a for a in ("xxh3_128", "sha256") if integrity.available(a)]
    rows = _hash_rows(mb, repeats, folder, algos)
    state = _debug_state()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    ckpt = folder / "ckpt"
    _save(state, ckpt, "none")  # warm-up: DCP's first save in a process pays for its imports and planning
    base = _median_time(lambda: _save(state, ckpt, "none"), repeats)
    rows.append((f"DCP save, debug model + AdamW ({nbytes / 2**20:.0f} MiB)", "none", f"{base * 1e3:.0f} ms"))
    for algo in algos:
        t = _median_time(lambda algo=algo: _save(state, ckpt, algo), repeats)
        rows.append(("DCP save, hashed while writing", algo, f"{t * 1e3:.0f} ms ({(t - base) * 1e3:+.0f} ms)"))
        marker = json.loads((ckpt / "step-1" / "checkpoint.json").read_text())
        t = _median_time(lambda marker=marker: integrity.verify_files(ckpt / "step-1", marker), repeats)
        rows.append(("verify before loading (1 rank)", algo, f"{t * 1e3:.0f} ms"))
    shutil.rmtree(ckpt, ignore_errors=True)
    return rows


def bench_integrity(args, overrides: list[str], workdir: str) -> dict:
    """The suite entry of ``trainer bench``: the rows of :func:`run`, keyed by what and algorithm."""
    rows = run(getattr(args, "integrity_mb", 256), args.checkpoint_repeats, Path(workdir))
    return {f"{what} [{algo}]": result for what, algo, result in rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.tools.bench.integrity", description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="size of the hashed buffer and file (MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        rows = run(args.mb, args.repeats, Path(tmp))
    width = max(len(r[0]) for r in rows)
    print(f"{'what':<{width}}  {'checksum':<9}  result")
    for what, algo, result in rows:
        print(f"{what:<{width}}  {algo:<9}  {result}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
