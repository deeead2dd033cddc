"""Update submission over the C++ gradient ledger: the fused CPU AdamW tasks, moving direct
gradients to the fp32 accumulator, and forgetting gradients (``zero_grad``).

:class:`UpdateQueue` is the engine's ``updates`` part; it queues the worker's update tasks
(``_C.Worker.submit_adam``, no GIL) and has :class:`~megatrain.runtime.engine.grads.GradLedger` record
what they report for its ``settle``. The gradients it reads were handed over by
:class:`~megatrain.runtime.engine.grads.GradLedger`. Its interface: ``submit_adam``, ``submit_update``,
``ensure_weights``, ``zero_grad``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

import torch

from .worker import _Worker

if TYPE_CHECKING:
    from .units import Unit


class UpdateQueue:
    """Update submission of an engine (see module docstring).

    Args:
        ctx: the engine's :class:`~.context.EngineContext` (units, disk tier, sharding).
        overlap: ``Options.overlap`` (False: updates are gradient-class tasks, never overlapping).
    """

    def __init__(self, ctx, overlap: bool):
        self.units = ctx.units
        self.disk = ctx.disk
        self.sharding = ctx.sharding
        self.overlap = overlap
        self.worker = self.grads = self.views = self.accumulator = self.waits = None
        self.slots = self.device_layers = None

    def connect(self, worker, grads, views, accumulator, waits, slots, device_layers) -> None:
        """The collaborators: the CPU worker, :class:`~.grads.GradLedger` (ledger, optimizer, outcomes),
        :class:`~.views.StoreViews` (``task_view``), :class:`~.memory.Accumulator`, :class:`~.waits.Waits`,
        :class:`~.slots.SlotPool` (``invalidate``) and :class:`~.memory.DeviceStateLayers`."""
        self.worker, self.grads, self.views, self.accumulator = worker, grads, views, accumulator
        self.waits, self.slots, self.device_layers = waits, slots, device_layers

    def submit_adam(self, unit: Unit, items, scale: float, after=None, entries: Optional[List[int]] = None,
                    zero_grads=(), finite_from=None, grad_buf=None, held=None, step_number=None) -> None:
        """Queue the fused AdamW of ``unit``'s ``entries`` (default: all; ``_C.Worker.submit_adam``, by deadline).

        The ledger queues the entries' updates now; the loads of the unit wait for the task
        (``unit.update_tasks``). Each entry's gradient is read from the compute section (a direct
        gradient no update took over yet) or the fp32 accumulator; direct entries that are not
        updated (not in this optimizer) get their weights back. ``after``: the handle of the
        unit's gradient task (the update is not started before it ran). ``finite_from``: that
        task's ``GradOutcome``; a non-finite gradient skips the update (the masters are untouched,
        the compute copy is rewritten from them, and ``settle`` has the optimizer undo the step
        count). ``zero_grads``: entries updated with an all-zero gradient
        (``zero_grad(set_to_none=False)`` and no backward since).

        A master-streamed unit (no compute section): its direct gradients (``held``: the entries; None: the
        direct ones) are read from ``grad_buf`` (a pool staging buffer they were copied into, gated by
        ``after``) or, held on the device, copied D2H into one first (:class:`~.held_grads.HeldGrads`: now, or
        deferred while every buffer is in use); no compute copy is written or restored. ``step_number``: the
        ``step()`` the update belongs to (default: the optimizer's next).
        """
        entries = list(range(len(unit.entries))) if entries is None else list(entries)
        direct = unit.direct
        updated = {it[0] for it in items}
        zero = set(zero_grads)

        def view(i, name):
            return self.views.task_view(unit, i, name)

        ms = unit.master_streamed
        opt = self.grads.optimizer
        step_number = getattr(opt, "steps_called", 0) + 1 if step_number is None else step_number
        if ms and grad_buf is None and self.grads.held.has(unit):  # step(): the gradient tasks already ran
            return self.grads.held.submit_or_defer(unit, lambda buf, ready, keys: self.submit_adam(
                unit, items, scale, after=ready, entries=entries, zero_grads=zero_grads, grad_buf=buf, held=keys,
                step_number=step_number))
        held = {i for i, d in enumerate(direct) if d} if held is None else held

        def grad_src(i):
            if i in zero:
                return torch.zeros(view(i, "master").numel(), dtype=torch.float32)
            if ms and i in held:
                e = unit.entries[i]
                return grad_buf[e.offset:e.offset + e.numel]
            return view(i, "compute" if direct[i] else "grad_accum")

        if unit.disk is not None:  # the fp32 state on disk: the task acquires the unit from the tier
            adam_items, restore, on_skip = [], [], []
            tier_items, restore_tier, on_skip_tier, tier = self.disk.adam_args(
                unit, items, entries, zero, direct, lambda i: view(i, "compute"))
            tier.update(tier_items=tier_items, restore_tier=restore_tier, restore_on_skip_tier=on_skip_tier)
            key = self.disk.update_key(unit)
            self.disk.prefetch([unit])
        else:
            adam_items = [(i, view(i, "master"), view(i, "exp_avg"), view(i, "exp_avg_sq"), grad_src(i),
                           None if ms else view(i, "compute"), lr, b1, b2, eps, wd, step)
                          for i, lr, b1, b2, eps, wd, step in items]
            back = [] if ms else [i for i in entries if direct[i]]  # master-streamed: no compute copy to restore
            restore = [(view(i, "master"), view(i, "compute")) for i in back if i not in updated]
            on_skip = [(view(i, "master"), view(i, "compute")) for i in back]
            tier, key = {}, unit.update_key
        klass = _Worker.UPDATE if self.overlap else _Worker.GRAD
        handle, outcome = self.worker.submit_adam(self.grads.ledger, unit.index, adam_items, scale, restore, entries,
                                                   finite_from, on_skip, klass, key, after, **tier)
        unit.update_tasks.append(handle)
        self.grads.record_update(handle, outcome, opt, unit, items, step_number)
        if grad_buf is not None:
            self.grads.record_update_staging(handle, grad_buf)

    def ensure_weights(self, unit: Unit) -> None:
        """Move ``unit``'s direct gradients from the compute section to the fp32 accumulator (waits).

        Needed when an entry gets a second gradient before the optimizer stepped (gradient
        accumulation the optimizer was not told about): the first one still counts, and the
        compute copy is rewritten from the fp32 master weights.
        """
        direct = [i for i, d in enumerate(unit.direct) if d]
        if not direct:
            return
        self.accumulator.enable()
        if unit.master_streamed:  # held on the device: D2H, then summed into the accumulator like a staged gradient
            buf, ready, _ = self.grads.held.take(unit)
            if ready is not None:
                ready.synchronize()  # the D2H copy done
            moved = [(i, self.views.task_view(unit, i, "grad_accum"), self.views.task_view(unit, i, "master"),
                      buf[e.offset:e.offset + e.numel]) for i, e in ((i, unit.entries[i]) for i in direct)]
            self.waits.wait_task(self.worker.submit_move_to_accumulator(self.grads.ledger, unit.index, moved))
            return self.grads.give_back(buf)  # (the weights the task writes back there are not read)
        if unit.disk is not None:  # the accumulator and the masters on disk
            moved_tier = [(i, unit.entries[i].state_offset, self.views.task_view(unit, i, "compute")) for i in direct]
            handle = self.worker.submit_move_to_accumulator(self.grads.ledger, unit.index, [], moved_tier=moved_tier,
                                                             **self.disk.state_args(unit, accum=True))
        else:
            moved = [(i, self.views.task_view(unit, i, "grad_accum"), self.views.task_view(unit, i, "master"),
                      self.views.task_view(unit, i, "compute")) for i in direct]
            handle = self.worker.submit_move_to_accumulator(self.grads.ledger, unit.index, moved)
        self.waits.wait_task(handle)

    def zero_grad(self) -> None:
        """Forget accumulated gradients (the next backward overwrites the accumulators).

        Waits for the gradient tasks in flight, resets every entry of the ledger, and queues the
        weights back for gradients D2H'd into the compute section and never used (the loads of
        those units wait for it).
        """
        self.worker.wait_grads()
        self.grads.settle()
        restore = []
        for u in self.units:
            idx = [i for i, d in enumerate(u.direct) if d]
            for i in range(len(u.entries)):
                self.grads.ledger.reset(u.index, i)
            if u.master_streamed:
                self.grads.held.drop(u)  # the masters are untouched: nothing to restore
            elif idx:
                restore.append((u, idx))
        for u, idx in restore:
            if u.disk is not None:  # the masters on disk
                back, tier = [], dict(restore_tier=[(u.entries[i].state_offset, self.views.task_view(u, i, "compute"))
                                                    for i in idx], **self.disk.state_args(u))
            else:
                back, tier = [(self.views.task_view(u, i, "master"), self.views.task_view(u, i, "compute")) for i in idx], {}
            handle, _ = self.worker.submit_adam(self.grads.ledger, u.index, [], 1.0, back, idx, None, [], _Worker.GRAD, 0,
                                                 None, **tier)
            u.update_tasks.append(handle)
        if self.device_layers.device_state is not None:  # their direct gradients, on the device
            self.device_layers.device_state.drop_grads()
        self.sharding.after_zero_grad(self.units)

    def submit_update(self, unit: Unit, items, scale: float, entries: Optional[List[int]] = None,
                      zero_grads=(), finite_on_device: bool = False) -> None:
        """Queue the AdamW update of ``unit``'s ``entries`` (default all; worker, by deadline).

        Bumps the unit's version now. The gradient is the fp32 accumulator, or the compute section
        after a direct D2H. ``finite_on_device``: a device-state unit's non-finite check on the
        device (:meth:`~..placement.device_state.DeviceState.update`).
        """
        self.slots.invalidate([unit])  # now, on the main thread: slots holding the old weights are stale
        if unit.device_state is not None:  # on the device, now (enqueued on the compute stream)
            return self.device_layers.device_state.update(unit, items, scale, entries=entries, zero_grads=zero_grads,
                                            finite_on_device=finite_on_device)
        if not unit.update_settled or self.grads.held.deferred(unit):
            # A step() with no forward since the last one (zero_grad(set_to_none=False) + step()): the last
            # update of this unit may still be queued on a busy worker; a unit takes one update at a time.
            self.waits.wait_update(unit)
        self.submit_adam(unit, items, scale, entries=entries, zero_grads=zero_grads)
