"""The memory parts of an :class:`~megatrain.runtime.engine.core.Engine`: the fp32 gradient accumulator
outside the store (:class:`Accumulator`), the device-state layers (:class:`DeviceStateLayers`), and the
free device memory every placement decision reads (:func:`free_device_bytes`).

The accumulator of auto mode (``grad_accumulator=None``) is allocated when first needed
(``Accumulator.enable``, after its host budget check). ``DeviceStateLayers.init`` / ``resize`` keep the
whole training state of the first decoder layers (and the resident unit) on the device
(:mod:`..placement.device_state`), sized from ``Engine.free_device_bytes`` (:mod:`..placement.device_state_plan`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..._loader import load_extension
from ..placement.host_memory import check_host_budget

if TYPE_CHECKING:
    from .units import Unit

_C = load_extension()


class Accumulator:
    """The fp32 gradient accumulator: a store section (``mode`` True), allocated outside the store when
    first needed (``mode`` None, auto), or never (``mode`` False).

    Interface: ``mode``, ``has_accumulator``, ``allocated``, :meth:`enable`, :meth:`nbytes`, :meth:`entry_view`.
    A data parallel rank's accumulator is its pieces' (the strategy's ``piece_accumulator``).

    Args:
        mode: ``Engine.accumulator_mode``.
        units: the engine's units; store: its ``HostStore``; disk: its disk tier or None.
        offload_plan: the engine's ``OffloadPlan`` (host plan, ``host_memory_limit``).
        sharding: the engine's strategy (:mod:`.sharding`).
    """

    def __init__(self, mode: Optional[bool], units, store, disk, offload_plan, sharding):
        self.mode = mode
        self.units = units
        self.store = store
        self.disk = disk
        self.offload_plan = offload_plan
        self.pieces = sharding.piece_accumulator
        self._accum: Optional[dict] = None  # auto mode: unit index -> flat fp32 accumulator (trainable entries)

    @property
    def has_accumulator(self) -> bool:
        """Whether a second gradient before ``step()`` can be summed (accumulator present or allocatable)."""
        return self.mode is not False

    @property
    def allocated(self) -> bool:
        """The accumulator exists (a store section, or allocated)."""
        if self.pieces is not None:
            return self.mode is True or self.pieces.accumulator_allocated
        return self.mode is True or self._accum is not None

    def enable(self) -> None:
        """Allocate the fp32 gradient accumulator now (auto mode; no-op when present).

        4 bytes per trainable parameter, outside the store (CPU only: it is never DMA'd), zeroed.
        Data parallel: nothing here (this rank's pieces are allocated at their first use).

        Raises:
            RuntimeError: the model was wrapped with ``grad_accumulator=False``.
            HostMemoryError: it does not fit in host memory (nothing allocated).
        """
        if self.pieces is not None and self.mode is not False:
            return
        if self.allocated:
            return
        if self.mode is False:
            raise RuntimeError("megatrain: the model was wrapped with grad_accumulator=False; gradient accumulation "
                               "needs the fp32 accumulator: wrap with grad_accumulator=None (auto) or True")
        need = self.offload_plan.host_plan["accumulator_bytes"]
        check_host_budget(need, 0, "gradient accumulator")
        plan = self.offload_plan
        if plan.host_memory_limit is not None and not plan.with_accumulator:
            total = plan.host_bytes + need + (_C.DiskTier.pool_bytes(plan.accum_layouts, plan.num_buffers)
                                              if plan.disk_units else 0)
            if total > plan.host_memory_limit:
                e = _C.HostMemoryError(accumulator_refusal(plan, need, total))
                e.needed_bytes, e.available_bytes, e.limit = total, plan.host_memory_limit, "host_memory_limit"
                raise e
        if self.disk is not None:  # the disk units' accumulators: a tier of their own (offload_dir/grad_accum)
            self.disk.enable_accumulator()
        off = self.offload_plan.offloaded  # disk units and exclusive device-state units: not here
        self._accum = {u.index: torch.zeros(u.state_numel, dtype=torch.float32) for u in self.units
                       if not (off and off[u.index])}

    def nbytes(self) -> int:
        """Host bytes of the fp32 gradient accumulator now allocated (store section or separate)."""
        if self.mode is True:
            return int(self.store.section_bytes.get("grad_accum", 0))
        if self.pieces is not None:
            return self.pieces.accumulator_bytes()
        if self._accum is None:
            return 0
        return sum(t.numel() * 4 for t in self._accum.values())

    def entry_view(self, unit: Unit, i: int) -> torch.Tensor:
        """Shaped view of entry ``i`` of ``unit`` in the accumulator outside the store (allocated if needed).

        Raises:
            ValueError: the entry is frozen (it has no accumulator).
        """
        if self._accum is None:
            self.enable()
        e = unit.entries[i]
        if e.state_offset < 0:
            raise ValueError(f"megatrain: entry {e.name} is frozen: it has no gradient accumulator")
        return self._accum[unit.index][e.state_offset:e.state_offset + e.numel].view(e.shape)


class DeviceStateLayers:
    """The device-state layers of an engine: ``device_state`` (a ``DeviceState`` or None), :meth:`init`, :meth:`resize`.

    Args:
        engine: the engine (``DeviceState`` is built over it; its ``device_state_resident()`` and
            ``free_device_bytes()`` size the choice).
        slots: the engine's :class:`~.slots.SlotPool` (slots dropped / added as layers move).
        waits: the engine's :class:`~.waits.Waits` (``flush`` before a resize).
        sharding: the engine's strategy (data parallel refuses device-state layers).
    """

    def __init__(self, engine, slots, waits, sharding):
        self.engine = engine
        self.layers = engine.layers
        self.disk = engine.disk
        self.compute_dtype = engine.compute_dtype
        self.slots = slots
        self.waits = waits
        self.sharding = sharding
        self.device_state = None  # DeviceState of the device-state layers (init)

    def reserve_exclusive(self, units) -> None:
        """Device buffers for ``units`` (exclusive device-state layers: their fp32 state has no host-store
        section), made before the store is filled: the fill writes their fp32 state through the device tier
        (:mod:`..placement.device_tier`); :meth:`init` then takes their compute copy from the store."""
        from ..placement import device_state as ds

        if units:
            self.device_state = ds.DeviceState(self.engine, units, exclusive=True)

    def init(self, layers) -> int:
        """``Engine.init_device_state``: keep the whole training state of ``layers`` (``int`` K: layers
        ``0 .. K-1``; ``"auto"``; ``"boundary"``) on the device.

        Called once, after the store is filled. ``"auto"``: first the resident unit (embedding, final
        norm, LM head: what the next forward needs first, and the last gradients of a backward) when
        ``Engine.device_state_resident`` offers it and it fits, then as many layers as fit in
        ``AUTO_DEVICE_STATE_FRACTION`` of the free device memory, from the exact buffer sizes
        (compute copy + fp32 master, exp_avg, exp_avg_sq: 14 B/param in bf16, 18 with the fp32 gradient
        accumulator when gradients are summed; 16 for the resident unit, whose compute copy is its existing
        device buffer and which keeps its accumulator).
        ``"boundary"``: the resident unit, then layer 0, while together they fit in
        ``BOUNDARY_DEVICE_STATE_FRACTION`` of the free device memory
        (:func:`~..placement.device_state_plan.plan_boundary_units`).
        Returns K (decoder layers). See ``megatrain.runtime.placement.device_state``.

        Raises:
            ValueError: ``layers`` is not an int >= 0, ``"auto"`` or ``"boundary"``, or more than the model
                has; data parallel with layers > 0.
        """
        from ..placement import device_state as ds
        from ..placement import device_state_plan as dsp

        fixed = self.sharding.check_device_state(layers)
        if fixed is not None:
            return fixed
        eng = self.engine
        dsp.check_device_state_layers(layers)
        on_host = self.layers if self.disk is None else self.layers[:min(u.index for u in self.disk.units)]
        resident = []
        if layers == "boundary":  # the step boundary's units: resident, then layer 0, within a small share
            resident, layers = dsp.plan_boundary_units(eng.device_state_resident(), on_host[0] if on_host else None,
                                                       self.compute_dtype, eng.free_device_bytes())
        elif layers == "auto":  # never a layer whose state is on disk; with exclusive layers (their buffers already
            # reserved) the free bytes their plan read, so that the same rule places them and the others
            planned = getattr(eng, "planned_device_free", None)
            free = planned if self.device_state is not None and planned is not None else eng.free_device_bytes()
            summed = True if getattr(eng, "accumulator_mode", None) is True else None  # as plan_offload sized them
            resident, layers = dsp.plan_auto_units(eng.device_state_resident(), on_host, self.compute_dtype, free,
                                                   with_grad=summed)
            if eng.offload_plan.exclusive_share == "capacity":  # the capacity share holds the exclusive layers
                resident, layers = [], 0  # alone: nothing more of the device goes to state (the rest: activations)
        if self.device_state is not None and isinstance(layers, int):  # "auto" / "boundary": never fewer than
            layers = max(layers, len(self.device_state.units))  # the exclusive layers (planned in the same budget)
        elif self.disk is not None and layers > len(on_host):
            raise ValueError(f"megatrain.wrap: device_state_layers={layers}, but layers {len(on_host)} and above keep "
                             f"their fp32 state on disk (offload_dir); use at most {len(on_host)}")
        if layers > len(self.layers):
            raise ValueError(f"megatrain.wrap: device_state_layers={layers}, but the model has {len(self.layers)} "
                             f"decoder layers; use at most {len(self.layers)} (or 'auto')")
        if layers == 0 and not resident and self.device_state is None:
            return 0
        chosen = resident + self.layers[:layers]
        if self.device_state is None:
            self.device_state = ds.DeviceState(eng, chosen)
        else:  # the exclusive layers reserved before the fill are among the chosen: they take their compute copy
            missing = [u for u in self.device_state.units if u not in chosen]
            assert not missing, [u.index for u in missing]
            self.device_state.add(chosen)
        self._drop_unused_slots(list(self.slots.slots))
        return layers

    def _drop_unused_slots(self, templates) -> None:
        """Free the slots of those layer ``templates`` no streamed layer uses any more."""
        for template in templates:
            if all(u.device_state is not None for u in self.layers if u.template == template):
                self.slots.drop_slots(template)

    def resize(self, layers: int) -> None:
        """``Engine.resize_device_state``: keep the training state of decoder layers ``0 .. layers-1`` on the
        device from now on (the placement planner's second decision; see ``megatrain.runtime.placement.replan``).

        Only between optimizer steps, with no gradient accumulated: waits for every queued update,
        copies the state of the layers given back to the host store and frees their device buffers,
        or copies the new layers' state from the host store; the slots of a layer template come back
        when a streamed layer uses it again and go when none does. The resident unit stays as it is, and
        so do the exclusive layers (their fp32 state has no place in the host store): never fewer than those.
        """
        from ..placement import device_state as ds

        self.waits.flush()
        have = self.device_state.layers if self.device_state is not None else []
        k = len(have)
        layers = max(layers, sum(1 for u in have if u.device_state.exclusive))  # exclusive layers never leave
        if layers == k:
            return
        if layers < k:
            self.device_state.remove(have[layers:])
            for u in have[layers:]:
                if not self.slots.slots.get(u.template):
                    self.slots.add_slots(u)
            if not self.device_state.units:
                self.device_state = None
        else:
            new = self.layers[k:layers]
            if self.device_state is None:
                self.device_state = ds.DeviceState(self.engine, new)
            else:
                self.device_state.add(new)
            self._drop_unused_slots({u.template for u in new})
        self.slots.invalidate(self.layers[min(k, layers):max(k, layers)])


def free_device_bytes(device: torch.device, gpu_memory_limit_bytes: Optional[int]) -> int:
    """Device bytes free for new tensors (CUDA: free + cached by torch, at most ``gpu_memory_limit_bytes``
    less what this process's tensors on the device hold; CPU: available host memory).

    Every placement decision reads the free memory through ``Engine.free_device_bytes`` (device-state
    layers, kept graphs, the planner's second decision, chunked loss and tiling), so
    ``wrap(gpu_memory_limit=)`` caps them all.
    """
    if device.type == "cuda":
        from ..placement.device_state_plan import capped_free_bytes

        free, _ = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        return capped_free_bytes(free + torch.cuda.memory_reserved(device) - allocated, allocated,
                                 gpu_memory_limit_bytes)
    from ..placement.host_memory import host_memory_limits
    return int(host_memory_limits().get("mem_available_bytes") or 0)


def accumulator_refusal(plan, need: int, total: int) -> str:
    """The one-line refusal of an fp32 accumulator over ``host_memory_limit`` (``plan``: the engine's
    :class:`~..placement.offload_plan.OffloadPlan`): the options that make room for it. With
    ``grad_accumulator=True`` the wrap plans it: more leading layers exclusive (their accumulator is on the
    device too) where the device-state layers allow it, more of the deepest on disk with ``offload_dir``."""
    where = []
    if plan.exclusive_units:  # the planner already made layers exclusive: it can make more
        where.append("more leading layers keep their fp32 state and accumulator on the device only, within "
                     "device_state_layers and gpu_memory_limit")
    if plan.offload_dir is not None:
        where.append("more of the deepest layers' fp32 state goes to offload_dir")
    how = f" (the planner then counts it: {'; '.join(where)})" if where else ""
    disk = "" if plan.offload_dir is not None else ", or pass offload_dir=<a local disk> with grad_accumulator=True"
    return (f"megatrain: the fp32 gradient accumulator needs {need} more bytes of host memory ({total} in all) but "
            f"host_memory_limit is {plan.host_memory_limit}: wrap with grad_accumulator=True{how}, raise "
            f"host_memory_limit{disk}")
