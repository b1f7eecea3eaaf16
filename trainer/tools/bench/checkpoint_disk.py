"""``trainer bench checkpoint``, against the disk: what the checkpoint code reaches of the filesystem's own
sequential bandwidth, for model sizes from the debug model up to what fits in this machine's memory.

For each size (a model in bfloat16 with AdamW's two moments, also bfloat16: a full checkpoint's tensors)
and each checksum setting (``xxh3_128``, the default, and ``none``), in one process on one filesystem:

* ``raw write``: a plain file of the checkpoint's size written sequentially in 8 MiB chunks, then fsync'ed
  (what DCP does with each file); ``raw read``: that file read back in 8 MiB chunks after
  ``posix_fadvise(DONTNEED)`` asked the kernel to drop its cached pages (so that the read comes from the
  disk, not from memory; where the call is missing the read may be served from the page cache, and the
  results say so);
* ``sync save``: :meth:`CheckpointManager.save` (DCP write, checksums, commit marker, atomic rename);
* ``async``: the same save in the background: how long the call blocks the caller (``async blocking``),
  when the state has been copied and may change again (``async staged``), and call to commit;
* ``load``: :meth:`CheckpointManager.load` of that checkpoint (with verification when checksums are on),
  after dropping its files' cached pages as for the raw read;
* ``verify``: :func:`trainer.checkpoint.integrity.verify_files` over the whole checkpoint (what ``trainer
  checkpoint verify`` does), cache dropped likewise.

Each time is also given as a fraction of the raw bandwidth measured around it, at the same size (raw
writes just before and after each save, raw reads before the verify and after the load; a shared
machine's disk changes from minute to minute): ``save_vs_raw_write = (bytes / save time) / raw write
bandwidth`` and ``load_vs_raw_read`` alike, medians over the repeats of each repeat's ratio.
Sizes whose checkpoint (twice: the live state and the background save's copy) would take more than
60% of the memory available are skipped, and the results say so.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

CHUNK = 8 << 20
DEFAULT_SIZES = ("debugmodel", "llama3_1b_4l", "llama3_1b_8l", "llama3_1b")
SMALL_SIZES = ("debugmodel",)
ALGOS = ("xxh3_128", "none")
FADVISE = hasattr(os, "posix_fadvise")


# --------------------------------------------------------------------------------------------------
# The disk
# --------------------------------------------------------------------------------------------------


def drop_cache(path: Path) -> bool:
    """Ask the kernel to drop the cached pages of ``path`` (a file, or every file under a folder). False
    when this platform cannot (then a read may come from memory)."""
    if not FADVISE:
        return False
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def raw_write(path: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` sequentially to a new file and fsync it."""
    buf = torch.randint(0, 256, (CHUNK,), dtype=torch.uint8).numpy().tobytes()
    view = memoryview(buf)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, view[:min(left, CHUNK)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def raw_read(path: Path) -> float:
    """Seconds to read ``path`` sequentially (after dropping its cached pages)."""
    drop_cache(path)
    buf = bytearray(CHUNK)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------------
# One model size
# --------------------------------------------------------------------------------------------------


class _Loader:
    """A data loader's checkpoint interface with nothing behind it."""

    def state_dict(self) -> dict:
        return {"sample": 0}

    def merge_states(self, states: list) -> dict:
        return states[0]

    def load_global_state(self, state: dict) -> None:
        pass


class _Callbacks:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


def _model_args(size: str):
    from trainer.models.config import get_model_args

    args = get_model_args("llama3", size)
    if args.vocab_size <= 0:
        args.vocab_size = 2048  # the bundled debug tokenizer's
    return args


def size_params(size: str) -> int:
    from trainer.models.llama.model import Transformer

    with torch.device("meta"):
        model = Transformer(_model_args(size))
    return sum(p.numel() for p in model.parameters())


def _build(size: str):
    """A bfloat16 model of ``size`` and AdamW with its two moments (bfloat16, like the weights) filled."""
    from trainer.models.llama.model import Transformer

    with torch.device("meta"):
        model = Transformer(_model_args(size))
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.02, 0.02, generator=gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": p.detach().clone(),
                              "exp_avg_sq": p.detach().clone().abs_()}
    for buf in model.buffers():
        buf.zero_()
    return model, optimizer


def _manager(config, model, optimizer):
    from trainer.checkpoint.manager import CheckpointManager
    from trainer.checkpoint.state import TrainState

    return CheckpointManager(config, model_parts=[model], optimizer=optimizer, train_state=TrainState(),
                             data_loader=_Loader(), callbacks=_Callbacks(), device=torch.device("cpu"),
                             num_params=sum(p.numel() for p in model.parameters()))


