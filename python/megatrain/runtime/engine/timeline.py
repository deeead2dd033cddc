"""A per-step timeline of the CPU worker's tasks and of the main thread's waits for them.

Off by default (``Options.worker_timeline``, ``MEGATRAIN_WORKER_TIMELINE=1``, or
:meth:`WorkerTimeline.set_on`, ``Engine.set_worker_timeline``, on a built engine). When on, the engine records for
each optimizer step:

* ``update`` / ``grad``: every CPU AdamW / gradient task of the step's units (the C++ task's own
  ``started_s`` / ``finished_s``), applied at the engine's sync points (``settle``);
* ``wait``: every time the main thread blocked on an update of the step (a unit's load in
  ``wait_update``, ``unit`` None for ``flush``), wherever it falls: the next forward's waits
  for the step's last updates belong to the step;
* the marks ``step_begin`` (the step's first forward, before the resident unit's load),
  ``backward_end`` (each backward pass's end on the host: autograd finished the graph) and
  ``step_end`` (``optimizer.step()`` queued the updates and returns).

All times are seconds on ``std::chrono::steady_clock`` (``megatrain._C.steady_now()``); a step
is complete once it ended and all its updates were applied. :meth:`WorkerTimeline.events`
returns the last complete step (or one of the few before it), relative to its ``step_begin``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, List, Optional

import torch

from ..._loader import load_extension
from .grads import _graph_task_id

if TYPE_CHECKING:
    from .units import Unit

_C = load_extension()
_TASK_KINDS = ("update", "grad", "wait")
_KEEP = 4  # complete steps kept (worker_timeline(step=...))


class WorkerTimeline:
    """The worker timeline of an engine (``Engine.timeline``; see module docstring).

    Owns the recorded steps. Its interface: :meth:`set_on` / :meth:`events` (``Engine.set_worker_timeline`` /
    ``Engine.worker_timeline``), the marks :meth:`step_begin`, :meth:`backward`, :meth:`step_end`, and what the
    other parts report: :meth:`clock` + :meth:`wait` (a wait of the main thread), :meth:`task` (a settled task).

    Args:
        on: record from the start (``Options.worker_timeline``).
    """

    def __init__(self, on: bool):
        self.on = bool(on)
        self._lock = threading.Lock()
        self._steps: dict = {}  # step number -> [begin time, ended, absolute events]
        self._done: dict = {}  # the last _KEEP complete steps: number -> events relative to its begin
        self._last_number = 0  # the last complete step's number (0: none yet)
        self._backward_task: Optional[int] = None
        self._grads = None

    def connect(self, grads) -> None:
        """``grads``: the engine's :class:`~.grads.GradLedger` (``settle``, ``update_steps``, ``optimizer``)."""
        self._grads = grads

    @property
    def open_steps(self) -> List[int]:
        """Numbers of the steps recorded and not complete yet."""
        with self._lock:
            return sorted(self._steps)

    def _current_step(self) -> int:
        """The number of the optimizer step running (or the next one): ``steps_called + 1``."""
        return getattr(self._grads.optimizer, "steps_called", 0) + 1

    def set_on(self, on: bool) -> None:
        """Start (``on``) or stop recording the timeline; stopping drops what was recorded."""
        with self._lock:
            self.on = bool(on)
            if not on:
                self._steps.clear()
                self._done.clear()
                self._last_number = 0
                self._backward_task = None

    def events(self, step: Optional[int] = None) -> List[dict]:
        """The events of the last complete optimizer step, or of step number ``step`` (one of the last
        four complete ones; ``[]`` when it is not, or the timeline is off).

        A step is complete once ``step()`` returned and every update it queued was applied and
        seen at a sync point; the step just taken usually completes during the next forward (its
        loads wait for its updates), or call ``optimizer.wait()`` first. Events, by start time:
        ``dict(kind="update" | "grad" | "wait", unit=<unit index, None for a flush>, start_s, end_s)``
        and ``dict(kind="step_begin" | "backward_end" | "step_end", t_s)`` (``step_begin`` also
        has ``step``, the optimizer step number). Times are seconds from the step's ``step_begin``
        on ``std::chrono::steady_clock`` (``megatrain._C.steady_now()``); an update may end after
        ``step_end`` (it overlaps the next forward).
        """
        if not self.on:
            return []
        self._grads.settle()
        self.prune()
        with self._lock:
            return [dict(e) for e in self._done.get(self._last_number if step is None else step, ())]

    # ------------------------------------------------------------------ recording (engine hooks)
    def _add(self, number: Optional[int], event: Optional[dict], t: float) -> None:
        """Append ``event`` (absolute times) to step ``number``'s record, opened at ``t`` if new.

        ``number`` None: to the latest step recorded and not complete yet, if any (never opens one)."""
        with self._lock:
            if number is None:
                number = max(self._steps, default=None)
                if number is None:
                    return
            if not self.on or number <= self._last_number:
                return  # (a step already complete: nothing of it is pending)
            rec = self._steps.get(number)
            if rec is None:
                rec = self._steps[number] = [t, False, [dict(kind="step_begin", t_s=t, step=number)]]
            if event is not None:
                rec[2].append(event)

    def step_begin(self) -> None:
        """A forward begins: opens the record of the step it belongs to (no-op when already open)."""
        if self.on:
            number = self._current_step()
            with self._lock:
                if number <= self._last_number:  # a new optimizer counts its steps from 1 again
                    self._last_number = number - 1
                    self._done = {n: ev for n, ev in self._done.items() if n < number}
            self._add(number, None, _C.steady_now())

    def backward(self) -> None:
        """Called during a backward pass: its end is marked ``backward_end`` (once per backward)."""
        if not self.on:
            return
        task = _graph_task_id()
        if task is None or task == self._backward_task:
            return
        self._backward_task = task
        number = self._current_step()

        def ended() -> None:
            t = _C.steady_now()
            self._add(number, dict(kind="backward_end", t_s=t), t)

        try:
            torch.autograd.Variable._execution_engine.queue_callback(ended)
        except (AttributeError, RuntimeError):  # not inside a backward pass: no mark
            pass

    def step_end(self, number: int) -> None:
        """``optimizer.step()`` number ``number`` returns (its updates are queued): marks ``step_end``."""
        if not self.on:
            return
        t = _C.steady_now()
        self._add(number, dict(kind="step_end", t_s=t), t)
        with self._lock:
            if number in self._steps:
                self._steps[number][1] = True
        self.prune()

    def clock(self) -> Optional[float]:
        """``_C.steady_now()`` when the timeline is on, else None (a wait's start)."""
        return _C.steady_now() if self.on else None

    def wait(self, unit: Optional[Unit], pending, t0: Optional[float]) -> None:
        """The main thread waited from ``t0`` until now for the update tasks ``pending`` (handles;
        None: all of them, a flush). Call before ``settle()``; ``t0``: :meth:`clock`'s."""
        if t0 is None:
            return
        t1 = _C.steady_now()
        steps = self._grads.update_steps(None if pending is None else {h.seq for h in pending})
        # no update of a step recorded was pending (a flush of gradient tasks, a zero_grad's weights back):
        # the latest step recorded
        event = dict(kind="wait", unit=None if unit is None else unit.index, start_s=t0, end_s=t1)
        self._add(max(steps) if steps else None, event, t0)

    def task(self, kind: str, unit: int, outcome, number: Optional[int] = None) -> None:
        """A settled worker task of ``unit`` (``outcome``: its ``_C.GradOutcome`` / ``_C.UpdateOutcome``)
        of step ``number`` (None: the step running). A task that never ran is not recorded."""
        start, end = outcome.started_s, outcome.finished_s
        if start < 0 or end < 0:
            return
        self._add(self._current_step() if number is None else number,
                  dict(kind=kind, unit=unit, start_s=start, end_s=end), start)

    def prune(self) -> None:
        """Move the steps that completed to the kept ones (relative to their begin); drop older records."""
        pending = set(self._grads.update_steps(None))
        with self._lock:
            done = sorted(n for n, rec in self._steps.items() if rec[1] and n not in pending)
            for n in done:
                t0, _, events = self._steps[n]
                rel = [{k: v - t0 if k in ("t_s", "start_s", "end_s") else v for k, v in e.items()} for e in events]
                rel.sort(key=lambda r: r.get("start_s", r.get("t_s")))
                self._done[n] = rel
            if not done:
                return
            self._last_number = done[-1]
            for n in sorted(self._done)[:-_KEEP]:
                del self._done[n]
            for n in [n for n in self._steps if n <= done[-1]]:
                del self._steps[n]


