"""``trainer bench checkpoint``: the checkpoint code against the disk's own bandwidth at several model sizes
(:mod:`.checkpoint_disk`), then synchronous and asynchronous saves and loads inside a training run of the
debug model (the trainer's ``CheckpointManager``, DCP): how long a background save holds up the loop and how
much it slows the steps that run beside it."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from .common import SMALL, _quiet, _sync, build_trainer, close_trainer, load_bench_config, trainer_steps


class _Run:
    """One trainer with checkpointing on, stepped one step at a time, with timed saves."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.ckpt = trainer.checkpointer
        self.device = trainer.device
        self.step = 0

    def train(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            self.step += 1
            _sync(self.device)
            t0 = time.perf_counter()
            trainer_steps(self.trainer, self.step, 1)
            _sync(self.device)
            times.append(time.perf_counter() - t0)
        return times

    def timed(self, fn) -> float:
        _sync(self.device)
        t0 = time.perf_counter()
        ok = fn()
        _sync(self.device)
        if ok is False:
            raise RuntimeError(f"checkpoint save at step {self.step} failed")
        return time.perf_counter() - t0

    def drain(self) -> list[float]:
        """Train while the background save runs (its thread commits it), then agree on its outcome."""
        times = self.train(1)  # the first step after the save: waits for staging, if the stager makes it wait
        while self.ckpt.pending is not None and not self.ckpt.pending.upload.done() and len(times) < 1000:
            times += self.train(1)
        self.ckpt.finish()
        return times

    def save(self, asynchronous: bool):
        return self.ckpt.save(self.step, kind="full", asynchronous=asynchronous)

    def repeat(self, s: dict[str, list[float]]) -> None:
        """One repeat: steps, a synchronous save, a step, an asynchronous save drained by steps, a load."""
        from trainer.checkpoint.layout import MARKER, tree_size

        ckpt = self.ckpt
        s["normal_step"] += self.train(2)
        # Synchronous: the loop waits for all of it.
        s["sync_save_s"].append(self.timed(lambda: self.save(False)))
        s["nbytes"].append(tree_size(ckpt.folder / f"step-{self.step}"))
        s["normal_step"] += self.train(1)
        # Asynchronous: the loop continues when save() returns; staging and writing may go on after.
        t_call = time.perf_counter()
        s["async_blocking_s"].append(self.timed(lambda: self.save(True)))
        saved = self.step
        done_at: list[float] = []
        job = ckpt.pending
        job.upload.add_done_callback(lambda _f: done_at.append(time.perf_counter()))
        after = self.drain()
        if job.copy_s is not None:
            s["async_copy_s"].append(job.copy_s)
        if done_at:
            s["async_write_s"].append(done_at[0] - t_call)
        s["first_step_after_async_s"].append(after[0])
        s["during_write"] += after[:-1] or after
        marker = json.loads((ckpt.folder / f"step-{saved}" / MARKER).read_text())
        s["async_call_to_commit_s"].append(marker["save_seconds"])
        # Load: the newest complete checkpoint back into the trainer.
        s["load_s"].append(self.timed(lambda: ckpt.load()))
        self.step = self.trainer.state.step


def _checkpoint_mode(args, overrides: list[str], workdir: str, async_mode: str, repeats: int) -> dict[str, Any]:
    """Synchronous and asynchronous saves and loads through one trainer's CheckpointManager."""
    small = args.steps == "small"
    extra = list(SMALL) if small else []
    extra += ["--checkpoint.enable", "true", "--checkpoint.async_mode", async_mode,
              "--checkpoint.interval", "100000", "--checkpoint.keep_latest_k", "2",
              "--checkpoint.folder", "checkpoint"]
    config = load_bench_config(args, overrides, extra, f"{workdir}/checkpoint_{async_mode}")
    config.training.steps = 1_000_000
    trainer = build_trainer(config)
    run = _Run(trainer)
    s: dict[str, list[float]] = {k: [] for k in (
        "sync_save_s", "async_blocking_s", "async_call_to_commit_s", "async_write_s", "load_s",
        "first_step_after_async_s", "nbytes", "normal_step", "during_write", "async_copy_s")}
    with _quiet():
        run.train(2)  # optimizer state exists from here on
        # Warm-up (untimed): the first save of a process pays for imports, planner caches, new files.
        run.save(False)
        run.train(1)
        run.save(True)
        run.drain()
        for _ in range(repeats):
            run.repeat(s)
    close_trainer(trainer)
    return _summary(async_mode, repeats, s)


def _summary(async_mode: str, repeats: int, s: dict[str, list[float]]) -> dict[str, Any]:
    med = statistics.median
    size = med(s["nbytes"])
    step_time = med(s["normal_step"])
    first_extra = max(0.0, med(s["first_step_after_async_s"]) - step_time)
    sync, block, write, load = (s[k] for k in ("sync_save_s", "async_blocking_s", "async_write_s", "load_s"))
    return {
        "async_mode": async_mode, "repeats": repeats, "checkpoint_bytes": size,
        "sync_save_s": med(sync), "async_blocking_s": med(block),
        "async_first_step_extra_s": first_extra, "async_call_to_commit_s": med(s["async_call_to_commit_s"]),
        "load_s": med(load), "async_write_s": med(write) if write else None,
        "async_copy_s": med(s["async_copy_s"]) if s["async_copy_s"] else None,
        "sync_save_gb_per_s": size / med(sync) / 1e9,
        "async_save_gb_per_s": size / med(write) / 1e9 if write else None,
        "load_gb_per_s": size / med(load) / 1e9,
        "async_block_fraction": med(block) / med(sync),
        "async_block_fraction_incl_next_step": (med(block) + first_extra) / med(sync),
        "step_time_s": step_time, "step_time_during_async_write_s": med(s["during_write"]),
        "samples": {k: s[k] for k in ("sync_save_s", "async_blocking_s", "async_call_to_commit_s", "async_write_s",
                                      "load_s", "first_step_after_async_s", "async_copy_s")},
    }


def bench_checkpoint(args, overrides: list[str], workdir: str) -> dict[str, Any]:
    """Both asynchronous modes (``async``: a fresh staging copy per save; ``async_with_pinned_mem``: buffers
    reused from save to save, pinned and filled in the background on CUDA), each on its own trainer; the
    headline is the mode that blocks least. ``copy_reused_vs_fresh``: the save thread's copy in the second
    mode over the first's; ``staging``: the same copy alone at ``--staging-gb`` (:mod:`.staging`)."""
    from .checkpoint_disk import bench_checkpoint_disk
    from .staging import bench_staging

    disk = bench_checkpoint_disk(args, overrides, workdir)
    staging = bench_staging(args, overrides, workdir)
    repeats = 1 if args.steps == "small" else args.checkpoint_repeats
    modes = {m: _checkpoint_mode(args, overrides, workdir, m, repeats) for m in ("async", "async_with_pinned_mem")}
    best = min(modes.values(), key=lambda r: r["async_block_fraction"])
    fresh, reused = (modes[m]["async_copy_s"] for m in ("async", "async_with_pinned_mem"))
    return {"disk": disk, "staging": staging, **{k: v for k, v in best.items() if k != "samples"}, "modes": modes,
            "copy_reused_vs_fresh": reused / fresh if fresh and reused is not None else None}
