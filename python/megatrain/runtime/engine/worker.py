"""The CPU worker: one thread running gradient tasks and Adam updates, by priority and readiness."""

from __future__ import annotations

import atexit
import weakref
from typing import Callable, Optional

from ..._loader import load_extension

_C = load_extension()

_LIVE_WORKERS: "weakref.WeakSet[_Worker]" = weakref.WeakSet()


@atexit.register
def _stop_workers() -> None:
    # Finish queued work and join the threads before the interpreter tears down: a daemon
    # thread still inside a torch op at finalization aborts the process ("terminate called
    # without an active exception").
    for w in list(_LIVE_WORKERS):
        w.close()


class _Worker:
    """The CPU worker thread: :class:`megatrain._C.Worker` (``csrc/megatrain/scheduler/worker.h``).

    Gradient tasks (D2H waits, accumulation, zero_grad bookkeeping) run in submission order and
    before updates: they free pinned staging buffers and are what ``optimizer.step()`` waits
    for. Update tasks run earliest deadline first: the key is the unit's position in the next
    forward (resident unit first, then layer 0, 1, ...). During backward the gradients arrive
    last layer first; when the CPU Adam falls behind, the lowest-index waiting layer (the one the
    next forward needs soonest) is updated first, and the deep layers' updates overlap the next
    forward instead of delaying its start.

    A task may carry a readiness gate: a recorded ``torch.cuda.Event`` (queried with
    ``cudaEventQuery`` on the worker thread, without the GIL) or the :class:`megatrain._C.TaskHandle`
    of an earlier task. While the oldest gradient task is still waiting for its D2H copy, a ready
    update runs instead of blocking the thread on that copy (otherwise a main thread that runs
    ahead of the GPU would queue every layer's gradient task first and no update would overlap
    backward).

    A task that raises stops the worker's work: the tasks queued after it are skipped and every
    later ``submit`` / wait raises ``RuntimeError`` ("megatrain CPU worker failed: ...", sticky).
    The engine's gradient and update tasks are C++ kernel tasks (no GIL); Python tasks take the
    GIL on the worker thread; waits release it.

    Args:
        adam_threads: intra-op threads of the kernels run on the worker (None: torch's; the
            engine passes ``Options.adam_threads``, ``MEGATRAIN_ADAM_THREADS``), e.g. cores - 1 so
            that the thread launching GPU work is never starved by the update.
    """

    GRAD = 0
    UPDATE = 1

    def __init__(self, adam_threads: Optional[int] = None):
        self._w = _C.Worker(adam_threads=-1 if adam_threads is None else adam_threads)
        _LIVE_WORKERS.add(self)

    def submit(self, task: Callable[[], None], klass: int = GRAD, key: int = 0, ready=None):
        """Queue ``task``: ``klass`` GRAD (FIFO, first) or UPDATE (by ``key``, smallest first).

        ``ready``: None, a recorded ``torch.cuda.Event`` or an earlier task's handle; the task is
        preferred only once it is done. Returns the task's :class:`megatrain._C.TaskHandle`.
        """
        return self._w.submit(task, klass, key, ready)

    def submit_accumulate(self, ledger, unit: int, direct, staged, ready=None, **tier):
        """Queue a C++ gradient task (``_C.Worker.submit_accumulate``, no GIL). Returns ``(TaskHandle, GradOutcome)``.

        ``tier``: ``staged_tier`` / ``accum_tier`` / ``accum_unit`` for a unit whose accumulator is on disk."""
        return self._w.submit_accumulate(ledger, unit, direct, staged, ready, **tier)

    def submit_move_to_accumulator(self, ledger, unit: int, moved, **tier):
        """Queue a C++ gradient task moving direct gradients to the accumulator (``_C.Worker``). Returns its handle.

        ``tier``: ``moved_tier`` and the disk tiers of a unit whose state is on disk."""
        return self._w.submit_move_to_accumulator(ledger, unit, moved, **tier)

    def submit_adam(self, ledger, unit: int, items, grad_scale: float, restore, ledger_entries, finite_from,
                    restore_on_skip, klass: int, key: int, ready=None, **tier):
        """Queue a C++ update task (``_C.Worker.submit_adam``, no GIL). Returns ``(TaskHandle, UpdateOutcome)``.

        ``tier``: ``tier_items`` / ``restore_tier`` / ``restore_on_skip_tier`` and the disk tiers of a
        unit whose fp32 state is on disk."""
        return self._w.submit_adam(ledger, unit, items, grad_scale, restore, ledger_entries, finite_from,
                                   restore_on_skip, klass, key, ready, **tier)

    def wait(self, task) -> None:
        """Block until ``task`` (a handle) ran."""
        self._w.wait(task)

    def wait_grads(self) -> None:
        """Block until every queued gradient task has run (updates may still be queued)."""
        self._w.wait_grads()

    def drain(self) -> None:
        """Block until every queued task has run."""
        self._w.drain()

    def check(self) -> None:
        """Raise if a task failed. Sticky: the tasks queued after the failed one were skipped (their
        waiters would otherwise wait forever), so every later call raises as well."""
        self._w.check()

    @property
    def failed(self) -> bool:
        """A task failed (every later call raises)."""
        return self._w.failed

    @property
    def unfinished(self) -> int:
        """Tasks queued or running (skipped ones count as finished)."""
        return self._w.unfinished

    def close(self) -> None:
        """Run what is queued, then stop the thread (idempotent)."""
        self._w.close()
        self.closed = True

    closed = False  # close() ran: no task may be submitted any more
