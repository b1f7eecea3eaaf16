"""The step guard: skip the optimizer update of a step whose loss or gradient norm is non-finite or spikes,
and stop the run after too many bad steps in a row.

The decision is made on the device: the rolling window of finite (loss, grad norm) pairs is a device
tensor updated with ``torch.where``/``index_copy_``, the thresholds and the verdict are device tensors,
and the only host-device synchronisation is one ``tolist()`` of a 6-element tensor per step (the loop
needs a host boolean to decide whether to call ``optimizer.step()``, to count skips and to log them).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.callbacks import Callback

logger = logging.getLogger("trainer")

OK, NONFINITE, SPIKE = 0, 1, 2


class StopTraining(SystemExit):
    """Ends the run with a non-zero exit status (3) after the message has been logged."""

    def __init__(self, message: str):
        super().__init__(3)
        self.message = message

    def __str__(self) -> str:
        return self.message


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


def global_mean_loss(trainer, loss: torch.Tensor) -> torch.Tensor:
    """The step's loss over all ranks (summed over pipeline stages, averaged over data-parallel ranks), so
    that every rank makes the same decision. A collective: every rank calls it."""
    from torch.distributed.tensor import DTensor

    loss = loss.detach()
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    loss = loss.float().reshape(())
    reduce = getattr(trainer, "global_loss", None)
    if reduce is not None:
        return reduce(loss)
    dims = getattr(trainer, "dims", None)
    if dims is not None and dims.dp > 1:
        loss = loss.clone()
        dist.all_reduce(loss, group=dims.dp_mesh.get_group())
        loss = loss / dims.dp
    return loss


def find_checkpoints(folder: Path) -> list[int]:
    """Steps of the complete ``step-N`` checkpoints in ``folder``, ascending (the checkpoint layout's own
    scanner: commit marker present, files whole)."""
    from trainer.checkpoint import scan_folder

    return [c.step for c in scan_folder(Path(folder)) if c.complete]


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


class StepGuard(Callback):
    """Non-finite guard, spike guard and the consecutive-bad-steps stop, in one decision per step."""

    name = "step_guard"

    def __init__(self, cfg, config=None):
        from trainer.config import ConfigError

        self.config = config
        self.nonfinite = cfg.nonfinite_guard
        self.spike = cfg.spike_guard
        self.sigma = cfg.spike_sigma
        self.window_size = cfg.spike_window
        self.min_history = cfg.spike_min_history
        self.spike_metric = cfg.spike_metric
        self.max_bad = cfg.max_consecutive_bad_steps
        if self.spike:
            if self.window_size < 2:
                raise ConfigError(f"stability.spike_window must be >= 2, got {self.window_size}")
            if not 2 <= self.min_history <= self.window_size:
                raise ConfigError(f"stability.spike_min_history must be in [2, spike_window={self.window_size}], "
                                  f"got {self.min_history}")
            if self.sigma <= 0:
                raise ConfigError(f"stability.spike_sigma must be > 0, got {self.sigma}")
        if self.max_bad < 0:
            raise ConfigError(f"stability.max_consecutive_bad_steps must be >= 0, got {self.max_bad}")
        self.window: RollingWindow | None = None
        self._mask: torch.Tensor | None = None
        self._loaded_window: dict[str, Any] = {}
        # Host-side counters (checkpointed).
        self.skipped_nonfinite = 0
        self.skipped_spike = 0
        self.consecutive_bad = 0
        self.streak_start: int | None = None
        # The latest decision's host values, for metrics.
        self._last: dict[str, Any] = {}

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

    def decide(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> list[float]:
        """Device-side verdict for a step's (global) loss and grad norm, updating the window; returns
        [code, loss, grad_norm, loss_threshold, grad_norm_threshold, window_count] on the host (the sync)."""
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
        if self.spike:
            # Every finite step enters the window, skipped or not (as OLMo-core does): a lasting change of
            # level (e.g. grad norms rising during warmup) widens the window instead of being skipped
            # forever. Non-finite values never enter it.
            window.push(vals, finite)
        host = torch.cat([code.to(vals.dtype).view(1), vals, thr, count]).tolist()  # the one sync per step
        return host

    def should_skip(self, trainer, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> str | None:
        if not self.enabled:
            return None
        code, lv, gv, lt, gt, count = self.decide(global_mean_loss(trainer, loss), grad_norm)
        code = int(code)
        self._last = {"loss_threshold": lt, "grad_norm_threshold": gt, "window": int(count)}
        if code == OK:
            self.consecutive_bad = 0
            self.streak_start = None
            return None
        self.consecutive_bad += 1
        if self.streak_start is None:
            self.streak_start = step
        if code == NONFINITE:
            self.skipped_nonfinite += 1
            reason = f"non-finite loss {lv:.6g} / grad_norm {gv:.6g}"
        else:
            self.skipped_spike += 1
            parts = []
            if self.spike_metric in ("both", "loss") and lv > lt:
                parts.append(f"loss {lv:.6g} > {lt:.6g}")
            if self.spike_metric in ("both", "grad_norm") and gv > gt:
                parts.append(f"grad_norm {gv:.6g} > {gt:.6g}")
            reason = (f"spike: {', '.join(parts)} (mean + {self.sigma:g} std of the last {int(count)} steps; "
                      f"loss {lv:.6g}, grad_norm {gv:.6g})")
        logger.warning("step %d: skipping the optimizer update: %s", step, reason)
        if self.max_bad and self.consecutive_bad >= self.max_bad:
            finish = getattr(getattr(trainer, "checkpointer", None), "finish", None)
            if finish is not None:
                try:  # let an in-flight asynchronous save commit first, so that it can be named
                    finish()
                except Exception as e:  # noqa: BLE001 - stopping anyway
                    logger.warning("checkpointer.finish() failed while stopping: %s", e)
            config = self.config if self.config is not None else trainer.config
            message = stop_message(config, self.streak_start, step, reason)
            logger.error(message)
            raise StopTraining(message)
        return reason

    def metrics(self, trainer, step: int) -> dict[str, Any]:
        if not self.enabled:
            return {}
        out: dict[str, Any] = {
            "skipped_nonfinite_steps": self.skipped_nonfinite,
            "consecutive_bad_steps": self.consecutive_bad,
        }
        if self.spike:
            out["skipped_spike_steps"] = self.skipped_spike

            def num(x):
                return None if x is None or not math.isfinite(x) else x

            out["spike_loss_threshold"] = num(self._last.get("loss_threshold"))
            out["spike_grad_norm_threshold"] = num(self._last.get("grad_norm_threshold"))
            out["spike_window"] = self._last.get("window", 0)
        return out

    def state_dict(self) -> dict[str, Any]:
        if self.window is not None:
            window = self.window.state()
        else:
            window = {"slots": [], "pos": 0, "size": self.window_size, **self._loaded_window}
        return {
            "skipped_nonfinite": self.skipped_nonfinite,
            "skipped_spike": self.skipped_spike,
            "consecutive_bad": self.consecutive_bad,
            "streak_start": -1 if self.streak_start is None else self.streak_start,
            "window_slots": window["slots"],
            "window_pos": window["pos"],
            "window_size": window["size"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_nonfinite = int(state.get("skipped_nonfinite", 0))
        self.skipped_spike = int(state.get("skipped_spike", 0))
        self.consecutive_bad = int(state.get("consecutive_bad", 0))
        start = int(state.get("streak_start", -1))
        self.streak_start = None if start < 0 else start
        self._loaded_window = {"slots": [list(map(float, v)) for v in state.get("window_slots", [])],
                               "pos": int(state.get("window_pos", 0)),
                               "size": int(state.get("window_size", self.window_size))}
        self._last = {"window": min(len(self._loaded_window["slots"]), self.window_size)}
        if self.window is not None:
            self.window.load_state(self._loaded_window)
