"""The storage writer of every checkpoint save: DCP's ``FileSystemWriter`` that hashes each file while
writing it, writes without the zip CRC, and carries the fault drills (``checkpoint.drill_*``)."""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Iterator

import torch

from trainer.checkpoint.integrity import hashing_filesystem


@contextlib.contextmanager
def zip_crc32_off() -> Iterator[None]:
    """``torch.save`` without its zip CRC-32 on this thread, for the duration of the block.

    DCP writes each tensor as a small ``torch.save`` zip, whose CRC-32 per record costs as much CPU as the
    disk takes to write the bytes, and ``torch.load`` never checks it. The checkpoint's own checksum
    (hashed while writing) covers every byte of every file, so while a writer runs the CRC is not computed
    (with checksum none too: nothing reads it). ``torch.serialization.set_crc32_options`` is a per-thread
    setting in torch 2.13 (a context variable), so other threads' ``torch.save`` keep their CRC; where a
    torch keeps it process-wide, the setting is restored when the save ends, and saves never overlap. With
    ``checkpoint.save_threads`` > 1, the extra writer threads DCP starts do not inherit it and compute the
    CRC (their files cost that CPU; nothing else changes)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


@functools.cache
def _writer_class():
    # DCP is imported on the first save, not when the checkpoint package is.
    from torch.distributed.checkpoint import FileSystemWriter

    class CheckpointWriter(FileSystemWriter):
        """See :func:`new_writer`."""

        def __init__(self, path: str, *, delay_s: float, fail: bool, checksum: str, thread_count: int):
            super().__init__(path, thread_count=thread_count)
            self.delay_s = delay_s
            self.fail = fail
            self.sums: dict[str, dict] = {}  # {file: {size, checksum}} of the files this rank wrote
            self.abort: BaseException | None = None  # raised while planning: this rank has nothing to write
            if checksum != "none":
                self.fs, self.sums = hashing_filesystem(self.fs, checksum)

        def prepare_local_plan(self, plan):
            # DCP gathers every rank's plan (or its exception) before anyone writes: raising here fails the
            # save on every rank at once.
            if self.abort is not None:
                raise self.abort
            return super().prepare_local_plan(plan)

        def write_data(self, plan, planner):
            if self.delay_s > 0:
                time.sleep(self.delay_s)
            if self.fail:
                raise OSError(f"fault drill: injected write failure (checkpoint.drill_fail_save_steps) in {self.path}")
            with zip_crc32_off():
                return super().write_data(plan, planner)

    return CheckpointWriter


def new_writer(path: str, *, checksum: str, thread_count: int, delay_s: float = 0.0, fail: bool = False):
    """A DCP storage writer of ``path`` whose ``sums`` fill with ``{file: {"size", "checksum"}}`` of the
    ``.distcp`` files it writes (hashed as the bytes go out, nothing read back; empty with checksum
    none). ``delay_s`` and ``fail`` are the fault drills: a slow save, a failing one. Setting ``abort`` to an
    exception before the save makes this rank's planning raise it (a background save whose copy failed)."""
    return _writer_class()(path, delay_s=delay_s, fail=fail, checksum=checksum, thread_count=thread_count)
