"""The one way a checkpoint is saved in the background: a thread of its own that first copies the state
(so that training may change the live tensors again) and then writes the copy.

The call that starts a :class:`BackgroundSave` returns before anything is copied: the thread needs the
GIL only between tensor copies (each ``Tensor.copy_`` releases it), so the training loop's Python runs
beside it, and the optimizer step waits for :attr:`BackgroundSave.staging` (a pre-step hook) before it
changes the weights and moments being copied. Where the copy goes is the :class:`Staging` given:
fresh CPU memory at every save (:class:`FreshStaging`), or with ``async_with_pinned_mem`` buffers reused
from save to save (:class:`ReusedStaging`; pinned on CUDA).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch


def stage_copy(obj: Any, memo: dict[int, torch.Tensor] | None = None,
               copy: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Any:
    """A copy of a state dict whose tensors are in CPU memory: what a background save writes while training
    changes the live tensors. Each plain tensor (a DTensor's local shard) goes through ``copy`` (default: a
    fresh CPU tensor); DTensors stay DTensors of the same mesh, placements and global shape; dicts, lists and
    tuples are copied; other values (numbers, strings, bytes) are immutable and shared. A tensor object that
    appears twice is copied once. Each copy is one ``Tensor.copy_``, which releases the GIL: the training
    loop's Python runs beside it."""
    return _stage(obj, {} if memo is None else memo, copy or _fresh_copy)


def _stage(obj: Any, memo: dict[int, torch.Tensor], copy: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:
            memo[key] = _copy_tensor(obj, copy)
        return memo[key]
    if isinstance(obj, dict):
        return {k: _stage(v, memo, copy) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_stage(v, memo, copy) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_stage(v, memo, copy) for v in obj)
    return obj


def _copy_tensor(t: torch.Tensor, copy: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if isinstance(t, DTensor):
            local = _copy_tensor(t.to_local(), copy)
            return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                      stride=t.stride())
        return copy(t)


def _fresh_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t, device="cpu")
    out.copy_(t)
    return out


class Staging(Protocol):
    """Where a background save copies the state to: ``stage(state)`` returns the copy (called on the
    save's thread); ``close()`` frees what is kept between saves."""

    def stage(self, state: dict) -> dict: ...

    def close(self) -> None: ...


class FreshStaging:
    """A fresh CPU copy at every save (:func:`stage_copy`); nothing is kept between saves."""

    def stage(self, state: dict) -> dict:
        return stage_copy(state)

    def close(self) -> None:
        pass


