"""The step guard: skip the optimizer update of a step whose loss or gradient norm is non-finite or spikes,
and stop the run after too many bad steps in a row.

Everything happens on the device, with no host read on a step that is not logged: the rolling window of
finite (loss, grad norm) pairs, the thresholds, the verdict (a 0-d bool the loop hands to the optimizer,
which then leaves weights and moments untouched) and the counters are device tensors. They are read on
log steps (``metrics``), where skips since the last log are reported and the consecutive-bad-steps stop
is checked, and when a checkpoint saves the guard's state.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from trainer.callbacks import Callback
from trainer.errors import StopTraining

logger = logging.getLogger("trainer")

OK, NONFINITE, SPIKE = 0, 1, 2


class RollingWindow:
    """A ring buffer of the last ``size`` finite ``[loss, grad_norm]`` pairs, kept on the device."""

    def __init__(self, size: int, device: torch.device | str = "cpu"):
        self.size = size
        self.device = torch.device(device)
        self.buf = torch.zeros(2, size, dtype=torch.float32, device=self.device)
        self.pos = torch.zeros((), dtype=torch.int64, device=self.device)  # next slot to write
        self.count = torch.zeros((), dtype=torch.int64, device=self.device)  # filled slots (<= size)
        self._slots = torch.arange(size, device=self.device)

    def thresholds(self, sigma: float) -> torch.Tensor:
        """mean + sigma * std (sample std) of each row over the filled slots; shape [2]."""
        mask = (self._slots < self.count).to(self.buf.dtype)
        n = self.count.to(self.buf.dtype)
        mean = (self.buf * mask).sum(1) / n.clamp(min=1)
        var = (((self.buf - mean[:, None]) * mask) ** 2).sum(1) / (n - 1).clamp(min=1)
        return mean + sigma * var.sqrt()

    def push(self, values: torch.Tensor, accept: torch.Tensor) -> None:
        """Append ``values`` ([2]) if the 0-d bool ``accept`` is true; no host synchronisation."""
        idx = self.pos.view(1)
        old = self.buf.index_select(1, idx)
        new = torch.where(accept, values.to(self.buf.dtype).view(2, 1), old)
        self.buf.index_copy_(1, idx, new)
        step = accept.to(torch.int64)
        self.pos.copy_((self.pos + step) % self.size)
        self.count.copy_(torch.clamp(self.count + step, max=self.size))

    def state(self) -> dict[str, Any]:
        """Host copy of the buffer as it is laid out (so that a reload sums in the same order and gives
        bitwise the same thresholds): the filled slots, the write position and the size."""
        count = int(self.count)
        buf = self.buf[:, :count].cpu().T.tolist()
        return {"slots": buf, "pos": int(self.pos), "size": self.size}

    def load_state(self, state: dict[str, Any]) -> None:
        slots = [list(map(float, v)) for v in state.get("slots", [])]
        pos, size = int(state.get("pos", 0)), int(state.get("size", self.size))
        if size != self.size:  # the window was resized on resume: keep the newest entries, oldest first
            order = range(len(slots)) if len(slots) < size else [(pos + i) % size for i in range(size)]
            slots = [slots[i] for i in order][-self.size:]
            pos = len(slots) % self.size
        self.buf.zero_()
        if slots:
            self.buf[:, : len(slots)] = torch.tensor(slots, dtype=self.buf.dtype).T.to(self.device)
        self.count.fill_(len(slots))
        self.pos.fill_(pos)

    def chronological(self) -> list[list[float]]:
        """The window's pairs, oldest first."""
        st = self.state()
        slots, pos = st["slots"], st["pos"]
        return slots if len(slots) < self.size else [slots[(pos + i) % self.size] for i in range(self.size)]


def global_mean_loss(run, loss: torch.Tensor) -> torch.Tensor:
    """The step's loss over all ranks (summed over pipeline stages, averaged over data-parallel ranks), so
    that every rank makes the same decision. A collective: every rank calls it."""
    from torch.distributed.tensor import DTensor

    loss = loss.detach()
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    return run.global_loss(loss.float().reshape(()))


def find_checkpoints(folder: Path) -> list[int]:
    """Steps of the complete checkpoints in ``folder``, ascending (the checkpoint layout's own scanner)."""
    from trainer.checkpoint.layout import scan_folder

    return sorted({c.step for c in scan_folder(Path(folder)) if c.complete})  # a step-N and its final-step-N: once


