"""Ctrl-C before the training loop handles it: one line instead of a traceback, exit 130.

The loop turns SIGINT into "save, then stop" (trainer/preemption.py). Before that (the imports, torch's
above all, which take seconds; building the model; loading a checkpoint) and in the ``trainer`` commands,
Python raises ``KeyboardInterrupt`` wherever the process happens to be. :func:`quiet_keyboard_interrupt`
makes an uncaught one print a single line; the process still ends by SIGINT, so the shell sees 130 and a
torchrun agent sees a worker stopped by SIGINT. Torch-free: it is installed before ``import torch``.
"""

from __future__ import annotations

import os
import sys

LINE = "interrupted (Ctrl-C) before training started or outside the training loop: nothing was saved for it"


def quiet_keyboard_interrupt(line: str = LINE) -> None:
    """An uncaught ``KeyboardInterrupt`` prints ``line`` (nothing in a torchrun worker, whose launcher
    reports the signal once for the job); any other exception keeps its traceback. Installing it again
    only changes the line."""
    previous = getattr(sys.excepthook, "previous", sys.excepthook)

    def hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt):
            if "LOCAL_RANK" not in os.environ:
                print(line, file=sys.stderr)
            return
        previous(kind, value, tb)

    hook.previous = previous
    sys.excepthook = hook
