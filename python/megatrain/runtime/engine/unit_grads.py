"""Per-unit views of the C++ gradient ledger: :class:`UnitGrads` (mixed into
:class:`~megatrain.runtime.engine.units.Unit`) and the entry-state predicates :func:`in_compute` and
:func:`landed`.

The state of every entry's gradient is the :class:`megatrain._C.Ledger`
(``csrc/megatrain/scheduler/ledger.h``); :class:`~megatrain.runtime.engine.grads.GradLedger` (the
engine's side) moves it, this module only reads it.
"""

from __future__ import annotations

from typing import List, Optional

from ..._loader import load_extension

_C = load_extension()
_NONE = _C.GradPlace.none
_IN_COMPUTE = (_C.GradPlace.in_flight_direct, _C.GradPlace.direct)
_LANDED = (_C.GradPlace.direct, _C.GradPlace.accumulated)
_NO_UPDATE = _C.UpdateState.none


def in_compute(s) -> bool:
    """A ``_C.EntryState`` whose gradient is (or will be) in the compute section, not taken by an update."""
    return s.place in _IN_COMPUTE and s.update == _NO_UPDATE


def landed(s) -> bool:
    """A ``_C.EntryState`` holding a gradient of this window that the worker has landed."""
    return s.place in _LANDED or s.norm_known


class UnitGrads:
    """Per-unit views of the gradient ledger (mixed into :class:`~megatrain.runtime.engine.units.Unit`).

    Each list property is one snapshot of the unit's ledger entries (``_C.Ledger.states``), in
    entry order; read it once per decision.

    Attributes:
        last_task: autograd graph task of the last gradient handed over (thread running backward).
        grad_task: :class:`megatrain._C.TaskHandle` of the unit's last gradient task, or None.
        update_tasks: handles of the unit's update tasks not yet waited for (main thread).
    """

    def _init_grad_state(self, n: int) -> None:
        self.last_task: Optional[int] = None
        self.grad_task = None
        self.update_tasks: list = []
        self._ledger = None
        self._reduced_sq: Optional[list] = None  # data parallel: the norms over every rank's piece

    def bind_ledger(self, ledger) -> None:
        """Read this unit's state from ``ledger`` (a ``_C.Ledger``; the engine binds its own)."""
        self._ledger = ledger

    def grad_states(self) -> list:
        """``_C.EntryState`` of every entry (one snapshot)."""
        return self._ledger.states(self.index)

    @property
    def has_grad(self) -> List[bool]:
        """Entry i holds a landed gradient since the last step / zero_grad."""
        return [landed(s) for s in self.grad_states()]

    @property
    def local_grad_sq(self) -> List[float]:
        """Entry i's squared gradient L2 norm in this process's ledger (a data parallel rank: of its piece)."""
        return list(self._ledger.grad_sq(self.index))

    @property
    def grad_sq(self) -> List[float]:
        """Entry i's squared gradient L2 norm (0.0 where unknown); data parallel: over every rank's piece once
        ``wait_grads`` all-reduced them (:meth:`set_reduced_grad_sq`)."""
        return list(self._reduced_sq) if self._reduced_sq is not None else self.local_grad_sq

    def set_reduced_grad_sq(self, sq: Optional[list]) -> None:
        """Data parallel: the per-entry squared norms summed over the ranks' pieces (None: forget them)."""
        self._reduced_sq = sq

    @property
    def batches(self) -> List[int]:
        """Backward passes that delivered entry i a gradient since the last step / zero_grad."""
        return [s.micro_batches for s in self.grad_states()]

    @property
    def eager(self) -> List[bool]:
        """Entry i's update was queued during backward (this window)."""
        return [s.eager for s in self.grad_states()]

    @property
    def direct(self) -> List[bool]:
        """Entry i's slice of the compute section holds its gradient (no update has taken it over)."""
        return [in_compute(s) for s in self.grad_states()]

    @property
    def grads_in_compute(self) -> bool:
        return self._ledger.any_in_compute(self.index)

    @property
    def eager_queued(self) -> bool:
        """Some entry's update was queued during backward (before ``step()``)."""
        return any(s.eager for s in self.grad_states())

    @property
    def update_settled(self) -> bool:
        """Every update task of the unit queued so far ran (or was skipped after a worker failure)."""
        return all(h.done for h in self.update_tasks)
