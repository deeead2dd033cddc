"""Device slots and the H2D stream: loading a unit's compute copy and binding it onto its modules.

A *slot* is a device buffer holding the compute copy of one unit of a layer template (shape
signature); ``num_slots`` of them per template. :class:`SlotPool` (mixed into
:class:`~megatrain.runtime.engine.Engine`) copies a unit's compute copy into a free slot on the
H2D stream (after the slot's ``buffer_free`` event and the unit's pending CPU update), gates the
compute stream on the slot's ``weights_ready`` event, and binds the parameters as zero-copy views
of the slot.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, List, Optional

import torch

if TYPE_CHECKING:
    from .units import Unit


class Slot:
    """A device buffer that holds the compute copy of one unit of a given template."""

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
    """Slots, H2D copies, prefetch and binding of an :class:`~megatrain.runtime.engine.Engine`."""

    def _init_slots(self, num_slots: int) -> None:
        # Device slots, per layer template.
        self.slots: dict = {}
        for u in self.layers:
            if u.template not in self.slots:
                self.slots[u.template] = [Slot(u.numel, self.compute_dtype, self.device) for _ in range(num_slots)]
        self._use_clock = 0
        if self.cuda:
            self.h2d_stream = torch.cuda.Stream(self.device)

    def invalidate(self, units: List[Unit]) -> None:
        """The compute copy of ``units`` changed in the host store: device copies holding the old one are stale.

        The next ``acquire`` / ``prefetch`` (and the resident buffer's load) copies it again.
        """
        for u in units:
            u.version += 1

    def compute_stream(self):
        """The stream the layers compute on (torch's current stream of the engine's device; CUDA only)."""
        return torch.cuda.current_stream(self.device)

    def wait_update(self, unit: Unit) -> None:
        """Block the calling (main) thread until ``unit``'s pending CPU Adam update is done."""
        pending = [h for h in unit.update_tasks if not h.done]
        if pending:
            t0 = time.perf_counter()
            for h in pending:
                self._worker.wait(h)
            with self._stats_lock:
                self._stats["adam_exposed_s"] += time.perf_counter() - t0
        unit.update_tasks = []
        self._worker.check()
        self.settle()

    def copy_h2d(self, dst: torch.Tensor, unit: Unit, ready_event=None, free_event=None) -> None:
        """Copy ``unit``'s compute copy into device buffer ``dst`` (async on the H2D stream)."""
        self.wait_update(unit)
        src = self.section(unit, "compute")
        rebuilt = unit.grads_in_compute
        if rebuilt:
            # A load between backward and step() (e.g. an evaluation forward): the compute
            # section holds gradients; stream the weights rebuilt from the fp32 masters instead
            # (a rare path: pageable memory, copied synchronously, so the temporary may die after).
            src = self.section(unit, "compute").clone()
            for i, d in enumerate(unit.direct):  # one ledger snapshot
                if d:
                    e = unit.entries[i]
                    src[e.offset:e.offset + e.numel].copy_(self.entry_view(unit, i, "master").view(-1))
        nbytes = src.numel() * src.element_size()
        if not self.cuda:
            dst.copy_(src)
        else:
            with torch.cuda.stream(self.h2d_stream):
                if free_event is not None:
                    self.h2d_stream.wait_event(free_event)
                if self.debug:
                    torch.cuda._sleep(2_000_000)  # ~1 ms: make copy races visible
                end = self._timed("h2d", self.h2d_stream)
                dst.copy_(src, non_blocking=not rebuilt)
                end.record(self.h2d_stream)
                if ready_event is not None:
                    ready_event.record(self.h2d_stream)
        self._stats["h2d_bytes"] += nbytes
        self._stats["h2d_copies"] += 1

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

    def acquire(self, unit: Unit) -> Slot:
        """Return a slot holding ``unit``'s current weights; the compute stream waits for them.

        A device-state layer's slot is its permanent device buffer (no copy, no wait).
        """
        if unit.device_state is not None:
            slot = unit.device_state.slot
            slot.in_use += 1
            return slot
        slot = self._find_slot(unit)
        if slot is None:
            slot = self._load(unit)
            if slot is None:
                raise RuntimeError(
                    f"megatrain: no free device slot for layer unit {unit.index}; "
                    "increase num_slots in megatrain.wrap(...)")
        else:
            self._stats["slot_hits"] += 1
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
        slot = self._find_slot(unit)
        if slot is not None:
            return slot
        if isinstance(current, Slot):
            current = (current,)
        return self._load(unit, protect=current)

    def release(self, slot: Slot) -> None:
        """Mark the compute stream's use of ``slot`` finished (records ``buffer_free``)."""
        slot.in_use -= 1
        if getattr(slot, "permanent", False):  # a device-state layer's own buffer: never reused, never poisoned
            return
        if slot.in_use == 0:
            if self.debug:
                slot.buf.fill_(float("nan"))  # poison: any read of a released slot shows up as NaN
                slot.unit, slot.version = None, -1
            if self.cuda:
                slot.buffer_free.record(self.compute_stream())
                slot.free_recorded = True

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

    # ------------------------------------------------------------------ gradients
