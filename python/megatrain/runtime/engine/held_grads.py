"""The gradients of master-streamed layers (no compute section in the host store) held on the device.

At ``gradient_accumulation_steps == 1`` a master-streamed layer's bf16 weight gradients have no host
section to land in: :class:`HeldGrads` (``GradLedger.held``) keeps the device tensors until the layer's
update may run (``step()``, after the global norm), then copies them D2H into a buffer of the bounded
staging pool that the CPU AdamW task reads (the buffer goes back when the task ran).

When every pool buffer is read by a queued update, ``step()`` does not wait for one: the update is
*deferred* (in forward order) and submitted as soon as a buffer is free, at the next sync point of the
main thread (:meth:`HeldGrads.pump`: each load's ``wait_update``, without blocking), and at the latest
when its unit is needed (``wait_update`` of that unit, ``flush``): so the CPU AdamW of the other layers
still overlaps the next forward. See docs/architecture.md ("Master-streamed layers").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

if TYPE_CHECKING:
    from .units import Unit


class HeldGrads:
    """Held device gradients and deferred updates of master-streamed units (see the module docstring).

    Args:
        grads: the engine's :class:`~.grads.GradLedger` (its staging pool and its ``copies`` part).
    """

    def __init__(self, grads):
        self.grads = grads
        self._held: dict = {}  # unit index -> {entry index: device gradient}
        self._deferred: list = []  # [(unit, {entry: gradient}, submit(buffer, ready, entries))] in forward order

    def hold(self, unit: Unit, grads: dict) -> None:
        """Keep ``grads`` (entry index -> device tensor) of ``unit`` until its update takes them."""
        self._held.setdefault(unit.index, {}).update(grads)

    def has(self, unit: Unit) -> bool:
        """Whether ``unit`` holds device gradients no update took yet."""
        return bool(self._held.get(unit.index))

    def drop(self, unit: Unit) -> None:
        """Forget ``unit``'s held gradients (``zero_grad``, a skipped step); a deferred update keeps its own."""
        self._held.pop(unit.index, None)

    def _copy(self, unit: Unit, held: dict, buf: torch.Tensor):
        grads = [held.get(i) for i in range(len(unit.entries))]
        _, ev = self.grads.copies.copy_grads_d2h(unit, grads, [g is not None for g in grads], buf, None, [], None)
        return ev

    def take(self, unit: Unit):
        """``(buffer, ready, entries)``: ``unit``'s held gradients copied D2H into a pool buffer (the compute
        section's layout; waits for one), the copy's event (None on the CPU) and the entries copied. Give the
        buffer back with ``GradLedger.record_update_staging`` or ``give_back``."""
        held = self._held.pop(unit.index, {})
        buf = self.grads.staging_buffer()
        return buf, self._copy(unit, held, buf), set(held)

    def submit_or_defer(self, unit: Unit, submit: Callable) -> None:
        """Copy ``unit``'s held gradients D2H and call ``submit(buffer, ready, entries)`` (which queues its update)
        now when a pool buffer is free and no earlier update is deferred; else defer both (:meth:`pump`)."""
        held = self._held.pop(unit.index, {})
        self._deferred.append((unit, held, submit))
        self.pump()

    def deferred(self, unit: Unit) -> bool:
        """Whether ``unit``'s update is deferred (waiting for a staging buffer)."""
        return any(u is unit for u, _, _ in self._deferred)

    def pump(self, until: Optional[Unit] = None, everything: bool = False) -> None:
        """Submit the deferred updates, in order, while a pool buffer is free; up to ``until``'s (or all, with
        ``everything``) waiting for buffers as needed. Main thread."""
        need = len(self._deferred) if everything else next(
            (k + 1 for k, (u, _, _) in enumerate(self._deferred) if u is until), 0) if until is not None else 0
        while self._deferred:
            buf = self.grads.staging_buffer() if need > 0 else self.grads.try_staging_buffer()
            if buf is None:
                return
            unit, held, submit = self._deferred.pop(0)
            need -= 1
            submit(buf, self._copy(unit, held, buf), set(held))
