"""Device slots and the H2D stream: loading a unit's compute copy and binding it onto its modules.

A *slot* is a device buffer holding the compute copy of one unit of a layer template (shape
signature); ``num_slots`` of them per template. :class:`SlotPool` (the engine's ``slot_pool`` part)
owns the slots and the H2D stream: it copies a unit's compute copy into a free slot on the
H2D stream (after the slot's ``buffer_free`` event and the unit's pending CPU update), gates the
compute stream on the slot's ``weights_ready`` event, and binds the parameters as zero-copy views
of the slot. Its interface: ``acquire`` / ``prefetch`` / ``release``, ``copy_h2d``, ``bind`` /
``unbind``, ``add_slots`` / ``drop_slots``, ``invalidate``, ``compute_stream``, ``debug_delay``, and
the attributes ``slots`` (layer template -> its slots), ``h2d_stream``, ``cpp_slots``.

Which slot holds which unit and version, the in-use counts, the reuse order, the events and the
H2D copies are the C++ :class:`megatrain._C.SlotPool` (``csrc/megatrain/scheduler/slot_pool.h``,
``streams.h``); the slots' buffers are torch tensors allocated here. ``Options.cpp_slots=False``
runs the same state machine in Python on torch streams and events instead (:class:`Slot`: the
path before the C++ pool, kept for a benchmark's before/after in one process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

import torch

from ..._loader import load_extension

if TYPE_CHECKING:
    from .units import Unit

_C = load_extension()


class NativeSlot:
    """A slot of the C++ pool: its device buffer and index (its state is the C++ pool's ``state(index)``)."""

    __slots__ = ("buf", "index")
    permanent = False

    def __init__(self, buf: torch.Tensor, index: int):
        self.buf = buf
        self.index = index


class Slot:
    """A device buffer that holds the compute copy of one unit of a given template (``cpp_slots=False``)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.buf = torch.empty(numel, dtype=dtype, device=device)
        self.unit: Optional[Unit] = None
        self.version = -1
        self.in_use = 0
        self.last_use = 0
        cuda = device.type == "cuda"
        self.weights_ready = torch.cuda.Event() if cuda else None
        self.buffer_free = torch.cuda.Event() if cuda else None
        self.free_recorded = False


class SlotPool:
    """Slots, H2D copies, prefetch and binding of an engine (see module docstring).

    Args:
        ctx: the engine's :class:`~.context.EngineContext` (device, dtype, layers, options).
        num_slots: device slots per layer template.
        debug: ``Options.debug_races`` (delay copies, poison released slots).
        counters: the engine's :class:`~.stats.EngineCounters`.
        views: the engine's :class:`~.views.StoreViews` (the compute sections copied H2D).
    """

    def __init__(self, ctx, num_slots: int, debug: bool, counters, views):
        self.num_slots = num_slots
        self.compute_dtype = ctx.compute_dtype
        self.device = ctx.device
        self.cuda = ctx.cuda
        self.debug = debug
        self.counters = counters
        self.views = views
        self.waits = None  # set by connect
        # Device slots, per layer template.
        self.cpp_slots = ctx.options.cpp_slots
        if self.cuda:
            self.h2d_stream = torch.cuda.Stream(self.device)
        self._device_index = ctx.device_index
        self.slots: dict = {}
        self._template_ids: dict = {}
        self._use_clock = 0
        self._pool = None
        self._master_staging = None  # master-streamed units: the device fp32 buffer their masters are copied into
        if self.cpp_slots:
            self._pool = _C.SlotPool(self.cuda, self.h2d_stream.cuda_stream if self.cuda else 0, self._device_index)
        for u in ctx.layers:
            if u.template not in self.slots:
                self._template_ids[u.template] = len(self._template_ids)
                self.add_slots(u)

    def connect(self, waits) -> None:
        """``waits``: the engine's :class:`~.waits.Waits` (a load waits for the unit's pending update)."""
        self.waits = waits

    def add_slots(self, unit: Unit) -> None:
        """Allocate the ``num_slots`` device slots of ``unit``'s layer template (none may exist)."""
        n = self.num_slots
        if self._pool is None:
            self.slots[unit.template] = [Slot(unit.numel, self.compute_dtype, self.device) for _ in range(n)]
            return
        tid = self._template_ids[unit.template]
        bufs = [torch.empty(unit.numel, dtype=self.compute_dtype, device=self.device) for _ in range(n)]
        self.slots[unit.template] = [NativeSlot(b, self._pool.add_slot(tid, b)) for b in bufs]

    def drop_slots(self, template) -> None:
        """No streamed layer uses layer template ``template`` any more: free its slots."""
        if self._pool is not None:
            self._pool.drop_template(self._template_ids[template])
        self.slots[template] = []

    def invalidate(self, units: List[Unit]) -> None:
        """The compute copy of ``units`` changed in the host store: device copies holding the old one are stale.

        The next ``acquire`` / ``prefetch`` (and the resident buffer's load) copies it again.
        """
        for u in units:
            u.version += 1

    def compute_stream(self):
        """The stream the layers compute on (torch's current stream of the engine's device; CUDA only)."""
        return torch.cuda.current_stream(self.device)

    def _h2d_source(self, unit: Unit):
        """``(src, rebuilt)``: the host tensor holding ``unit``'s weights now, after its pending update.

        ``rebuilt``: a load between backward and step() (e.g. an evaluation forward): the compute
        section holds gradients; ``src`` is the weights rebuilt from the fp32 masters instead (a
        rare path: pageable memory, copied synchronously, so the temporary may die after).
        """
        self.waits.wait_update(unit)
        src = self.views.section(unit, "compute")
        rebuilt = unit.grads_in_compute
        if rebuilt:
            src = self.views.section(unit, "compute").clone()
            with self.views.state_window(write=False):  # a disk unit's masters: read through the tier
                for i, d in enumerate(unit.direct):  # one ledger snapshot
                    if d:
                        e = unit.entries[i]
                        src[e.offset:e.offset + e.numel].copy_(self.views.entry_view(unit, i, "master").view(-1))
        self.counters.add("h2d_bytes", src.numel() * src.element_size())
        self.counters.add("h2d_copies", 1)
        return src, rebuilt

    def debug_delay(self, stream) -> None:
        """``debug_races``: ~1 ms of device time on ``stream`` before a copy (makes copy races visible)."""
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000)

    def fill_from_master(self, dst: torch.Tensor, unit: Unit) -> None:
        """Fill device buffer ``dst`` (the compute dtype, ``unit.numel``) with master-streamed ``unit``'s
        weights: the fp32 master section copied H2D into a device fp32 staging buffer, then cast into ``dst``
        (round to nearest even: the bits the CPU AdamW's compute copy would have), both on the H2D stream (the
        caller made it wait for ``dst``'s ``buffer_free`` and records ``weights_ready`` after). On the CPU
        backend a cast copy, at once. The caller waited for the unit's pending update."""
        master = self.views.section(unit, "master")
        self.counters.add("h2d_bytes", master.numel() * master.element_size())
        self.counters.add("h2d_copies", 1)
        if not self.cuda:
            dst.copy_(master[:dst.numel()])
            return
        with torch.cuda.stream(self.h2d_stream):
            if self._master_staging is None or self._master_staging.numel() < master.numel():
                self._master_staging = torch.empty(master.numel(), dtype=torch.float32, device=self.device)
            staging = self._master_staging[:master.numel()]
            if self.debug:
                torch.cuda._sleep(2_000_000)  # ~1 ms: make copy races visible
            end = self.counters.timed("h2d", self.h2d_stream)
            staging.copy_(master, non_blocking=True)
            dst.copy_(staging[:dst.numel()])  # the cast, on the device (the same stream: after the copy)
            end.record(self.h2d_stream)

    def _ms_sync(self, unit: Unit) -> bool:
        """A master-streamed unit's load must complete before returning: its gradients wait for an update that
        may be queued before the load ran (a load between backward and ``step()``)."""
        return bool(self.cuda and unit.grads_in_compute)

    def copy_h2d(self, dst: torch.Tensor, unit: Unit, ready_event=None, free_event=None) -> None:
        """Copy ``unit``'s compute copy into device buffer ``dst`` (async on the H2D stream; the
        resident unit's buffer, and the slots when ``cpp_slots`` is off). A master-streamed unit's is cast
        from its fp32 master (:meth:`fill_from_master`)."""
        if unit.master_streamed:
            self.waits.wait_update(unit)
            if self.cuda and free_event is not None:
                self.h2d_stream.wait_event(free_event)
            self.fill_from_master(dst, unit)
            if self.cuda and ready_event is not None:
                ready_event.record(self.h2d_stream)
            if self._ms_sync(unit):
                self.h2d_stream.synchronize()
            return
        src, rebuilt = self._h2d_source(unit)
        if not self.cuda:
            dst.copy_(src)
        else:
            with torch.cuda.stream(self.h2d_stream):
                if free_event is not None:
                    self.h2d_stream.wait_event(free_event)
                if self.debug:
                    torch.cuda._sleep(2_000_000)  # ~1 ms: make copy races visible
                end = self.counters.timed("h2d", self.h2d_stream)
                dst.copy_(src, non_blocking=not rebuilt)
                end.record(self.h2d_stream)
                if ready_event is not None:
                    ready_event.record(self.h2d_stream)

    # ------------------------------------------------------------------ slots
    def _find_slot(self, unit: Unit) -> Optional[Slot]:
        for s in self.slots[unit.template]:
            if s.unit is unit and s.version == unit.version:
                return s
        return None

    def _load(self, unit: Unit, protect=()) -> Optional[Slot]:
        free = [s for s in self.slots[unit.template] if s.in_use == 0 and all(s is not p for p in protect)]
        if not free:
            return None
        slot = min(free, key=lambda s: s.last_use)
        self.copy_h2d(slot.buf, unit, slot.weights_ready, slot.buffer_free if slot.free_recorded else None)
        slot.unit, slot.version = unit, unit.version  # current until ``invalidate``
        self._use_clock += 1
        slot.last_use = self._use_clock
        return slot

    def acquire(self, unit: Unit):
        """Return a slot holding ``unit``'s current weights; the compute stream waits for them.

        A device-state layer's slot is its permanent device buffer (no copy, no wait); a direct gradient
        there moves to the layer's fp32 accumulator first and its weights are rebuilt from the master.

        Raises:
            RuntimeError: every slot of the unit's template is in use (``num_slots`` too small).
        """
        if unit.device_state is not None:
            unit.device_state.take_weights()  # a direct gradient in its buffer: weights back from the master
            slot = unit.device_state.slot
            slot.in_use += 1
            return slot
        if self._pool is not None:
            return self._acquire_native(unit)
        slot = self._find_slot(unit)
        if slot is None:
            slot = self._load(unit)
            if slot is None:
                raise RuntimeError(
                    f"megatrain: no free device slot for layer unit {unit.index}; "
                    "increase num_slots in megatrain.wrap(...)")
        else:
            self.counters.add("slot_hits", 1)
        if self.cuda:
            self.compute_stream().wait_event(slot.weights_ready)
        slot.in_use += 1
        self._use_clock += 1
        slot.last_use = self._use_clock
        return slot

    def prefetch(self, unit: Optional[Unit], current=()) -> Optional[Slot]:
        """Start loading ``unit`` into a free slot, sparing the slots in ``current``.

        Returns the slot that holds (or will hold) ``unit``, or None if no slot was free.
        """
        if unit is None:
            return None
        if unit.device_state is not None:
            return unit.device_state.slot  # always there: nothing to load
        if self._pool is not None:
            return self._prefetch_native(unit, current)
        slot = self._find_slot(unit)
        if slot is not None:
            return slot
        if isinstance(current, Slot):
            current = (current,)
        return self._load(unit, protect=current)

    def release(self, slot) -> None:
        """Mark the compute stream's use of ``slot`` finished (records ``buffer_free``)."""
        if getattr(slot, "permanent", False):  # a device-state layer's own buffer: never reused, never poisoned
            slot.in_use -= 1
            return
        if self._pool is not None:
            return self._release_native(slot)
        slot.in_use -= 1
        if slot.in_use == 0:
            if self.debug:
                slot.buf.fill_(float("nan"))  # poison: any read of a released slot shows up as NaN
                slot.unit, slot.version = None, -1
            if self.cuda:
                slot.buffer_free.record(self.compute_stream())
                slot.free_recorded = True

    # ------------------------------------------------------------------ the C++ pool (cpp_slots)
    def _compute_stream_handle(self) -> int:
        return self.compute_stream().cuda_stream if self.cuda else 0

    def _native_slot(self, unit: Unit, index: int) -> NativeSlot:
        for s in self.slots[unit.template]:
            if s.index == index:
                return s
        raise AssertionError(f"slot {index} is not one of layer template {unit.template}'s")

    def _load_native(self, unit: Unit, protect=()) -> Optional[NativeSlot]:
        keep = [p.index for p in protect if isinstance(p, NativeSlot)]
        i = self._pool.pick(self._template_ids[unit.template], keep)
        if i < 0:
            return None
        if unit.master_streamed:  # filled on the H2D stream after the slot's buffer_free (C++ pool's state machine)
            self.waits.wait_update(unit)
            slot = self._native_slot(unit, i)
            self._pool.fill(i, unit.index, unit.version, lambda: self.fill_from_master(slot.buf, unit),
                            sync=self._ms_sync(unit))
            return slot
        src, rebuilt = self._h2d_source(unit)
        timing = self.counters.copy_timing("h2d") if self.cuda else None
        delay = (lambda: self.debug_delay(self.h2d_stream)) if self.cuda and self.debug else None
        self._pool.load(i, unit.index, unit.version, src, sync=rebuilt, timing=timing, before_copy=delay)
        return self._native_slot(unit, i)

    def _acquire_native(self, unit: Unit) -> NativeSlot:
        i = self._pool.find(self._template_ids[unit.template], unit.index, unit.version)
        if i < 0:
            slot = self._load_native(unit)
            if slot is None:
                raise RuntimeError(
                    f"megatrain: no free device slot for layer unit {unit.index}; "
                    "increase num_slots in megatrain.wrap(...)")
        else:
            slot = self._native_slot(unit, i)
            self.counters.add("slot_hits", 1)
        self._pool.acquire(slot.index, self._compute_stream_handle())
        return slot

    def _prefetch_native(self, unit: Unit, current) -> Optional[NativeSlot]:
        i = self._pool.find(self._template_ids[unit.template], unit.index, unit.version)
        if i >= 0:
            return self._native_slot(unit, i)
        if not isinstance(current, (list, tuple)):
            current = (current,)
        return self._load_native(unit, protect=current)

    def _release_native(self, slot: NativeSlot) -> None:
        if self.debug and self._pool.in_use(slot.index) == 1:
            slot.buf.fill_(float("nan"))  # poison: any read of a released slot shows up as NaN
        self._pool.release(slot.index, self._compute_stream_handle(), forget=self.debug)

    def bind(self, unit: Unit, flat: torch.Tensor, requires_grad: bool = False) -> List[torch.Tensor]:
        """Bind ``unit``'s parameters as zero-copy views of ``flat`` onto their modules.

        Returns the bound tensors (leaves that require grad where ``requires_grad`` and the
        parameter itself requires grad).
        """
        bound = []
        for e in unit.entries:
            v = flat[e.offset:e.offset + e.numel].view(e.shape)
            if requires_grad and e.param.requires_grad:
                v = v.detach().requires_grad_(True)
            for mod, attr in e.owners:
                mod._parameters[attr] = v
            bound.append(v)
        return bound

    def unbind(self, unit: Unit) -> None:
        """Restore the placeholder parameters (the layer owns no storage between uses)."""
        for e in unit.entries:
            for mod, attr in e.owners:
                mod._parameters[attr] = e.param
