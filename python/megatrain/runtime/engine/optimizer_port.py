"""The one interface between the engine and its optimizer, both ways.

* **optimizer -> engine**: :class:`OptimizerPort`, built from an engine, is everything
  :class:`megatrain.optim.CPUAdamW` asks of it: attaching, a unit's ``exp_avg`` / ``exp_avg_sq``
  state sections (zero-copy host-store views, or copies from the disk tier), making the host store
  current (``sync``), waiting for the gradients and reading their ledger (has a gradient, updated
  during backward, squared norm, held in the compute section), queueing a unit's update, the
  device-state units' non-finite outcome, and the step's bookkeeping (``zero_grad``, the
  ``model.state_dict()`` views, the timeline mark). It uses the engine's public methods and
  attributes only.
* **engine -> optimizer**: :class:`EngineOptimizer`, what the engine reads and calls on the
  optimizer attached to it (on the thread running backward, or at its sync points).

A parameter of a wrapped model is found with :func:`megatrain.runtime.engine.core.locate`, which
gives the engine a port is built from.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Protocol, Tuple

import torch

from .units import Unit

MOMENTS = ("exp_avg", "exp_avg_sq")  # the optimizer's state sections of an entry (fp32, the entry's shape)


class EngineOptimizer(Protocol):
    """What the engine reads and calls on the optimizer attached to it (:meth:`Engine.attach_optimizer`).

    :class:`megatrain.optim.CPUAdamW` implements it. The engine calls these on the thread running
    backward (``plan_eager``, ``raise_extra_backward``) or at its sync points, for an update the
    worker skipped (``skip_unit_update``).

    Attributes:
        gradient_accumulation_steps: backward passes per ``step()`` (1: a layer's first gradient
            goes straight into the compute section, see ``submit_grads``).
        max_grad_norm: the clip norm, or None (no clipping: updates may start during backward).
        nonfinite: what a non-finite gradient does (None: nothing is checked; squared norms are
            computed for the check otherwise).
        steps_called: ``step()`` calls that returned (the update being queued belongs to number + 1).
    """

    gradient_accumulation_steps: int
    max_grad_norm: Optional[float]
    nonfinite: Optional[str]
    steps_called: int

    def plan_eager(self, unit: Unit, present: List[bool]) -> Optional[Tuple[list, float]]:
        """``(items, scale)`` when the update of ``unit``'s entries with ``present[i]`` may start now, else None.

        ``items``: ``(entry_index, lr, beta1, beta2, eps, weight_decay, step)`` per entry (the fused AdamW's
        arguments, see ``_C.Worker.submit_adam``).
        """

    def raise_extra_backward(self, same_backward: bool = False) -> None:
        """Raise the error for a gradient that arrives after its unit's update was already queued."""

    def check_param_groups(self) -> None:
        """Raise ValueError (one line) for a param group no update can run with (each forward with autograd on)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients since the last step (``model.zero_grad()`` calls it, as torch's clears ``p.grad``)."""

    def skip_unit_update(self, unit: Unit, items: list, step_number: int) -> None:
        """``unit``'s update (``items``) was skipped for a non-finite gradient in step ``step_number`` (called
        on the main thread at the engine's next sync point after the worker skipped it)."""


class GradView(NamedTuple):
    """One unit's gradient ledger as the optimizer's step reads it: one list per field, in entry order,
    each one snapshot of the ledger (read once per step, in this order)."""

    has_grad: List[bool]  # a landed gradient since the last step / zero_grad
    eager: List[bool]  # the entry's update was queued during backward (no clipping)
    grad_sq: List[float]  # squared L2 norm of the gradient (0.0 where unknown; all ranks' with data parallel)
    direct: List[bool]  # the entry's slice of the compute section holds its gradient