class ReusedStaging:
    """``async_with_pinned_mem``: one CPU buffer per tensor of the state, allocated at the first save and
    filled again at every later one: memory the size of this rank's state (weights and optimizer moments)
    held for the whole run, no allocation per save. The state walks in the same order at every save, so the
    n-th tensor reuses the n-th buffer (a new one where its shape or dtype changed). ``pinned`` (CUDA): the
    buffers are page-locked and filled by non-blocking copies on a side stream that first waits for the
    compute stream; elsewhere they are ordinary memory filled by plain copies. Created on the training
    thread; its ``stage`` runs on one save's thread at a time (saves never overlap, so no save's buffers
    are overwritten while it writes them). The buffers are the trainer's own rather than DCP's stager's,
    whose copy of the state's non-tensor parts differs between torch releases (torch 2.11's fails on ours)."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._buffers: list[torch.Tensor] = []
        self._stream = torch.cuda.Stream() if pinned else None
        self._compute = torch.cuda.current_stream() if pinned else None

    def stage(self, state: dict) -> dict:
        count = 0

        def into_buffer(t: torch.Tensor) -> torch.Tensor:
            nonlocal count
            if count == len(self._buffers):
                self._buffers.append(self._new(t))
            elif self._buffers[count].shape != t.shape or self._buffers[count].dtype != t.dtype:
                self._buffers[count] = self._new(t)
            buffer = self._buffers[count]
            count += 1
            buffer.copy_(t, non_blocking=self.pinned and t.is_cuda)
            return buffer

        if self._stream is None:
            return stage_copy(state, copy=into_buffer)
        self._stream.wait_stream(self._compute)
        with torch.cuda.stream(self._stream):
            staged = stage_copy(state, copy=into_buffer)
        self._stream.synchronize()
        return staged

    def _new(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pinned)

    def close(self) -> None:
        self._buffers.clear()


@dataclass
class SaveTarget:
    """Where one save goes and what its commit marker says (files and sizes are added at commit)."""

    step: int
    tmp: Path  # written into first
    final: Path  # renamed to at commit
    marker: dict
    t0: float  # when the save call started (perf_counter)


@dataclass
class BackgroundSave:
    """An asynchronous save: started by :meth:`start`, its outcome agreed by the ranks at a defined
    point (:meth:`trainer.checkpoint.saving.Saver.join`).

    ``staging`` completes when the state is copied (the live tensors may change from then on), ``upload``
    with the write's result or exception (the commit included, on rank 0). ``failed``: whether this rank
    knows that the save failed (its copy, or its write); ``done``: whether its thread is over.
    ``blocking_s``: how long the save call kept training waiting, known once the call returns
    (:meth:`call_returned`); rank 0's thread waits for it before writing the commit marker, which records
    it. ``done_s``: seconds from the call to the end of the write, measured on the save's thread."""

    target: SaveTarget
    writer: Any  # the storage writer: its checksums are gathered after the write
    step_now: Callable[[], int] | None = None  # the training step running now (read when the save ends)
    staging: Future = field(init=False, default_factory=Future)
    upload: Future = field(init=False, default_factory=Future)
    blocking_s: float = field(init=False, default=0.0)
    done_s: float | None = field(init=False, default=None)
    copy_s: float | None = field(init=False, default=None)  # the copy alone, on the save's thread
    ended_in_step: int | None = field(init=False, default=None)  # step_now() when the write ended
    _call_over: threading.Event = field(init=False, repr=False, default_factory=threading.Event)
    _thread: threading.Thread | None = field(init=False, repr=False, default=None)

    def start(self, state: dict, staging: Staging,
              write: Callable[[dict | None, BaseException | None], Any]) -> None:
        """Run ``write(staging.stage(state), None)`` on a thread of its own; returns at once. When the copy
        raises, ``write(None, error)`` still runs: it must fail the save on every rank."""
        self._thread = threading.Thread(target=self._run, args=(state, staging, write), name="checkpoint-save")
        self._thread.start()

    def call_returned(self, blocking_s: float) -> None:
        """The save call is over (it blocked training ``blocking_s``): the commit may be written."""
        self.blocking_s = blocking_s
        self._call_over.set()

    def wait_call_returned(self) -> float:
        """On the save's thread: the blocking time, once the call that started the save has returned."""
        self._call_over.wait()
        return self.blocking_s

    @property
    def failed(self) -> bool:
        for f in (self.staging, self.upload):
            if f.done() and f.exception() is not None:
                return True
        return False

    @property
    def done(self) -> bool:
        return self.upload.done()

    def wait(self) -> None:
        """Until the write has finished, successfully or not (its outcome stays in ``upload``)."""
        if self._thread is not None:
            self._thread.join()

    def _run(self, state: dict, staging: Staging, write: Callable[[dict | None, BaseException | None], Any]) -> None:
        t0 = time.perf_counter()
        try:
            staged, copy_error = staging.stage(state), None
            self.copy_s = time.perf_counter() - t0
        except BaseException as e:  # in the staging future here; in the upload's on every rank, by the write
            staged, copy_error = None, e
        del state
        if copy_error is None:
            self.staging.set_result(None)
        else:
            self.staging.set_exception(copy_error)
        try:
            # Even without a copy this rank takes part in the write's collectives (``write`` makes them fail
            # on every rank): the other ranks' threads never wait for it until the checkpoint's timeout.
            result = write(staged, copy_error)
        except BaseException as e:
            del staged
            self._ended()
            self.upload.set_exception(e)
            return
        del staged  # the copy is freed as soon as it is written
        self._ended()
        self.upload.set_result(result)

    def _ended(self) -> None:
        self.done_s = time.perf_counter() - self.target.t0
        self.ended_in_step = self.step_now() if self.step_now is not None else None
