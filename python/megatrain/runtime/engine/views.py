"""Views into the host store: :class:`StoreViews`, the part of an engine that hands out its sections.

Its interface: ``section`` (a unit's flat section), ``entry_view`` (one entry, shaped), ``task_view``
(the flat piece of an entry the CPU tasks read and write: the whole entry, or a data parallel
rank's piece), ``state_window`` (the disk units' fp32 state, one unit at a time) and
``host_buffer`` (a staging buffer of the compute dtype, pinned on CUDA).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from ..._loader import load_extension

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

    def state_window(self, write: bool = False):
        """Context in which ``entry_view`` / ``section`` reach the disk units' fp32 state (one unit at a
        time: see :meth:`~..placement.disk_plan.DiskOffload.window`); a no-op context without a disk tier.
        ``write``: the units viewed are written back (dirty). Drains the CPU worker first."""
        if self.disk is None:
            return contextlib.nullcontext()
        return self.disk.window(write)

    def host_buffer(self, numel: int) -> torch.Tensor:
        """A host buffer of ``numel`` elements of the compute dtype (pinned on CUDA: bounded staging,
        counted in the store's budget check)."""
        if self.cuda:
            # bounded staging, counted in the store's budget check
            return _C.pinned_empty(numel, self.compute_dtype, check_budget=False)
        return torch.empty(numel, dtype=self.compute_dtype)

    def section(self, unit: Unit, name: str) -> torch.Tensor:
        """Flat zero-copy view of one store section of ``unit`` (CPU, pinned when on CUDA).

        A disk unit's fp32 sections: a view of the tier's buffer, inside ``disk.window`` only.
        """
        if unit.disk is not None and name != "compute":
            return self.disk.section(unit, name)
        return self.store.section(unit.index, name)

    def entry_view(self, unit: Unit, i: int, name: str) -> torch.Tensor:
        """Shaped zero-copy view of entry ``i`` of ``unit`` in store section ``name``.

        A disk unit's master / exp_avg / exp_avg_sq: a view of the tier's buffer, valid inside a
        ``disk.window`` until another disk unit is viewed (see :class:`~..placement.disk_plan.DiskOffload`).

        Raises:
            ValueError: a frozen entry has no fp32 sections (only ``compute``); a disk unit's
                accumulator is reached through the worker's tasks only.
            RuntimeError: a disk unit's fp32 state outside a window.
        """
        if unit.disk is not None and name != "compute":
            if name == "grad_accum":
                raise ValueError(f"megatrain: the gradient accumulator of unit {unit.index} is in the disk tier; "
                                 "only the CPU worker's tasks read it")
            return self.disk.view(unit, i, name)
        if name == "grad_accum" and self.accumulator.mode is not True:
            return self.accumulator.entry_view(unit, i)
        return self.store.view(unit.index, i, name)

    def task_view(self, unit: Unit, i: int, name: str) -> torch.Tensor:
        """Flat view of entry ``i`` of ``unit`` in section ``name`` that the update tasks read and write.

        The whole entry here; a data parallel rank's piece of it (``runtime/data_parallel/``).
        """
        return self.sharding.task_view(self, unit, i, name)