class OptimizerPort:
    """What an optimizer asks of the engine of a wrapped model (see module docstring).

    Args:
        engine: the wrapped model's engine (:class:`~.core.Engine`, as :func:`~.core.locate` gives it).

    The units passed in are the engine's own (``units``); entry indices are positions in
    ``unit.entries``. Every call runs on the main thread.
    """

    def __init__(self, engine):
        self._engine = engine

    # ------------------------------------------------------------------ attaching
    @property
    def engine(self):
        """The engine this port talks to."""
        return self._engine

    def serves(self, engine) -> bool:
        """Whether ``engine`` is this port's engine (parameters of one wrapped model)."""
        return engine is self._engine

    @property
    def optimizer(self) -> Optional[EngineOptimizer]:
        """The optimizer attached to the engine (the newest one), or None."""
        return self._engine.optimizer

    def attach(self, optimizer: EngineOptimizer) -> None:
        """Route every gradient of the model to ``optimizer`` (replacing the one attached before)."""
        self._engine.attach_optimizer(optimizer)

    def count_step(self) -> None:
        """A step's updates are queued: the model's ``optimizer_steps`` (any optimizer) goes up by one, so that a
        backward through a graph made before it is refused (:mod:`megatrain.runtime.model.layer_call`)."""
        self._engine.optimizer_steps = getattr(self._engine, "optimizer_steps", 0) + 1

    def check_frozen(self) -> None:
        """Raise ``RuntimeError`` if a parameter frozen at wrap time was unfrozen since (it has no fp32 state)."""
        self._engine.check_frozen()

    @property
    def has_accumulator(self) -> bool:
        """Whether the fp32 gradient accumulator exists or may be allocated (not ``grad_accumulator=False``)."""
        return self._engine.has_accumulator

    def enable_accumulator(self) -> None:
        """Allocate the fp32 gradient accumulator now (no-op when present), the device-state units' too (checked
        first: a refusal leaves nothing allocated)."""
        if self._engine.device_state is not None:
            self._engine.device_state.check_accumulator()
        self._engine.enable_accumulator()
        if self._engine.device_state is not None:
            self._engine.device_state.enable_accumulator()

    @property
    def data_parallel(self):
        """The engine's ``DataParallel`` (collective calls, ``on_local0``), or None in one process."""
        return getattr(self._engine, "dp", None)

    # ------------------------------------------------------------------ state sections
    @property
    def units(self) -> List[Unit]:
        """The engine's units in forward order (layers, then the resident unit)."""
        return self._engine.units

    @staticmethod
    def on_disk(unit: Unit) -> bool:
        """Whether ``unit``'s fp32 state is in the disk tier (read and written as copies)."""
        return unit.disk is not None

    @staticmethod
    def state_on_device(unit: Unit) -> bool:
        """Whether ``unit``'s training state lives on the device (a device-state layer)."""
        return unit.device_state is not None

    @staticmethod
    def device_state_clean(unit: Unit) -> bool:
        """Whether ``unit`` is a device-state unit whose host sections were not handed out writable since
        its device state last took them (a write through an older tensor would then be lost). Never an
        exclusive one: its handed-out tensors are its device state, never older."""
        du = getattr(unit, "device_state", None)
        return du is not None and not du.exclusive and not du.host_dirty

    def state_view(self, unit: Unit, i: int, name: str) -> torch.Tensor:
        """Zero-copy view (fp32, entry ``i``'s shape) of section ``name`` (``exp_avg`` / ``exp_avg_sq``) of a
        ``unit`` not on disk: of its host-store section (CPU), or, for an exclusive device-state unit
        (fp32 state on the device only), of its device buffer itself (as ``torch.optim.AdamW``'s state of
        a parameter on that device). Raises ``ValueError`` for a frozen entry (no fp32 sections)."""
        du = getattr(unit, "device_state", None)
        if du is not None and du.exclusive:
            e = unit.entries[i]
            if e.state_offset < 0:
                raise ValueError(f"megatrain: entry {e.name} is frozen: it has no {name}")
            return du.fp32(name, i).view(e.shape)
        return self._engine.entry_view(unit, i, name)

    def read_state(self, unit: Unit, i: int, name: str) -> torch.Tensor:
        """A CPU copy of section ``name`` of entry ``i`` of disk unit ``unit`` (waits for the worker)."""
        return self._engine.disk.read(unit, i, name)

    def write_state(self, unit: Unit, values: Dict[tuple, torch.Tensor]) -> None:
        """Copy ``{(entry index, section name): tensor}`` into disk unit ``unit``'s state."""
        self._engine.disk.write(unit, values)

    def sync(self, units: Optional[List[Unit]] = None, for_write: bool = False) -> None:
        """Make the host store current before reading it (``units`` None: all; waits for their updates).

        ``for_write``: the sections are handed out writable; a device-state unit's next update takes them.
        """
        self._engine.sync_host(units, for_write=for_write)

    def host_written(self) -> None:
        """The host store sections were written: the device-state units take them."""
        self._engine.host_written()

    # ------------------------------------------------------------------ gradients
    def wait_grads(self) -> Dict[int, GradView]:
        """Wait until every gradient handed over has landed (eager updates may still run), then read the ledger.

        Returns:
            ``{unit index: GradView}`` for every unit, in forward order.
        """
        self._engine.wait_grads()
        return {u.index: GradView(u.has_grad, u.eager, u.grad_sq, u.direct) for u in self._engine.units}

    @staticmethod
    def grad_batches(unit: Unit) -> List[int]:
        """Backward passes that delivered entry i of ``unit`` a gradient since the last step / zero_grad."""
        return unit.batches

    @staticmethod
    def grad_states(unit: Unit) -> List[Tuple[int, bool]]:
        """``(micro-batches, queued during backward)`` of each entry of ``unit`` (one ledger snapshot)."""
        return [(s.micro_batches, s.eager) for s in unit.grad_states()]

    def eager_queued(self) -> bool:
        """Whether some unit's update was queued during backward (before ``step()``)."""
        return any(u.eager_queued for u in self._engine.units)

    # ------------------------------------------------------------------ updates
    def submit_update(self, unit: Unit, items: list, scale: float, entries: List[int], zero_grads,
                      finite_on_device: bool = False) -> None:
        """Queue the AdamW update of ``unit``'s ``entries`` (``items``: the fused AdamW's arguments per entry,
        ``scale``: the clip coefficient, ``zero_grads``: entries updated with an all-zero gradient;
        ``finite_on_device``: a device-state unit's non-finite check made on the device)."""
        self._engine.submit_update(unit, items, scale, entries=entries, zero_grads=zero_grads,
                                   finite_on_device=finite_on_device)

    @property
    def device_checks_finite(self) -> bool:
        """Whether the device-state units' updates can skip a non-finite gradient on the device."""
        ds = self._engine.device_state
        return ds is not None and ds.checks_on_device

    def undo_if_nonfinite(self, unit: Unit, items: list, zero_grads) -> None:
        """The non-finite outcome of a device-state unit's update enqueued with ``finite_on_device``: once
        the host has the norms, a skipped one's step counts are put back (the optimizer's ``skip_unit_update``)."""
        self._engine.device_state.skip_if_nonfinite(unit, items, zero_grads)

    def flush(self) -> None:
        """Block until every queued task of the CPU worker has run (re-raises its failure)."""
        self._engine.flush()

    def zero_grad(self) -> None:
        """Forget the gradients since the last step (the next backward starts afresh)."""
        self._engine.zero_grad()

    # ------------------------------------------------------------------ step bookkeeping
    def take_state_dict_writes(self) -> None:
        """Before a step's updates: writes into ``model.state_dict()`` tensors reach the device state
        (``RuntimeError`` for a write the step cannot honour, before anything is queued)."""
        self._engine.take_state_dict_writes()

    def refresh_state_dict_views(self) -> None:
        """After a step's updates: held ``model.state_dict()`` tensors read the step's new weights."""
        self._engine.refresh_state_dict_views()

    def step_end(self, number: int) -> None:
        """``step()`` number ``number`` returns: the worker timeline's ``step_end`` mark (nothing when off)."""
        self._engine.timeline_step_end(number)