def _timed(fn) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _state_bytes(model, optimizer) -> int:
    """Bytes of the tensors a full checkpoint holds (the raw files are written at this size)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return total


def _one_setting(config, model, optimizer, folder: Path, repeats: int, first_step: int) -> dict[str, list[float]]:
    """Save (sync, async), load and verify a checkpoint ``repeats`` times. Each save is bracketed by two raw
    writes of the same size, each verify and load by two raw reads (a shared machine's disk changes from
    minute to minute): a repeat's ratio compares an operation with the mean of the raw figures around it."""
    import json

    from trainer.checkpoint.integrity import verify_files
    from trainer.checkpoint.layout import MARKER

    s: dict[str, list[float]] = {k: [] for k in (
        "bytes", "raw_bytes", "raw_write_s", "raw_read_s", "sync_save_s", "async_blocking_s", "async_staged_s",
        "async_commit_s", "load_s", "verify_s", "save_vs_raw_write", "load_vs_raw_read", "verify_vs_raw_read",
        "async_commit_vs_raw_write")}
    manager = _manager(config, model, optimizer)
    step = first_step
    raw = folder.parent / "raw.bin"
    raw_bytes = _state_bytes(model, optimizer)
    for _ in range(repeats):
        s["raw_bytes"].append(raw_bytes)
        # Synchronous save between two raw writes.
        w0 = raw_write(raw, raw_bytes)
        ok, t = _timed(lambda: manager.save(step, asynchronous=False))
        if not ok:
            raise RuntimeError(f"checkpoint save of step {step} failed (see the log)")
        w1 = raw_write(raw, raw_bytes)
        path = manager.folder / f"step-{step}"
        marker = json.loads((path / MARKER).read_text())
        nbytes = marker["bytes"]
        raw_w = (w0 + w1) / 2
        s["sync_save_s"].append(t)
        s["bytes"].append(nbytes)
        s["raw_write_s"].append(raw_w)
        s["save_vs_raw_write"].append((nbytes / t) / (raw_bytes / raw_w))
        # Verification alone (trainer checkpoint verify; with checksums) and a load, between two raw reads,
        # each from the disk.
        r0 = raw_read(raw)
        v = None
        if marker.get("checksum", "none") != "none":
            drop_cache(path)
            bad, v = _timed(lambda: verify_files(path, marker))
            if bad:
                raise RuntimeError(f"verification of {path} failed: {bad}")
        drop_cache(path)
        _, t = _timed(manager.load)
        if manager.loaded_step != step:
            raise RuntimeError(f"loading {manager.folder} gave step {manager.loaded_step}, not {step}")
        r1 = raw_read(raw)
        raw_r = (r0 + r1) / 2
        s["raw_read_s"].append(raw_r)
        s["load_s"].append(t)
        s["load_vs_raw_read"].append((nbytes / t) / (raw_bytes / raw_r))
        if v is not None:
            s["verify_s"].append(v)
            s["verify_vs_raw_read"].append((nbytes / v) / (raw_bytes / raw_r))
        shutil.rmtree(path)
        # Asynchronous save: blocking, staged (the state may change), committed.
        step += 1
        t0 = time.perf_counter()
        if not manager.save(step, asynchronous=True):
            raise RuntimeError(f"background checkpoint save of step {step} failed to start")
        s["async_blocking_s"].append(time.perf_counter() - t0)
        manager.saver.wait_staging()
        s["async_staged_s"].append(time.perf_counter() - t0)
        manager.finish()
        s["async_commit_s"].append(time.perf_counter() - t0)
        s["async_commit_vs_raw_write"].append((nbytes / s["async_commit_s"][-1]) / (raw_bytes / raw_w))
        if not manager.saver.has_committed(step):
            raise RuntimeError(f"background checkpoint save of step {step} failed (see the log)")
        shutil.rmtree(manager.folder / f"step-{step}")
        raw.unlink()
        step += 1
    manager.finish()
    return s


def _summary(s: dict[str, list[float]]) -> dict[str, Any]:
    """Medians over the repeats (of each repeat's ratio, for the ratios)."""
    med = statistics.median
    size = med(s["bytes"])
    out: dict[str, Any] = {"checkpoint_bytes": size,
                           "raw_write_gb_per_s": med(s["raw_bytes"]) / med(s["raw_write_s"]) / 1e9,
                           "raw_read_gb_per_s": med(s["raw_bytes"]) / med(s["raw_read_s"]) / 1e9}
    for key in ("sync_save_s", "async_blocking_s", "async_staged_s", "async_commit_s", "load_s", "verify_s",
                "save_vs_raw_write", "async_commit_vs_raw_write", "load_vs_raw_read", "verify_vs_raw_read"):
        out[key] = med(s[key]) if s[key] else None  # no verify rows with checksums off (sizes only)
    out["async_block_fraction"] = med(b / t for b, t in zip(s["async_blocking_s"], s["sync_save_s"]))
    out["async_staged_fraction"] = med(b / t for b, t in zip(s["async_staged_s"], s["sync_save_s"]))
    out["samples"] = s
    return out