def stop_message(config, first_bad: int, last_bad: int, last_reason: str) -> str:
    """What to tell the user when too many bad steps came in a row: which checkpoint to go back to."""
    folder = Path(config.job.dump_folder) / config.checkpoint.folder
    n = last_bad - first_bad + 1
    lines = [
        f"stability: {n} consecutive bad steps (steps {first_bad}-{last_bad}; last: {last_reason}) reached "
        f"stability.max_consecutive_bad_steps = {config.stability.max_consecutive_bad_steps}; stopping the run.",
    ]
    steps = find_checkpoints(folder)
    good = [s for s in steps if s < first_bad]
    if good:
        n_good = good[-1]
        lines.append(f"Last good checkpoint: {folder / f'step-{n_good}'} (step {n_good}, before the first bad step "
                     f"{first_bad}).")
        lines.append(f"To resume from it and skip the bad steps' data, rerun with: --checkpoint.load_step {n_good} "
                     f"--stability.skip_steps={first_bad}-{last_bad} (widen the range as needed; see "
                     f"docs/stability.md).")
    elif steps:
        lines.append(f"No checkpoint before step {first_bad} in {folder} (found steps {steps}); the weights were "
                     f"not updated by the skipped steps, so step-{steps[-1]} holds the last good weights.")
    else:
        why = "" if config.checkpoint.enable else " (checkpoint.enable is false)"
        lines.append(f"No checkpoint in {folder}{why}: nothing to resume from.")
    return "\n".join(lines)


# Device counters, one int64 tensor: totals, the current streak, and the latest verdict.
NONFINITE_TOTAL, SPIKE_TOTAL, STREAK, STREAK_START, LAST_CODE, LAST_BAD_STEP = range(6)
# The latest decision's values, one float tensor: loss, grad norm, their thresholds, the window's fill.
LOSS, GRAD_NORM, LOSS_THRESHOLD, GRAD_NORM_THRESHOLD, WINDOW = range(5)


