"""Waiting for the CPU worker: :class:`Waits`, the part of an engine that blocks the main thread.

Its interface: ``wait_task``, ``wait_event``, ``wait_for``, ``wait_update`` (a unit's pending CPU
updates), ``wait_grads`` (every gradient landed) and ``flush`` (every task run). Every wait
re-raises a failure of the CPU worker instead of hanging (``_Worker.check``); ``flush``,
``wait_grads`` and ``wait_update`` then apply the outcomes of the worker's tasks
(:meth:`~megatrain.runtime.engine.grads.GradLedger.settle`); ``flush`` and ``wait_grads`` raise a
failed write of the disk tier. The engine's sharding strategy (:mod:`.sharding`) runs after each:
the peers' updates (data parallel), the all-reduce of the squared norms.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, List

if TYPE_CHECKING:
    from .units import Unit


class Waits:
    """The main thread's waits for the CPU worker (see module docstring).

    Args:
        units: the engine's units (forward order).
        overlap: ``Options.overlap`` (False: ``wait_grads`` is ``flush``).
        sharding: the engine's strategy (:class:`~.sharding.SingleProcess` or data parallel).
        disk: the disk tier (``DiskOffload``) or None.
    """

    def __init__(self, units: List[Unit], overlap: bool, sharding, disk):
        self.units = units
        self.overlap = overlap
        self.sharding = sharding
        self.disk = disk
        self.worker = self.counters = self.timeline = self.grads = None

    def connect(self, worker, counters, timeline, grads) -> None:
        """The collaborators: the CPU worker, :class:`~.stats.EngineCounters`, :class:`~.timeline.WorkerTimeline`
        and :class:`~.grads.GradLedger` (``settle``)."""
        self.worker, self.counters, self.timeline, self.grads = worker, counters, timeline, grads

    def wait_for(self, get: Callable):
        """Call a blocking ``get(timeout=...)`` until it succeeds, re-raising a CPU worker failure meanwhile."""
        while True:
            try:
                return get(timeout=1.0)
            except queue.Empty:
                self.worker.check()

    def wait_task(self, task) -> None:
        """Wait for a worker task (a ``_C.TaskHandle``, or None: nothing), re-raising a CPU worker failure."""
        if task is not None and not task.done:
            self.worker.wait(task)
        self.worker.check()

    def wait_event(self, ev: threading.Event) -> None:
        """Wait for ``ev`` (set by a worker task), re-raising a CPU worker failure instead of hanging."""
        while not ev.wait(timeout=1.0):
            self.worker.check()

    def wait_update(self, unit: Unit) -> None:
        """Block the calling (main) thread until ``unit``'s pending CPU Adam update is done (a deferred one of a
        master-streamed unit submitted first; the others submitted while staging buffers are free)."""
        self.grads.held.pump(until=unit)
        pending = [h for h in unit.update_tasks if not h.done]
        if pending:
            t0 = time.perf_counter()
            w0 = self.timeline.clock()
            for h in pending:
                self.worker.wait(h)
            self.timeline.wait(unit, pending, w0)
            self.counters.add_locked("adam_exposed_s", time.perf_counter() - t0)
        unit.update_tasks = []
        self.worker.check()
        self.grads.settle()
        self.sharding.after_wait_update(unit)

    def flush(self) -> None:
        """Wait until every submitted gradient has been accumulated and every update applied (the deferred
        updates of master-streamed units submitted first)."""
        self.grads.held.pump(everything=True)
        t0 = time.perf_counter()
        w0 = self.timeline.clock()
        self.worker.drain()
        self.timeline.wait(None, None, w0)
        self.counters.add_locked("adam_exposed_s", time.perf_counter() - t0)
        self.grads.settle()
        if self.disk is not None:
            self.disk.check()  # a write behind that failed after the last task
        self.sharding.after_flush(self.units)

    def wait_grads(self) -> None:
        """Wait until every submitted gradient has landed (D2H done, accumulated, norms known).

        Updates already queued (eager ones) may still be running: loads wait for them per unit.
        """
        if not self.overlap:
            self.flush()
        else:
            t0 = time.perf_counter()
            self.worker.wait_grads()
            # mostly the GPU finishing backward: not CPU Adam time
            self.counters.add_locked("grad_wait_s", time.perf_counter() - t0)
            self.grads.settle()
            if self.disk is not None:
                self.disk.check()
        self.sharding.after_wait_grads(self.units)
