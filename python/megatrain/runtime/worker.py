"""The CPU worker: one thread running gradient tasks and Adam updates, by priority and readiness."""

from __future__ import annotations

import atexit
import collections
import itertools
import os
import threading
import weakref
from typing import Callable, List, Optional

import torch

_LIVE_WORKERS: "weakref.WeakSet[_Worker]" = weakref.WeakSet()


@atexit.register
def _stop_workers() -> None:
    # Finish queued work and join the threads before the interpreter tears down: a daemon
    # thread still inside a torch op at finalization aborts the process ("terminate called
    # without an active exception").
    for w in list(_LIVE_WORKERS):
        w.close()


class _Task:
    __slots__ = ("klass", "key", "seq", "fn", "ready")

    def __init__(self, klass, key, seq, fn, ready):
        self.klass, self.key, self.seq, self.fn, self.ready = klass, key, seq, fn, ready

    def is_ready(self) -> bool:
        return self.ready is None or bool(self.ready())


class _Worker:
    """One CPU thread running gradient tasks and Adam updates, by priority and readiness.

    Gradient tasks (D2H waits, accumulation, zero_grad bookkeeping) run in submission order and
    before updates: they free pinned staging buffers and are what ``optimizer.step()`` waits
    for. Update tasks run earliest deadline first: the key is the unit's position in the next
    forward (resident unit first, then layer 0, 1, ...). During backward the gradients arrive
    last layer first; when the CPU Adam falls behind, the lowest-index waiting layer (the one the
    next forward needs soonest) is updated first, and the deep layers' updates overlap the next
    forward instead of delaying its start.

    A task may carry a readiness test (a CUDA event's ``query``, or "this unit's gradient task
    ran"). While the oldest gradient task is still waiting for its D2H copy, a ready update runs
    instead of blocking the thread on that copy (otherwise a main thread that runs ahead of the
    GPU would queue every layer's gradient task first and no update would overlap backward).
    """

    GRAD = 0
    UPDATE = 1

    def __init__(self):
        self._grads: "collections.deque[_Task]" = collections.deque()
        self._updates: List[_Task] = []
        self._seq = itertools.count()
        self._error: Optional[BaseException] = None
        self._closed = False
        self._stop = False
        self._cv = threading.Condition()
        self._grad_pending = 0
        self._unfinished = 0
        self._thread = threading.Thread(target=self._run, name="megatrain-cpu-worker", daemon=True)
        self._thread.start()
        _LIVE_WORKERS.add(self)

    def _pick(self) -> Optional[_Task]:
        """Next task (called with the lock held, some task queued)."""
        if self._grads and self._grads[0].is_ready():
            return self._grads.popleft()
        ready = [t for t in self._updates if t.is_ready()] if self._updates else []
        if ready:
            t = min(ready, key=lambda t: (t.key, t.seq))
            self._updates.remove(t)
            return t
        if self._grads:
            return self._grads.popleft()  # blocks on its copy: no later work can be ready before it
        t = min(self._updates, key=lambda t: (t.key, t.seq))
        self._updates.remove(t)
        return t

    def _run(self):
        # MEGATRAIN_ADAM_THREADS: intra-op threads of this worker's kernels (default: torch's),
        # e.g. cores - 1 so that the thread launching GPU work is never starved by the update.
        n = os.environ.get("MEGATRAIN_ADAM_THREADS", "")
        if n.strip():
            torch.set_num_threads(max(1, int(n)))
        while True:
            with self._cv:
                while not self._grads and not self._updates:
                    if self._stop:
                        return
                    self._cv.wait()
                task = self._pick()
            try:
                if self._error is None:
                    task.fn()
            except BaseException as e:  # re-raised on the main thread at the next sync point
                self._error = e
            finally:
                with self._cv:
                    self._unfinished -= 1
                    if task.klass == self.GRAD:
                        self._grad_pending -= 1
                    self._cv.notify_all()

    def submit(self, task: Callable[[], None], klass: int = GRAD, key: int = 0,
               ready: Optional[Callable[[], bool]] = None) -> None:
        """Queue ``task``: ``klass`` GRAD (FIFO, first) or UPDATE (by ``key``, smallest first).

        ``ready``: a non-blocking test; the task is preferred only once it returns True.
        """
        self.check()
        t = _Task(klass, key, next(self._seq), task, ready)
        with self._cv:
            self._unfinished += 1
            if klass == self.GRAD:
                self._grad_pending += 1
                self._grads.append(t)
            else:
                self._updates.append(t)
            self._cv.notify_all()

    def _wait(self, done: Callable[[], bool]) -> None:
        with self._cv:
            while not done() and self._error is None:
                self._cv.wait(timeout=1.0)
        self.check()

    def wait_grads(self) -> None:
        """Block until every queued gradient task has run (updates may still be queued)."""
        self._wait(lambda: self._grad_pending == 0)

    def drain(self) -> None:
        """Block until every queued task has run."""
        self._wait(lambda: self._unfinished == 0)

    def check(self) -> None:
        """Raise if a task failed. Sticky: the tasks queued after the failed one were skipped (their
        waiters would otherwise wait forever), so every later call raises as well."""
        if self._error is not None:
            err = self._error
            raise RuntimeError(
                f"megatrain CPU worker failed: {err!r}. The tasks queued after it were not run, so the host-memory "
                "training state may be partly updated and this model cannot train on: build it again "
                "(megatrain.wrap) and load the last checkpoint (megatrain.load_checkpoint)") from err

    def close(self) -> None:
        """Run what is queued, then stop the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=60)