def _mem_available() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def bench_checkpoint_disk(args, overrides: list[str], workdir: str) -> dict[str, Any]:
    """Every size (``--checkpoint-sizes``) with each checksum setting; see the module's docstring."""
    from .common import _quiet, load_bench_config

    small = args.steps == "small"
    sizes = (getattr(args, "checkpoint_sizes", None) or ",".join(SMALL_SIZES if small else DEFAULT_SIZES)).split(",")
    repeats = 1 if small else max(1, min(3, getattr(args, "checkpoint_repeats", 3)))
    base = Path(getattr(args, "checkpoint_folder", None) or workdir) / "checkpoint_disk"
    available = _mem_available()
    result: dict[str, Any] = {
        "folder": str(base), "page_cache_dropped": FADVISE,
        "cache_note": ("reads after posix_fadvise(DONTNEED) on the files read" if FADVISE else
                       "no posix_fadvise on this platform: reads may come from the page cache"),
        "mem_available_bytes": available, "sizes": {}, "skipped": {}}
    step, warm_up = 1, True
    for size in sizes:
        params = size_params(size)
        need = 2 * 3 * 2 * params  # live bf16 weights + two moments, and the background save's copy of them
        if available is not None and need > 0.6 * available:
            result["skipped"][size] = (f"{params / 1e9:.2f}B parameters: a full bf16 checkpoint with its "
                                       f"background copy needs ~{need / 2**30:.1f} GiB, more than 60% of the "
                                       f"{available / 2**30:.1f} GiB available")
            continue
        model, optimizer = _build(size)
        entry: dict[str, Any] = {"params": params}
        for algo in ALGOS:
            folder = base / f"{size}_{algo}"
            extra = ["--checkpoint.enable", "true", "--checkpoint.async_mode", "async", "--checkpoint.checksum",
                     algo, "--checkpoint.keep_latest_k", "0", "--checkpoint.folder", "checkpoint"]
            config = load_bench_config(args, overrides, extra, str(folder))
            folder.mkdir(parents=True, exist_ok=True)
            with _quiet():
                if warm_up:  # the first save of a process pays for imports and planner caches: untimed
                    _one_setting(config, model, optimizer, folder / "checkpoint", 1, step)
                    warm_up = False
                s = _one_setting(config, model, optimizer, folder / "checkpoint", repeats, step + 10)
            step += 10 + 2 * repeats
            entry[algo] = _summary(s)
            shutil.rmtree(folder, ignore_errors=True)
        result["sizes"][size] = entry
        del model, optimizer
        gc.collect()
    return result


ROW_KEYS = (
    ("raw write GB/s", "raw_write_gb_per_s", "{:.3f}"),
    ("raw read GB/s", "raw_read_gb_per_s", "{:.3f}"),
    ("sync save (s)", "sync_save_s", "{:.3f}"),
    ("sync save / raw write", "save_vs_raw_write", "{:.3f}"),
    ("async blocking (s)", "async_blocking_s", "{:.3f}"),
    ("async blocking / sync save", "async_block_fraction", "{:.3f}"),
    ("async staged (s)", "async_staged_s", "{:.3f}"),
    ("async staged / sync save", "async_staged_fraction", "{:.3f}"),
    ("async call to commit / raw write", "async_commit_vs_raw_write", "{:.3f}"),
    ("load (s)", "load_s", "{:.3f}"),
    ("load / raw read", "load_vs_raw_read", "{:.3f}"),
    ("verify (s)", "verify_s", "{:.3f}"),
    ("verify / raw read", "verify_vs_raw_read", "{:.3f}"),
)

# Targets of the ratios (docs/benchmarks.md): (comparison, bound).
DISK_TARGETS = {"save_vs_raw_write": (">=", 0.7), "load_vs_raw_read": (">=", 0.7),
                "async_block_fraction": ("<=", 0.05)}


def disk_rows(result: dict[str, Any]) -> list[tuple[str, Any, str, str | None]]:
    """(row name, value, format, metric with a target) of every size and checksum setting."""
    rows: list[tuple[str, Any, str, str | None]] = [("checkpoint vs disk: reads", result["cache_note"], "{}", None)]
    for size, entry in result["sizes"].items():
        for algo in ALGOS:
            m = entry.get(algo)
            if m is None:
                continue
            tag = f"ckpt {size} {m['checkpoint_bytes'] / 1e6:,.0f} MB, {algo}"
            for name, key, fmt in ROW_KEYS:
                rows.append((f"{tag}: {name}", "-" if m[key] is None else m[key], fmt,
                             key if key in DISK_TARGETS else None))
    for size, why in result.get("skipped", {}).items():
        rows.append((f"checkpoint {size}", f"skipped: {why}", "{}", None))
    return rows