def timeline_summary(events: List[dict], longest: int = 5) -> dict:
    """A compact summary of :meth:`WorkerTimeline.events`'s ``events`` (seconds).

    Returns ``totals_s`` (summed durations per kind), ``counts`` (events per kind), ``marks``
    (``step_begin`` / ``backward_end`` / ``step_end`` times; the last of each),
    ``longest_waits`` (the ``longest`` longest waits: ``unit``, ``start_s``, ``dur_s``), and
    ``update_span_s`` / ``update_first_start_s`` / ``update_last_end_s`` (from the first update's
    start to the last update's end; None without updates).
    """
    totals = {k: 0.0 for k in _TASK_KINDS}
    counts = {k: 0 for k in _TASK_KINDS}
    marks = {}
    for e in events:
        if e["kind"] in totals:
            totals[e["kind"]] += e["end_s"] - e["start_s"]
            counts[e["kind"]] += 1
        else:
            marks[e["kind"]] = e["t_s"]
    waits = sorted((e for e in events if e["kind"] == "wait"), key=lambda e: e["start_s"] - e["end_s"])
    updates = [e for e in events if e["kind"] == "update"]
    first = min((e["start_s"] for e in updates), default=None)
    last = max((e["end_s"] for e in updates), default=None)
    return dict(totals_s=totals, counts=counts, marks=marks,
                longest_waits=[dict(unit=e["unit"], start_s=e["start_s"], dur_s=e["end_s"] - e["start_s"])
                               for e in waits[:longest]],
                update_first_start_s=first, update_last_end_s=last,
                update_span_s=None if first is None else last - first)
