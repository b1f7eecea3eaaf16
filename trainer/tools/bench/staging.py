"""``trainer bench checkpoint`` (and ``trainer bench staging`` alone): the copy a background save makes of the
state, with a fresh copy at every save (``checkpoint.async_mode async``) against buffers reused from save to
save (``async_with_pinned_mem``: pinned on CUDA, ordinary memory elsewhere), through the trainer's own
staging classes (:mod:`trainer.checkpoint.background`), on tensors of the training device, in the same run.

The state is ``--staging-gb`` GB of float32 tensors (weights and two moments, in 48 tensors as a sharded
model's state is several), on CUDA when there is one. Each repeat times one copy of each kind, the order
alternating from repeat to repeat, device synchronised around each; the reused kind's first copy (which
allocates, and on CUDA pins, its buffers) is timed apart, untimed warm-up otherwise. ``reused_vs_fresh``
is the median reused copy time over the median fresh one (below 1: reuse is faster).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch

from .common import _sync

TENSORS = 48


def make_state(nbytes: int, device: torch.device) -> dict:
    """A state dict of about ``nbytes`` of float32 tensors on ``device``: {"model": ..., "optimizer": ...}
    with one weight and its two moments per entry."""
    per = max(1, nbytes // (4 * TENSORS))
    gen = torch.Generator(device=device).manual_seed(0)
    model, optim = {}, {}
    for i in range(TENSORS // 3):
        model[f"w{i}"] = torch.rand(per, generator=gen, device=device)
        optim[f"w{i}"] = {"exp_avg": torch.rand(per, generator=gen, device=device),
                          "exp_avg_sq": torch.rand(per, generator=gen, device=device)}
    return {"model": model, "optimizer": optim}


def _timed_copy(staging, state: dict, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    staged = staging.stage(state)
    _sync(device)
    seconds = time.perf_counter() - t0
    del staged
    return seconds


def measure_staging(nbytes: int, repeats: int, device: torch.device | None = None) -> dict[str, Any]:
    """Fresh against reused staging of ``nbytes`` on ``device`` (CUDA when available); see the module."""
    from trainer.checkpoint.background import FreshStaging, ReusedStaging

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    state = make_state(nbytes, device)
    size = sum(t.numel() * t.element_size() for t in _tensors(state))
    fresh, reused = FreshStaging(), ReusedStaging(pinned=device.type == "cuda")
    try:
        first_reused = _timed_copy(reused, state, device)  # allocates (and pins) the buffers
        _timed_copy(fresh, state, device)  # warm-up: the allocator's first large blocks
        gc.collect()
        times: dict[str, list[float]] = {"fresh": [], "reused": []}
        for i in range(repeats):
            order = ("fresh", "reused") if i % 2 == 0 else ("reused", "fresh")
            for kind in order:
                times[kind].append(_timed_copy(fresh if kind == "fresh" else reused, state, device))
                gc.collect()  # a fresh copy is freed before the next copy starts
    finally:
        reused.close()
    med = statistics.median
    f, r = med(times["fresh"]), med(times["reused"])
    return {"device": str(device), "pinned": reused.pinned, "bytes": size, "repeats": repeats,
            "fresh_copy_s": f, "reused_copy_s": r, "reused_first_copy_s": first_reused,
            "reused_vs_fresh": r / f, "fresh_gb_per_s": size / f / 1e9, "reused_gb_per_s": size / r / 1e9,
            "samples": times}


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    return []


def bench_staging(args, overrides: list[str], workdir: str) -> dict[str, Any]:
    """The suite's entry: ``--staging-gb`` (0.02 with ``--steps small``) and ``--checkpoint-repeats``."""
    small = args.steps == "small"
    gb = 0.02 if small else getattr(args, "staging_gb", 1.0)
    repeats = 2 if small else max(2, getattr(args, "checkpoint_repeats", 5))
    return measure_staging(int(gb * 1e9), repeats)


def staging_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, value) rows of the table."""
    tag = f"staging {s['bytes'] / 1e9:.2f} GB on {s['device']}"
    kind = "pinned" if s["pinned"] else "not pinned: no CUDA"
    return [
        (f"{tag}: fresh copy per save (s) [async]", f"{s['fresh_copy_s']:.3f}"),
        (f"{tag}: reused buffers (s) [async_with_pinned_mem, {kind}]", f"{s['reused_copy_s']:.3f}"),
        (f"{tag}: reused buffers, first copy (allocates) (s)", f"{s['reused_first_copy_s']:.3f}"),
        (f"{tag}: reused / fresh copy time", f"{s['reused_vs_fresh']:.3f}"),
        (f"{tag}: GB/s fresh / reused", f"{s['fresh_gb_per_s']:.2f} / {s['reused_gb_per_s']:.2f}"),
    ]
