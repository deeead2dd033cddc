"""Waiting for the CPU worker: ``flush``, ``wait_grads``, ``wait_task``, ``wait_event``.

:class:`EngineWaits` is mixed into :class:`~megatrain.runtime.engine.core.Engine`. Every wait re-raises
a failure of the CPU worker instead of hanging (``_Worker.check``); ``flush`` and ``wait_grads``
then apply the outcomes of the worker's tasks (:meth:`~megatrain.runtime.engine.grads.GradLedger.settle`)
and raise a failed write of the disk tier.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable


class EngineWaits:
    """Worker waits of an :class:`~megatrain.runtime.engine.core.Engine` (see module docstring)."""

    # ------------------------------------------------------------------ streams
    def _wait_for(self, get: Callable):
        """Call a blocking ``get(timeout=...)`` until it succeeds, re-raising a CPU worker failure meanwhile."""
        while True:
            try:
                return get(timeout=1.0)
            except queue.Empty:
                self._worker.check()

    def wait_task(self, task) -> None:
        """Wait for a worker task (a ``_C.TaskHandle``, or None: nothing), re-raising a CPU worker failure."""
        if task is not None and not task.done:
            self._worker.wait(task)
        self._worker.check()

    def wait_event(self, ev: threading.Event) -> None:
        """Wait for ``ev`` (set by a worker task), re-raising a CPU worker failure instead of hanging."""
        while not ev.wait(timeout=1.0):
            self._worker.check()

    def flush(self) -> None:
        """Wait until every submitted gradient has been accumulated and every update applied."""
        t0 = time.perf_counter()
        w0 = self._timeline_clock()
        self._worker.drain()
        self._timeline_wait(None, None, w0)
        with self._stats_lock:
            self._stats["adam_exposed_s"] += time.perf_counter() - t0
        self.settle()
        if self.disk is not None:
            self.disk.check()  # a write behind that failed after the last task

    def wait_grads(self) -> None:
        """Wait until every submitted gradient has landed (D2H done, accumulated, norms known).

        Updates already queued (eager ones) may still be running: loads wait for them per unit.
        """
        if not self.overlap:
            return self.flush()
        t0 = time.perf_counter()
        self._worker.wait_grads()
        with self._stats_lock:  # mostly the GPU finishing backward: not CPU Adam time
            self._stats["grad_wait_s"] += time.perf_counter() - t0
        self.settle()
        if self.disk is not None:
            self.disk.check()
