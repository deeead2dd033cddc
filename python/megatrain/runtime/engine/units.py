"""Units and entries: what the engine streams and updates, and the host bytes it will allocate.

A *unit* is a group of parameters streamed and updated together: one decoder layer, or the
resident unit (embedding, final norm, LM head, ...). Each of its *entries* is one parameter with an
element offset into the unit's flat sections of the ``HostStore``. :func:`plan_host_memory` sizes
the host allocation of an :class:`~megatrain.runtime.engine.core.Engine` over a list of units without
allocating (the budget check and :func:`megatrain.estimate` use it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from ..._loader import load_extension
from .unit_grads import UnitGrads

_C = load_extension()


@dataclass
class Entry:
    """One parameter of a unit: where it lives in the store and on which module it is bound.

    Attributes:
        name: fully qualified parameter name in the wrapped model (``model.layers.3.mlp.up_proj.weight``).
        shape: parameter shape.
        numel: number of elements.
        offset: element offset inside the unit's flat sections (same in every section).
        owners: ``(module, attribute)`` pairs that hold this parameter (more than one when tied).
        param: the user-visible ``nn.Parameter`` (a meta placeholder for streamed layers, a real
            device parameter for the resident unit).
        frozen: ``requires_grad=False`` when the model was wrapped: the store holds only its
            compute copy (no master, exp_avg, exp_avg_sq or accumulator).
        state_offset: element offset inside the unit's fp32 sections (-1 when frozen).
    """

    name: str
    shape: tuple
    numel: int
    offset: int
    owners: list
    param: torch.nn.Parameter
    frozen: bool = False
    state_offset: int = 0


@dataclass
class Unit(UnitGrads):
    """A group of parameters streamed and updated together (one decoder layer or the resident unit).

    The per-entry gradient and update state is the engine's ``_C.Ledger``; :class:`~megatrain.runtime.engine.unit_grads.UnitGrads`
    reads it (``has_grad``, ``grad_sq``, ``batches``, ``eager``, ``direct``, ``update_settled``, ...).
    """

    index: int
    kind: str  # "layer" or "resident"
    entries: List[Entry]
    numel: int
    template: tuple
    module: Optional[torch.nn.Module] = None
    state_numel: int = 0  # padded length of the unit's fp32 sections (frozen entries have none)
    version: int = 0
    # A device-state layer (``wrap(device_state_layers=K)``): its ``DeviceUnit`` (device buffers of
    # the whole training state), else None. See ``megatrain.runtime.placement.device_state``.
    device_state: Optional[object] = None
    # A unit whose fp32 state (master, exp_avg, exp_avg_sq, grad_accum) is in the disk tier: its
    # unit index there, else None (the host store holds it). See ``megatrain.runtime.placement.disk_plan``.
    disk: Optional[int] = None
    # A master-streamed layer (``wrap(host_compute_copy=False | "auto")``): the host store holds no compute
    # section for it (12 B/param); its slot is filled from the fp32 master, cast on the device, and its
    # gradients wait on the device for its update (``SlotPool.fill_from_master``, ``GradLedger.held``).
    master_streamed: bool = False
    # No compute section in the host store: a master-streamed layer, or an exclusive device-state layer
    # without a frozen entry (its weights are its device compute buffer, cast from its device master).
    compute_absent: bool = False
    # A layer unit's parameters that other decoder layers hold too (a shared block): their indices in the
    # resident unit's entries (see ``layers.model_units``).
    shared: List[int] = field(default_factory=list)

    @property
    def update_key(self) -> int:
        """Position in the next forward (resident unit first): the worker's update priority."""
        return 0 if self.kind == "resident" else 1 + self.index

    def __post_init__(self):
        self._init_grad_state(len(self.entries))


def unit_tables(units: List[Unit]) -> Tuple[list, list]:
    """``(tables, frozen)`` of ``units`` as ``HostStore`` takes them: per unit ``[(name, shape)]`` and frozen flags."""
    tables = [[(e.name, list(e.shape)) for e in u.entries] for u in units]
    frozen = [[bool(e.frozen) for e in u.entries] for u in units]
    return tables, frozen


def plan_host_memory(units: List[Unit], compute_dtype: torch.dtype, grad_accumulator: Optional[bool],
                     staging_buffers: int = 4, offloaded: Optional[List[bool]] = None,
                     compute_absent: Optional[List[bool]] = None) -> dict:
    """Host bytes an :class:`Engine` over ``units`` allocates, computed without allocating.

    The engine's budget check and :func:`megatrain.estimate` both use this, and the store part comes
    from ``HostStore.layout_required`` (the C++ planning the store's constructor runs).

    Args:
        units: the units in forward order (``kind`` "layer" / "resident"; ``entries[i].frozen``).
        compute_dtype: ``torch.bfloat16`` or ``torch.float32``.
        grad_accumulator: ``True``: the fp32 accumulator is a store section; ``None`` / ``False``: not.
        staging_buffers: pinned staging buffers for layer gradients.
        offloaded: per unit, whether its fp32 sections live in the disk tier or on the device only (an
            exclusive layer; see :mod:`..placement.disk_plan`). None: none.
        compute_absent: per unit, whether it has no compute section (a master-streamed layer, an exclusive
            device-state layer without a frozen entry). None: none.

    Returns:
        dict: ``layout`` (``HostStore.layout_required``'s dict: ``section_bytes``, ``unit_numel``,
        ``unit_state_numel``, ``total_numel``, ``frozen_numel``), ``store_bytes`` (the arena),
        ``staging_bytes`` (``staging_buffers`` buffers of the largest layer plus the resident
        unit's gradient staging, compute dtype), ``accumulator_bytes`` (the fp32 accumulator
        ``enable_accumulator`` allocates outside the store in auto mode: 4 B per element of the
        fp32 sections of the units not offloaded), all in bytes.
    """
    tables, frozen = unit_tables(units)
    if not hasattr(_C.HostStore, "layout_required"):
        raise RuntimeError("megatrain: the compiled extension megatrain._C is older than its Python code (no "
                           "HostStore.layout_required); rebuild it: python setup.py build_ext --inplace")
    off = [bool(x) for x in offloaded] if offloaded is not None else []
    absent = [bool(x) for x in compute_absent] if compute_absent is not None else []
    layout = _C.HostStore.layout_required(tables, compute_dtype, grad_accumulator is True, frozen, off, absent)
    elem = torch.tensor([], dtype=compute_dtype).element_size()
    layer_numel = [n for n, u in zip(layout["unit_numel"], units) if u.kind == "layer"]
    resident_numel = sum(n for n, u in zip(layout["unit_numel"], units) if u.kind != "layer")
    staging = elem * ((staging_buffers * max(layer_numel)) if layer_numel else 0) + elem * resident_numel
    return dict(layout=layout, store_bytes=int(layout["total_bytes"]), staging_bytes=int(staging),
                accumulator_bytes=4 * int(sum(n for k, n in enumerate(layout["unit_state_numel"])
                                              if not (off and off[k]))))

