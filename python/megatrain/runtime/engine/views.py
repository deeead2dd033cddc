"""Views into the host store: :class:`StoreViews`, the part of an engine that hands out its sections.

Its interface: ``section`` (a unit's flat section), ``entry_view`` (one entry, shaped), ``task_view``
(the flat piece of an entry the CPU tasks read and write: the whole entry, or a data parallel
rank's piece), ``state_window`` (the fp32 state of the disk units and the exclusive device-state
units, one unit at a time), ``state_tier`` (which tier holds a unit's fp32 state) and ``host_buffer`` (a staging buffer of the compute dtype, pinned on CUDA).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from ..._loader import load_extension
from ..placement.device_tier import DeviceTier, is_exclusive

if TYPE_CHECKING:
    from .units import Unit

_C = load_extension()


class StoreViews:
    """Zero-copy views of the engine's ``HostStore``, its disk tier and its accumulator (see module docstring).

    Args:
        ctx: the engine's :class:`~.context.EngineContext` (store, disk tier, dtype, sharding).
        accumulator: the engine's :class:`~.memory.Accumulator` (``grad_accum`` outside the store).
    """

    def __init__(self, ctx, accumulator):
        self.store = ctx.store
        self.disk = ctx.disk
        self.cuda = ctx.cuda
        self.compute_dtype = ctx.compute_dtype
        self.sharding = ctx.sharding
        self.accumulator = accumulator
        self.device_tier = DeviceTier()  # the exclusive device-state units' fp32 state, for the main thread

    def state_tier(self, unit: Unit):
        """The tier holding ``unit``'s fp32 state (master, exp_avg, exp_avg_sq) outside the host store: the
        disk tier (:class:`~..placement.disk_tier.DiskOffload`), the device tier (an exclusive device-state
        layer: :class:`~..placement.device_tier.DeviceTier`), or None (the host store holds it). Both tiers
        offer ``window`` / ``section`` / ``view`` / ``read`` (a CPU copy) / ``write``."""
        if unit.disk is not None:
            return self.disk
        return self.device_tier if is_exclusive(unit) else None

    @contextlib.contextmanager
    def state_window(self, write: bool = False, on_release=None):
        """Context in which ``entry_view`` / ``section`` reach the fp32 state held outside the host store
        (one unit at a time per tier: see :meth:`~..placement.disk_plan.DiskOffload.window` and
        :meth:`~..placement.device_tier.DeviceTier.window`). ``write``: the units viewed are written back.
        ``on_release(unit)``: called in a writing window before a unit is written back. The disk tier's
        window drains the CPU worker first."""
        with contextlib.ExitStack() as stack:
            if self.disk is not None:
                stack.enter_context(self.disk.window(write, on_release=on_release))
            stack.enter_context(self.device_tier.window(write, on_release=on_release))
            yield

    def host_buffer(self, numel: int) -> torch.Tensor:
        """A host buffer of ``numel`` elements of the compute dtype (pinned on CUDA: bounded staging,
        counted in the store's budget check)."""
        if self.cuda:
            # bounded staging, counted in the store's budget check
            return _C.pinned_empty(numel, self.compute_dtype, check_budget=False)
        return torch.empty(numel, dtype=self.compute_dtype)

    def section(self, unit: Unit, name: str) -> torch.Tensor:
        """Flat zero-copy view of one store section of ``unit`` (CPU, pinned when on CUDA).

        A disk unit's (an exclusive device-state unit's) fp32 sections: a view of the tier's buffer,
        inside ``state_window`` only.
        """
        tier = self.state_tier(unit) if name != "compute" else None
        if tier is not None:
            return tier.section(unit, name)
        return self.store.section(unit.index, name)

    def entry_view(self, unit: Unit, i: int, name: str) -> torch.Tensor:
        """Shaped zero-copy view of entry ``i`` of ``unit`` in store section ``name``.

        A disk unit's (an exclusive device-state unit's) master / exp_avg / exp_avg_sq: a view of the
        tier's buffer, valid inside a ``state_window`` until another unit of that tier is viewed (see :class:`~..placement.disk_plan.DiskOffload`).

        Raises:
            ValueError: a frozen entry has no fp32 sections (only ``compute``); a disk unit's
                accumulator is reached through the worker's tasks only.
            RuntimeError: a disk unit's fp32 state outside a window.
        """
        tier = self.state_tier(unit) if name != "compute" else None
        if tier is not None:
            if name == "grad_accum":
                raise ValueError(f"megatrain: the gradient accumulator of unit {unit.index} is outside the host store "
                                 "(disk tier / device); only the update tasks read it")
            return tier.view(unit, i, name)
        if name == "grad_accum" and self.accumulator.mode is not True:
            return self.accumulator.entry_view(unit, i)
        return self.store.view(unit.index, i, name)

    def task_view(self, unit: Unit, i: int, name: str) -> torch.Tensor:
        """Flat view of entry ``i`` of ``unit`` in section ``name`` that the update tasks read and write.

        The whole entry here; a data parallel rank's piece of it (``runtime/data_parallel/``).
        """
        return self.sharding.task_view(self, unit, i, name)
