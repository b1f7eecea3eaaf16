"""A process's start-up, around its imports (torch's above all, which take seconds). Torch-free.

An entry point calls :func:`begin` before its heavy imports and :func:`imports_done` after them:

- Ctrl-C during start-up is one line and exit 130 (trainer/interrupt.py);
- the garbage collector waits while the imports run. They build about a quarter of a million objects that
  live as long as the process (torch's operators, modules, functions); each collection they set off would walk
  them again. Once they are in, they are frozen (``gc.freeze``: never walked again), so the collections of the
  set-up and of the loop (a young generation every ``training.gc_freq`` steps) only see what the run itself
  makes, and the collector resumes. ``python -m trainer.train --help`` went from 2.7 to 1.8 CPU-seconds, the
  launcher's from 1.7 to 1.2.

:func:`imports_done` does nothing in a process whose entry point did not call :func:`begin` (a test that
imports a module and calls its ``main``): freezing is the process's choice, not a library's.
"""

from __future__ import annotations

import gc

from trainer.interrupt import LINE, quiet_keyboard_interrupt

_paused = False


def begin(interrupt_line: str = LINE) -> None:
    """First thing in an entry point (``if __name__ == "__main__":`` before the imports)."""
    global _paused
    quiet_keyboard_interrupt(interrupt_line)
    if gc.isenabled():
        gc.disable()
        _paused = True


def imports_done() -> None:
    """After the entry point's imports: freeze what they made, resume collecting."""
    global _paused
    if _paused:
        gc.freeze()
        gc.enable()
        _paused = False
