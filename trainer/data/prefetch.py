"""A background thread that prepares the next micro-batches while the current step computes.

The training thread then only takes a ready batch from a queue: loading, tokenizing, packing, pinning and
the batch fingerprint of step N+1 overlap step N instead of leaving the GPU idle between steps. Each item
carries the loader state *after* it, so a checkpoint records exactly the batches the model consumed, never
the ones prepared ahead.
"""

from __future__ import annotations

import inspect
import queue
import threading
import weakref
from typing import Any, Callable

_POLL_S = 0.1  # how often a blocked producer checks whether it was stopped


class Prefetcher:
    """Runs ``produce()`` on a daemon thread, keeping up to ``depth`` results ready. An exception in
    ``produce`` is raised by the ``get()`` that would have returned its result.

    A bound method is held weakly: the thread does not keep its loader alive, and it ends by itself when
    the loader is dropped without :meth:`close`."""

    def __init__(self, produce: Callable[[], Any], depth: int):
        self._produce = weakref.WeakMethod(produce) if inspect.ismethod(produce) else (lambda: produce)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batch-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set() and self._produce() is not None:
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                produce = self._produce()
                if produce is None:  # the loader is gone
                    return
                item = produce()
                del produce  # hold the loader only while producing
                if not self._put((True, item)):
                    return
        except BaseException as e:  # handed to the consumer, who raises it where the batch was expected
            self._put((False, e))

    def get(self) -> Any:
        ok, item = self._queue.get()
        if not ok:
            self.close()
            raise item
        return item

    def close(self) -> None:
        """Stop the thread and drop what it prepared."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=30)
