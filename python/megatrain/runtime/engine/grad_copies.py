"""The D2H copies of a layer's weight gradients (and of their squared-norm inputs) into the host store.

:class:`GradCopies` (the engine's ``copies`` part: it owns the D2H stream and the pinned rows the
squared norms are read back into) enqueues them on the D2H stream once the compute stream's work so
far (the layer's backward) is done, and returns the event the CPU worker's gradient task waits for.
Its interface: ``copy_grads_d2h``, ``d2h_done_torch`` and the attribute ``d2h_stream``. With ``Options.cpp_slots`` (the default) the
stream ordering, the copies and the events are the C++ scheduler's (``_C.copy_to_host``,
``csrc/megatrain/scheduler/streams.h``); otherwise torch's streams and events. On the CPU the
copies are synchronous.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

import torch

from ..._loader import load_extension

if TYPE_CHECKING:
    from .units import Unit

_C = load_extension()


class GradCopies:
    """Gradient D2H of an engine (see the module docstring).

    Args:
        ctx: the engine's :class:`~.context.EngineContext` (device, units, options).
        debug: ``Options.debug_races``; d2h_overlap: ``Options.d2h_overlap``.
        counters: :class:`~.stats.EngineCounters`; slots: :class:`~.slots.SlotPool` (``compute_stream``,
            ``debug_delay``); waits: :class:`~.waits.Waits` (``wait_task``).
    """

    def __init__(self, ctx, debug: bool, d2h_overlap: bool, counters, slots, waits):
        self.cuda = ctx.cuda
        self.cpp_slots = ctx.options.cpp_slots
        self.debug = debug
        self.d2h_overlap = d2h_overlap
        self._device_index = ctx.device_index
        self.counters = counters
        self.slots = slots
        self.waits = waits
        if self.cuda:
            self.d2h_stream = torch.cuda.Stream(ctx.device)
        # Squared-norm readback of direct gradients: one pinned row per unit, allocated once (the
        # unit's previous gradient task, which reads its row, is waited for before it is rewritten).
        n_units = len(ctx.units)
        max_entries = max((len(u.entries) for u in ctx.units), default=0)
        self._norm_rows = None
        if self.cuda:
            self._norm_rows = _C.pinned_empty(n_units * max_entries, torch.float64).view(n_units, max_entries)

    def copy_grads_d2h(self, unit: Unit, grads: List[Optional[torch.Tensor]], direct: List[bool],
                       compute: Optional[torch.Tensor], staging: Optional[torch.Tensor], norm_idx: List[int],
                       dev_norms: Optional[torch.Tensor]):
        """Copy ``unit``'s gradients into the host store (thread running backward).

        Args:
            grads: per entry, its gradient (device, the compute dtype) or None.
            direct: per entry, True: into its slice of ``compute`` (the unit's compute section,
                pinned CPU); False: into its slice of ``staging`` (a pinned staging buffer).
            norm_idx: the entries whose norms ``dev_norms`` holds (float64, device), or
                ``dev_norms`` None: no norms.

        Returns:
            ``(norms, ready)``: the norms on the host (the unit's pinned read-back row, or
            ``dev_norms`` itself on the CPU; None without norms), and the event the copies record
            when done (``_C.CudaEvent`` or ``torch.cuda.Event``; None on the CPU).
        """
        if not self.cuda:
            self.counters.add("d2h_bytes", self._host_copies(unit, grads, direct, compute, staging))
            return dev_norms, None
        norms = None
        if dev_norms is not None:
            self.waits.wait_task(unit.grad_task)  # it read this row; almost always long done
            norms = self._norm_rows[unit.index, :len(norm_idx)]
        if self.cpp_slots:
            ev, nbytes = self._d2h_native(unit, grads, direct, compute, staging, norms, dev_norms)
        else:
            ev, nbytes = self._d2h_torch(unit, grads, direct, compute, staging, norms, dev_norms)
        self.counters.add("d2h_bytes", nbytes)
        return norms, ev

    def _host_copies(self, unit: Unit, grads, direct, compute, staging, non_blocking: bool = False) -> int:
        n = 0
        for i, (e, g) in enumerate(zip(unit.entries, grads)):
            if g is not None:
                dst = compute if direct[i] else staging
                dst[e.offset:e.offset + e.numel].copy_(g.reshape(-1), non_blocking=non_blocking)
                n += g.numel() * g.element_size()
        return n

    def _d2h_native(self, unit: Unit, grads, direct, compute, staging, norms, dev_norms):
        """The copies with the C++ copy path: ``_C.copy_to_host`` after the compute stream's work so far."""
        pairs, nbytes = [], 0
        for i, (e, g) in enumerate(zip(unit.entries, grads)):
            if g is None:
                continue
            dst = (compute if direct[i] else staging)[e.offset:e.offset + e.numel]
            src = g.reshape(-1)  # on the compute stream, before backward-done (a copy only if strided)
            if src.dtype != dst.dtype:
                src = src.to(dst.dtype)
            pairs.append((dst, src.contiguous()))
            nbytes += g.numel() * g.element_size()
        if norms is not None:
            pairs.append((norms, dev_norms))
        done = _C.CudaEvent(False, self._device_index)
        delay = (lambda: self.slots.debug_delay(self.d2h_stream)) if self.debug else None
        _C.copy_to_host(pairs, self.d2h_stream.cuda_stream, after_stream=self.slots.compute_stream().cuda_stream,
                        device=self._device_index, timing=self.counters.copy_timing("d2h"), done=done, before_copy=delay)
        for _, src in pairs:
            src.record_stream(self.d2h_stream)  # the caching allocator keeps it until the copy ran
        if not self.d2h_overlap:
            _C.stream_wait_event(self.slots.compute_stream().cuda_stream, done)
        return done, nbytes

    def _d2h_torch(self, unit: Unit, grads, direct, compute, staging, norms, dev_norms):
        """The copies on torch's streams and events (``cpp_slots=False``)."""
        backward_done = torch.cuda.Event()
        backward_done.record(self.slots.compute_stream())
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(backward_done)
            if self.debug:
                torch.cuda._sleep(2_000_000)
            end = self.counters.timed("d2h", self.d2h_stream)
            nbytes = self._host_copies(unit, grads, direct, compute, staging, non_blocking=True)
            for g in grads:
                if g is not None:
                    g.record_stream(self.d2h_stream)
            if norms is not None:
                norms.copy_(dev_norms, non_blocking=True)
                dev_norms.record_stream(self.d2h_stream)
            end.record(self.d2h_stream)
        return self.d2h_done_torch(), nbytes

    def d2h_done_torch(self) -> "torch.cuda.Event":
        """The torch path's copy-done event, recorded on the D2H stream after the copies enqueued so far
        (call outside ``torch.cuda.stream(d2h_stream)``); the compute stream waits for it unless
        ``d2h_overlap``."""
        ev = torch.cuda.Event()
        ev.record(self.d2h_stream)
        if not self.d2h_overlap:
            self.slots.compute_stream().wait_event(ev)
        return ev