class StepGuard(Callback):
    """Non-finite guard, spike guard and the consecutive-bad-steps stop, in one decision per step."""

    name = "step_guard"

    def __init__(self, cfg, config=None):
        self.config = config
        self.nonfinite = cfg.nonfinite_guard
        self.spike = cfg.spike_guard
        self.sigma = cfg.spike_sigma
        self.window_size = cfg.spike_window
        self.min_history = cfg.spike_min_history
        self.spike_metric = cfg.spike_metric
        self.max_bad = cfg.max_consecutive_bad_steps
        self.window: RollingWindow | None = None
        self._mask: torch.Tensor | None = None
        self._loaded_window: dict[str, Any] = {}
        self._counts: torch.Tensor | None = None  # int64 [6] on the device, created on the first step
        self._loaded_counts = [0, 0, 0, -1, OK, -1]  # from a checkpoint, until the device is known
        self._last: torch.Tensor | None = None  # float [5]
        self._reported_skips = 0  # guard skips already reported in a log line

    @property
    def enabled(self) -> bool:
        return self.nonfinite or self.spike

    def _watch_mask(self, device: torch.device) -> torch.Tensor:
        # Built once: a host-to-device copy from pageable memory every step would synchronise the stream.
        if self._mask is None or self._mask.device != device:
            watch = {"both": [True, True], "loss": [True, False], "grad_norm": [False, True]}[self.spike_metric]
            self._mask = torch.tensor(watch, device=device)
        return self._mask

    def _window(self, device: torch.device) -> RollingWindow:
        if self.window is None:
            self.window = RollingWindow(self.window_size, device)
            self.window.load_state(self._loaded_window)
        return self.window

    def decide(self, loss: torch.Tensor, grad_norm: torch.Tensor,
               overflow: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Device-side verdict for a step's (global) loss and grad norm, updating the window: the code
        (OK, NONFINITE or SPIKE, int64) and the float [5] of values, thresholds and window fill.
        ``overflow`` (float16's agreed flag, at a finite loss): the loss scaler skips that step, so it is OK
        here and stays out of the window."""
        from torch.distributed.tensor import DTensor

        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        device = loss.device
        vals = torch.stack([loss.detach().float().reshape(()), grad_norm.detach().float().reshape(()).to(device)])
        finite = torch.isfinite(vals).all()
        code = torch.zeros((), dtype=torch.int64, device=device)
        if self.spike:
            window = self._window(device)
            # NaN (logged as null) until the window has two entries and a standard deviation.
            thr = torch.where(window.count >= 2, window.thresholds(self.sigma), float("nan"))
            over = (vals > thr) & self._watch_mask(device)
            spike = over.any() & finite & (window.count >= self.min_history)
            code = torch.where(spike, SPIKE, code)
            count = window.count.to(vals.dtype).view(1)
        else:
            thr = torch.full((2,), float("nan"), device=device)
            count = torch.zeros(1, device=device)
        if self.nonfinite:
            code = torch.where(finite, code, NONFINITE)
        if overflow is not None:
            code = torch.where(overflow, OK, code)
            finite = finite & ~overflow
        if self.spike:
            # Every finite step enters the window, skipped or not (as OLMo-core does): a lasting change of
            # level (e.g. grad norms rising during warmup) widens the window instead of being skipped
            # forever. Non-finite values never enter it.
            window.push(vals, finite)
        return code, torch.cat([vals, thr, count])

    def should_skip(self, run, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor | None:
        if not self.enabled:
            return None
        # float16: a step whose gradients overflowed is the loss scaler's to skip, not a bad step; the counters
        # (and the streak towards max_consecutive_bad_steps) stay as they were. Not so a non-finite loss: the
        # loss is float32 and unscaled, no scale cures it, and a diverged run must still stop.
        scaler = getattr(run, "loss_scaler", None)
        loss = global_mean_loss(run, loss)
        overflow = scaler.found_inf & torch.isfinite(loss) if scaler is not None else None
        code, last = self.decide(loss, grad_norm, overflow)
        if self._counts is None:
            self._counts = torch.tensor(self._loaded_counts, dtype=torch.int64, device=code.device)
        c = self._counts
        bad = code != OK
        streak = torch.where(bad, c[STREAK] + 1, 0)
        self._counts = torch.stack([
            c[NONFINITE_TOTAL] + (code == NONFINITE).long(), c[SPIKE_TOTAL] + (code == SPIKE).long(), streak,
            torch.where(bad, torch.where(c[STREAK] == 0, step, c[STREAK_START]), -1), code,
            torch.where(bad, step, c[LAST_BAD_STEP]),
        ])
        if overflow is not None:
            self._counts = torch.where(overflow, c, self._counts)
        self._last = last
        return bad

    def _host_counts(self) -> list[int]:
        return self._counts.tolist() if self._counts is not None else list(self._loaded_counts)

    def _reason(self, code: int, last: list[float]) -> str:
        lv, gv, lt, gt, count = last
        if code == NONFINITE:
            return f"non-finite loss {lv:.6g} / grad_norm {gv:.6g}"
        parts = []
        if self.spike_metric in ("both", "loss") and lv > lt:
            parts.append(f"loss {lv:.6g} > {lt:.6g}")
        if self.spike_metric in ("both", "grad_norm") and gv > gt:
            parts.append(f"grad_norm {gv:.6g} > {gt:.6g}")
        return (f"spike: {', '.join(parts)} (mean + {self.sigma:g} std of the last {int(count)} steps; "
                f"loss {lv:.6g}, grad_norm {gv:.6g})")

    def metrics(self, run, step: int) -> dict[str, Any]:
        """On a log step: the counters, this step's skip reason, a warning for the skips since the last
        log, and the stop after too many bad steps in a row."""
        if not self.enabled:
            return {}
        counts = self._host_counts()
        last = self._last.tolist() if self._last is not None else [math.nan] * 4 + [0.0]
        out: dict[str, Any] = {"skipped_nonfinite_steps": counts[NONFINITE_TOTAL],
                               "consecutive_bad_steps": counts[STREAK]}
        reason = self._reason(counts[LAST_CODE], last) if counts[LAST_CODE] != OK else None
        if reason is not None and counts[LAST_BAD_STEP] == step:
            out["skip_reason"] = reason
        total = counts[NONFINITE_TOTAL] + counts[SPIKE_TOTAL]
        if total > self._reported_skips and reason is not None:
            new = total - self._reported_skips
            since = "" if new == 1 else f" ({new} steps since the last log)"
            logger.warning("step %d: skipped the optimizer update%s: %s", counts[LAST_BAD_STEP], since, reason)
        self._reported_skips = total
        if self.spike:
            out["skipped_spike_steps"] = counts[SPIKE_TOTAL]
            out["spike_loss_threshold"] = last[LOSS_THRESHOLD] if math.isfinite(last[LOSS_THRESHOLD]) else None
            out["spike_grad_norm_threshold"] = (last[GRAD_NORM_THRESHOLD]
                                                if math.isfinite(last[GRAD_NORM_THRESHOLD]) else None)
            out["spike_window"] = int(last[WINDOW])
        if self.max_bad and counts[STREAK] >= self.max_bad:
            try:  # let an in-flight asynchronous save commit first, so that it can be named
                run.finish_checkpoints()
            except Exception as e:  # noqa: BLE001 - stopping anyway
                logger.warning("finishing the checkpoint in flight failed while stopping: %s", e)
            config = self.config if self.config is not None else run.config
            raise StopTraining(stop_message(config, counts[STREAK_START], counts[LAST_BAD_STEP], reason))
        return out

    def state_dict(self) -> dict[str, Any]:
        if self.window is not None:
            window = self.window.state()
        else:
            window = {"slots": [], "pos": 0, "size": self.window_size, **self._loaded_window}
        counts = self._host_counts()
        return {
            "skipped_nonfinite": counts[NONFINITE_TOTAL],
            "skipped_spike": counts[SPIKE_TOTAL],
            "consecutive_bad": counts[STREAK],
            "streak_start": counts[STREAK_START],
            "window_slots": window["slots"],
            "window_pos": window["pos"],
            "window_size": window["size"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded_counts = [int(state.get("skipped_nonfinite", 0)), int(state.get("skipped_spike", 0)),
                               int(state.get("consecutive_bad", 0)), int(state.get("streak_start", -1)), OK, -1]
        self._counts = None
        self._reported_skips = self._loaded_counts[NONFINITE_TOTAL] + self._loaded_counts[SPIKE_TOTAL]
        self._loaded_window = {"slots": [list(map(float, v)) for v in state.get("window_slots", [])],
                               "pos": int(state.get("window_pos", 0)),
                               "size": int(state.get("window_size", self.window_size))}
        filled = min(len(self._loaded_window["slots"]), self.window_size)
        self._last = torch.tensor([math.nan] * 4 + [float(filled)])
        if self.window is not None:
            self.window.load_state(self._loaded_window)
