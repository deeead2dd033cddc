"""Gradient hand-over and accumulation, over the C++ gradient ledger.

The state of every entry's gradient (where it is, micro-batches seen, squared norm, update state)
is the :class:`megatrain._C.Ledger` (``csrc/megatrain/scheduler/ledger.h``), one state machine per
entry: the thread running backward moves it when it hands a gradient to D2H, the CPU worker's
kernel tasks (``csrc/megatrain/scheduler/tasks.h``, no GIL) when they land, accumulate and update
it. :class:`~.unit_grads.UnitGrads` (mixed into :class:`~megatrain.runtime.engine.units.Unit`) reads it.
:class:`GradLedger` (the engine's ``grads`` part) owns the ledger, the optimizer gradients are routed
to, the bounded pool of gradient staging buffers and the outcomes the worker's tasks report; it
hands gradients over (``submit_grads``: D2H through :class:`~.grad_copies.GradCopies`, then the
accumulate task) and applies those outcomes (timings, skipped updates, staging buffers back to the
pool) at its sync points (``settle``). The update tasks are queued by
:class:`~megatrain.runtime.engine.updates.UpdateQueue`, which records them here (``record_update``).
"""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, List, Optional

import torch

from ..._loader import load_extension
from ..model.thread_guard import _graph_task_id  # noqa: F401 - read from here by data_parallel
from .held_grads import HeldGrads
from .unit_grads import UnitGrads, in_compute, landed  # noqa: F401 - UnitGrads, landed: public here too

if TYPE_CHECKING:
    from .units import Unit

_C = load_extension()


def grad_norms(tensors: List[torch.Tensor], fused: bool = True) -> torch.Tensor:
    """L2 norms of ``tensors`` (any shapes and float dtypes, one device), reduced in float64.

    On a CUDA device with ``fused``: one ``torch._foreach_norm`` launch for all of them (the
    engine's ``fused_grad_norms``, ``Options.fused_grad_norms``); otherwise one
    ``torch.linalg.vector_norm`` per tensor (always on the CPU, so CPU results stay bit-identical).
    The two may differ in the last bits (another summation order).

    Returns:
        float64 tensor of shape ``(len(tensors),)`` on the tensors' device, enqueued on the current stream.
    """
    if fused and tensors and tensors[0].is_cuda:
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64))
    return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors])


class GradLedger:
    """Gradient hand-over, accumulation and the outcomes of the worker's tasks (see module docstring).

    Interface: ``ledger``, ``optimizer`` / :meth:`attach_optimizer`, :meth:`submit_grads`,
    :meth:`submit_grad_task`, :meth:`settle`, :meth:`staging_buffer`, :meth:`record_grad`,
    :meth:`record_update`, :meth:`update_steps`, and the staging pool's ``staging_numel``,
    ``staging_max``, ``staging_made``, :meth:`staging_free`.

    Args:
        ctx: the engine's :class:`~.context.EngineContext` (units, layers, disk tier, sharding).
        staging_buffers: pinned staging buffers for layer gradients (bounded pool).
        eager_updates: updates may be queued during backward (``Options.eager_updates``).
        fused_grad_norms: ``Options.fused_grad_norms`` (see :func:`grad_norms`).
    """

    def __init__(self, ctx, staging_buffers: int, eager_updates: bool, fused_grad_norms: bool):
        self.units = ctx.units
        self.disk = ctx.disk
        self.sharding = ctx.sharding
        self.eager_updates = eager_updates
        self.fused_grad_norms = fused_grad_norms
        self.optimizer = None  # the optimizer gradients are routed to (Engine.attach_optimizer)
        assert [u.index for u in self.units] == list(range(len(self.units)))
        self.ledger = _C.Ledger([len(u.entries) for u in self.units])
        for u in self.units:
            u.bind_ledger(self.ledger)
        # summed (accumulation) pass through staging; at one backward per step they go straight into
        # the compute section and the pool never costs host memory. The budget check counted it.
        self.staging_numel = max((u.numel for u in ctx.layers), default=0)
        self.staging_max = staging_buffers if ctx.layers else 0
        self.staging_made = 0
        self._staging: "queue.Queue[torch.Tensor]" = queue.Queue()
        # What the worker's tasks report, applied by settle(): (handle, GradOutcome, pool staging buffer
        # or None, unit index) in submission order; (handle, UpdateOutcome, optimizer, unit, items, step number).
        self._settle_lock = threading.RLock()
        self._grad_outcomes: list = []
        self._update_outcomes: list = []
        # Master-streamed units: their device gradients held until the update may run (HeldGrads), and
        # the pool staging buffers an update task reads, back once it ran.
        self.held = HeldGrads(self)
        self._update_staging: list = []
        self.worker = self.counters = self.timeline = self.views = self.accumulator = None
        self.copies = self.updates = self.waits = self.slots = self.device_layers = None

    def connect(self, worker, counters, timeline, views, accumulator, copies, updates, waits, slots,
                device_layers) -> None:
        """The collaborators: the CPU worker, :class:`~.stats.EngineCounters`, :class:`~.timeline.WorkerTimeline`,
        :class:`~.views.StoreViews`, :class:`~.memory.Accumulator`, :class:`~.grad_copies.GradCopies`,
        :class:`~.updates.UpdateQueue`, :class:`~.waits.Waits`, :class:`~.slots.SlotPool` and
        :class:`~.memory.DeviceStateLayers`."""
        self.worker, self.counters, self.timeline, self.views = worker, counters, timeline, views
        self.accumulator, self.copies, self.updates, self.waits = accumulator, copies, updates, waits
        self.slots, self.device_layers = slots, device_layers

    def attach_optimizer(self, optimizer) -> None:
        """Route every gradient to ``optimizer`` (an ``EngineOptimizer``)."""
        self.optimizer = optimizer

    def submit_grad_task(self, task, ready=None):
        """Queue the Python callable ``task`` on the CPU worker as a gradient task (FIFO, before updates;
        ``ready``: see ``_Worker.submit``). Returns the task's handle."""
        return self.worker.submit(task, ready=ready)

    def record_grad(self, handle, outcome, staging: Optional[torch.Tensor], unit_index: int) -> None:
        """A gradient task was queued: ``settle`` applies its ``outcome`` and gives ``staging`` (a pool
        buffer, or None) back once ``handle`` is done."""
        with self._settle_lock:
            self._grad_outcomes.append((handle, outcome, staging, unit_index))

    def record_update(self, handle, outcome, opt, unit: Unit, items, step_number: int) -> None:
        """An update task was queued: ``settle`` applies its ``outcome`` once ``handle`` is done."""
        with self._settle_lock:
            self._update_outcomes.append((handle, outcome, opt, unit, items, step_number))

    def update_steps(self, seqs=None) -> List[int]:
        """The step numbers of the update tasks not settled yet (of those with a ``seq`` in ``seqs``; None: all)."""
        with self._settle_lock:
            return [rec[5] for rec in self._update_outcomes if seqs is None or rec[0].seq in seqs]

    def staging_free(self) -> int:
        """Staging buffers of the pool free now."""
        return self._staging.qsize()

    def settle(self) -> None:
        """Apply what finished worker tasks reported (main thread; called at every sync point).

        Per finished gradient task: its kernel time to ``grad_accum_time_s`` and its pool staging
        buffer back to the pool. Per finished update: its time to ``adam_time_s`` and, when it was
        skipped for a non-finite gradient, the optimizer's ``skip_unit_update`` (step counts back).
        With ``Options.worker_timeline`` each one's run is an event of the timeline (:mod:`.timeline`).
        """
        with self._settle_lock:
            n = 0
            for handle, outcome, staging, unit_index in self._grad_outcomes:
                if not handle.done:
                    break  # gradient tasks finish in submission order
                n += 1
                self.counters.add_locked("grad_accum_time_s", outcome.seconds)
                if self.timeline.on:
                    self.timeline.task("grad", unit_index, outcome)
                if staging is not None:
                    self._staging.put(staging)
            del self._grad_outcomes[:n]
            kept = []
            for rec in self._update_staging:  # one read of each handle (it may finish meanwhile)
                if rec[0].done:
                    self._staging.put(rec[1])
                else:
                    kept.append(rec)
            self._update_staging = kept
            if not self._update_outcomes:
                return
            left = []
            for rec in self._update_outcomes:
                handle, outcome, opt, unit, items, step_number = rec
                if not handle.done:
                    left.append(rec)
                    continue
                self.counters.add_locked("adam_time_s", outcome.seconds)
                if self.timeline.on:
                    self.timeline.task("update", unit.index, outcome, step_number)
                if outcome.skipped:
                    opt.skip_unit_update(unit, items, step_number)
            self._update_outcomes = left

    def try_staging_buffer(self) -> Optional[torch.Tensor]:
        """A buffer of the staging pool if one is free or may still be allocated now, else None (no wait)."""
        with self._settle_lock:
            return self._free_staging_buffer()

    def _free_staging_buffer(self) -> Optional[torch.Tensor]:
        """Under ``_settle_lock``: settle, then a free pool buffer, or a new one while the pool may still grow
        (counted in the store's budget check), else None."""
        self.settle()
        try:
            return self._staging.get_nowait()
        except queue.Empty:
            pass
        if self.staging_made < self.staging_max:
            self.staging_made += 1
            return self.views.host_buffer(self.staging_numel)
        return None

    def staging_buffer(self) -> torch.Tensor:
        """A gradient staging buffer of the bounded pool (allocated on first use; waits while all are in flight)."""
        while True:
            with self._settle_lock:
                buf = self._free_staging_buffer()
                if buf is not None:
                    return buf
                holder = next((h for h, _, st, _ in self._grad_outcomes if st is not None),
                              self._update_staging[0][0] if self._update_staging else None)
            if holder is None:
                raise RuntimeError("megatrain: no gradient staging buffer is free and none is in flight")
            self.waits.wait_task(holder)

    # ------------------------------------------------------------------ the hand-over, step by step
    def submit_grads(self, unit: Unit, grads: List[Optional[torch.Tensor]], staging: Optional[torch.Tensor] = None,
                     ) -> Optional["_C.TaskHandle"]:
        """Hand weight gradients of ``unit`` (device tensors, one per entry or None) to D2H + the worker.

        Called on the thread running backward, right after the gradients were produced on the
        compute stream. Where an entry's gradient lands:

        * *direct* (its first gradient since the last step, and the optimizer's
          ``gradient_accumulation_steps`` is 1): D2H straight into the entry's slice of the
          compute section in the host store, whose weights are not needed again before the
          update rewrites them. No staging buffer, no fp32 accumulation pass: the fused Adam reads
          the bf16 gradient there and writes the new compute copy in place. Squared norms (for
          clipping) are reduced on the device. A load before the update streams weights rebuilt
          from the masters; a second gradient moves the first one to the fp32 accumulator.
        * otherwise: D2H into a pinned staging buffer (``staging``, or one of the bounded pool),
          and the worker accumulates it into the fp32 ``grad_accum`` section.

        The update is queued now when the optimizer plans it (no clipping, the last micro-batch).
        The ledger records the hand-over now (``begin_d2h``); the gradient task
        (``_C.Worker.submit_accumulate``, no GIL) lands it there. A data parallel strategy
        (``reduces_grads``) reduce-scatters them first and hands over this rank's pieces.

        Returns:
            the gradient task's handle (it has read ``staging`` once done), or None for a
            device-state layer.

        Raises:
            RuntimeError: no ``CPUAdamW`` was created for the model; a backward pass came after
                this unit's update was already queued; or a second gradient before ``step()``
                on a store without a gradient accumulator (all checked before anything changes).
        """
        self.settle()
        opt = self.optimizer
        if opt is None:
            raise RuntimeError(
                "megatrain: backward() on a wrapped model needs megatrain.optim.CPUAdamW(model.parameters(), ...) "
                "created first for this model (no CPUAdamW holds its parameters; one made for another wrapped model "
                "does not count): gradients go straight to its host-memory state (a torch.optim optimizer would "
                "only see the layers' meta placeholders and train nothing)")
        if self.sharding.reduces_grads:
            return self.sharding.submit_grads(unit, grads, opt)
        task_id = _graph_task_id()
        if unit.device_state is not None:  # summed on the device, updated there in step()
            return self.device_layers.device_state.submit_grads(unit, grads, task_id)
        present = [g is not None for g in grads]
        direct = self._where_grads_land(unit, present, opt, task_id)
        overwrite, plan = self._begin_hand_over(unit, present, direct, opt, task_id)
        staged = [p and not d for p, d in zip(present, direct)]
        own_staging = staging is None and any(staged)
        if own_staging:
            staging = self.staging_buffer()
        elif callable(staging):  # a caller's buffer, allocated only when a gradient is staged
            staging = staging() if any(staged) else None
        norm_idx = [i for i, d in enumerate(direct) if d]
        held_buf = None
        if unit.master_streamed and any(direct):  # no compute section: held on the device, or D2H'd for the update
            held_buf = self.staging_buffer() if plan is not None else None
            if held_buf is None:
                self.held.hold(unit, {i: grads[i] for i in norm_idx})
        norms, ev = self._copy_to_host(unit, grads, direct, staging, norm_idx, opt, held_buf)
        handle, outcome = self._queue_accumulate(unit, norms, ev, staging, staged, overwrite, norm_idx)
        unit.grad_task = handle
        self.record_grad(handle, outcome, staging if own_staging else None, unit.index)
        if plan is not None:
            items, scale = plan
            self.updates.submit_adam(unit, items, scale, after=handle, entries=[i for i, p in enumerate(present) if p],
                                     finite_from=outcome if getattr(opt, "nonfinite", None) is not None else None,
                                     grad_buf=held_buf)
        return handle

    # ------------------------------------------------------------------ pool buffers read by update tasks
    def record_update_staging(self, handle, staging: torch.Tensor) -> None:
        """The update task ``handle`` reads pool buffer ``staging``: ``settle`` gives it back once it ran."""
        with self._settle_lock:
            self._update_staging.append((handle, staging))

    def give_back(self, staging: torch.Tensor) -> None:
        """Pool buffer ``staging`` is free again (read by a task that was waited for)."""
        self._staging.put(staging)

    def _where_grads_land(self, unit: Unit, present: List[bool], opt, task_id) -> List[bool]:
        """Per entry, whether its gradient goes straight into the compute section (*direct*); raises
        before anything changes when it may not be handed over, and readies the accumulator when needed."""
        states = unit.grad_states()
        if any(p and s.eager for p, s in zip(present, states)):  # before anything is mutated or taken from the pool
            # last_task is the backward that queued the update (later gradients raise here, before it changes)
            opt.raise_extra_backward(same_backward=task_id is not None and task_id == unit.last_task)
        ga_one = getattr(opt, "gradient_accumulation_steps", 1) == 1
        direct = [p and ga_one and s.micro_batches == 0 for p, s in zip(present, states)]
        if not self.accumulator.has_accumulator and any(p and not d for p, d in zip(present, direct)):
            if task_id is not None and task_id == unit.last_task:
                raise RuntimeError(
                    "megatrain: a decoder layer received a second gradient in the same backward pass (it is called "
                    "more than once per forward); summing them needs the fp32 gradient accumulator: wrap with "
                    "grad_accumulator=True (the default)")
            raise RuntimeError(
                "megatrain: a second backward pass before optimizer.step() (gradient accumulation), but the model "
                "was wrapped with grad_accumulator=False and CPUAdamW has gradient_accumulation_steps="
                f"{getattr(opt, 'gradient_accumulation_steps', 1)}: call step() after every backward, or wrap with "
                "grad_accumulator=True (4 more bytes of host memory per parameter)")
        if any(p and not d for p, d in zip(present, direct)):
            self.accumulator.enable()  # auto mode: allocated at the first gradient that needs summing
        if any(in_compute(s) and p for p, s in zip(present, states)):
            self.updates.ensure_weights(unit)  # a second gradient: the first one moves to the fp32 accumulator
        return direct

    def _begin_hand_over(self, unit: Unit, present: List[bool], direct: List[bool], opt, task_id):
        """``(overwrite, plan)``: the ledger's hand-over of each present entry (True: the first gradient of
        the window overwrites the accumulator) and the optimizer's eager plan (or None)."""
        unit.last_task = task_id
        overwrite = [self.ledger.begin_d2h(unit.index, i, direct[i]) if p else False for i, p in enumerate(present)]
        # Overlap with backward: the optimizer may plan the update of these entries now (their last
        # micro-batch).
        plan = opt.plan_eager(unit, present) if self.eager_updates else None
        if plan is not None:
            for i, p in enumerate(present):
                if p:
                    self.ledger.mark_eager(unit.index, i)
            self.slots.invalidate([unit])
        if self.disk is not None:  # read-ahead of the state the coming updates need
            self.disk.on_grads(unit, eager=self.eager_updates and getattr(opt, "max_grad_norm", None) is None,
                               accum_read=any(p and not d and not o for p, d, o in zip(present, direct, overwrite)))
        return overwrite, plan

    def _copy_to_host(self, unit: Unit, grads, direct: List[bool], staging, norm_idx: List[int], opt, held_buf=None):
        """``(norms, ready)``: the squared-norm inputs of the direct gradients (for clipping, and for the
        finite check before any update) reduced on the device, and every gradient copied D2H (a master-streamed
        unit's direct ones into ``held_buf``, or not at all: they are held on the device)."""
        need_norm = any(direct) and (getattr(opt, "max_grad_norm", None) is not None or
                                     getattr(opt, "nonfinite", None) is not None)
        if need_norm:
            with torch.no_grad():
                dev_norms = grad_norms([grads[i] for i in norm_idx], self.fused_grad_norms)
        if unit.master_streamed:
            compute = held_buf
            if held_buf is None:  # held: only the staged ones (a second micro-batch) are copied now
                grads = [None if d else g for g, d in zip(grads, direct)]
        else:
            compute = self.views.section(unit, "compute") if any(direct) else None
        return self.copies.copy_grads_d2h(unit, grads, direct, compute, staging, norm_idx,
                                          dev_norms if need_norm else None)

    def _queue_accumulate(self, unit: Unit, norms, ev, staging, staged: List[bool], overwrite: List[bool],
                          norm_idx: List[int]):
        """Queue the gradient task that lands ``unit``'s gradients (``_C.Worker.submit_accumulate``)."""
        direct_grads = [(i, norms, k) for k, i in enumerate(norm_idx)]
        tier = {}
        if unit.disk is not None:  # summed into the accumulator on disk (by element offset)
            staged_grads = []
            tier = dict(staged_tier=[(i, e.state_offset, staging[e.offset:e.offset + e.numel], overwrite[i])
                                     for i, e in enumerate(unit.entries) if staged[i]])
            if tier["staged_tier"]:
                tier.update(accum_tier=self.disk.accum, accum_unit=unit.disk)
        else:
            staged_grads = [(i, self.views.entry_view(unit, i, "grad_accum").view(-1),
                             staging[e.offset:e.offset + e.numel], overwrite[i])
                            for i, e in enumerate(unit.entries) if staged[i]]
        return self.worker.submit_accumulate(self.ledger, unit.index, direct_grads, staged_grads, ready=ev, **tier)
