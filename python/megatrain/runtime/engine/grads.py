"""Gradient hand-over and accumulation, over the C++ gradient ledger.

The state of every entry's gradient (where it is, micro-batches seen, squared norm, update state)
is the :class:`megatrain._C.Ledger` (``csrc/megatrain/scheduler/ledger.h``), one state machine per
entry: the thread running backward moves it when it hands a gradient to D2H, the CPU worker's
kernel tasks (``csrc/megatrain/scheduler/tasks.h``, no GIL) when they land, accumulate and update
it. :class:`~.unit_grads.UnitGrads` (mixed into :class:`~megatrain.runtime.engine.units.Unit`) reads it.
:class:`GradLedger` (mixed into :class:`~megatrain.runtime.engine.core.Engine`) moves gradients D2H
(``submit_grads``), queues the accumulate tasks and applies what the worker's tasks report
(timings, skipped updates, staging buffers back to the pool) at its sync points (``settle``). The
update tasks are queued by :class:`~megatrain.runtime.engine.updates.UpdateQueue`.
"""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, List, Optional

import torch

from ..._loader import load_extension
from ..model.thread_guard import _graph_task_id  # noqa: F401 - read from here by data_parallel
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
    """Gradient hand-over, accumulation and update submission of an :class:`~megatrain.runtime.engine.core.Engine`."""

    def _init_grads(self, staging_buffers: int) -> None:
        if self.cuda:
            self.d2h_stream = torch.cuda.Stream(self.device)
        assert [u.index for u in self.units] == list(range(len(self.units)))
        self.ledger = _C.Ledger([len(u.entries) for u in self.units])
        for u in self.units:
            u.bind_ledger(self.ledger)
        # summed (accumulation) pass through staging; at one backward per step they go straight into
        # the compute section and the pool never costs host memory. The budget check counted it.
        self._staging_numel = max((u.numel for u in self.layers), default=0)
        self._staging_max = staging_buffers if self.layers else 0
        self._staging_made = 0
        self._staging: "queue.Queue[torch.Tensor]" = queue.Queue()
        # What the worker's tasks report, applied by settle(): (handle, GradOutcome, pool staging buffer
        # or None, unit index) in submission order; (handle, UpdateOutcome, optimizer, unit, items, step number).
        self._settle_lock = threading.RLock()
        self._grad_outcomes: list = []
        self._update_outcomes: list = []
        # Squared-norm readback of direct gradients: one pinned row per unit, allocated once (the
        # unit's previous gradient task, which reads its row, is waited for before it is rewritten).
        n_units = len(self.units)
        max_entries = max((len(u.entries) for u in self.units), default=0)
        self._norm_rows = None
        if self.cuda:
            self._norm_rows = _C.pinned_empty(n_units * max_entries, torch.float64).view(n_units, max_entries)

    def task_view(self, unit: Unit, i: int, name: str) -> torch.Tensor:
        """Flat view of entry ``i`` of ``unit`` in section ``name`` that the update tasks read and write.

        The whole entry here; a data parallel rank's piece of it (``runtime/data_parallel/``).
        """
        return self.entry_view(unit, i, name).view(-1)

    def submit_grad_task(self, task, ready=None):
        """Queue the Python callable ``task`` on the CPU worker as a gradient task (FIFO, before updates;
        ``ready``: see ``_Worker.submit``). Returns the task's handle."""
        return self._worker.submit(task, ready=ready)

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
                with self._stats_lock:
                    self._stats["grad_accum_time_s"] += outcome.seconds
                if self._timeline_on:
                    self._timeline_task("grad", unit_index, outcome)
                if staging is not None:
                    self._staging.put(staging)
            del self._grad_outcomes[:n]
            if not self._update_outcomes:
                return
            left = []
            for rec in self._update_outcomes:
                handle, outcome, opt, unit, items, step_number = rec
                if not handle.done:
                    left.append(rec)
                    continue
                with self._stats_lock:
                    self._stats["adam_time_s"] += outcome.seconds
                if self._timeline_on:
                    self._timeline_task("update", unit.index, outcome, step_number)
                if outcome.skipped:
                    opt.skip_unit_update(unit, items, step_number)
            self._update_outcomes = left

    def _staging_buffer(self) -> torch.Tensor:
        """A gradient staging buffer of the bounded pool (allocated on first use; waits while all are in flight)."""
        while True:
            with self._settle_lock:
                self.settle()
                try:
                    return self._staging.get_nowait()
                except queue.Empty:
                    pass
                if self._staging_made < self._staging_max:
                    self._staging_made += 1
                    return self._host_buffer(self._staging_numel)  # counted in the store's budget check
                holder = next((h for h, _, st, _ in self._grad_outcomes if st is not None), None)
            if holder is None:
                raise RuntimeError("megatrain: no gradient staging buffer is free and none is in flight")
            self.wait_task(holder)

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
        (``_C.Worker.submit_accumulate``, no GIL) lands it there.

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
                "created first: gradients go straight to its host-memory state (a torch.optim optimizer would "
                "only see the layers' meta placeholders and train nothing)")
        task_id = _graph_task_id()
        if unit.device_state is not None:  # summed on the device, updated there in step()
            return self.device_state.submit_grads(unit, grads, task_id)
        present = [g is not None for g in grads]
        states = unit.grad_states()
        if any(p and s.eager for p, s in zip(present, states)):  # before anything is mutated or taken from the pool
            # last_task is the backward that queued the update (later gradients raise here, before it changes)
            opt.raise_extra_backward(same_backward=task_id is not None and task_id == unit.last_task)
        ga_one = getattr(opt, "gradient_accumulation_steps", 1) == 1
        direct = [p and ga_one and s.micro_batches == 0 for p, s in zip(present, states)]
        if not self.has_accumulator and any(p and not d for p, d in zip(present, direct)):
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
            self.enable_accumulator()  # auto mode: allocated at the first gradient that needs summing
        if any(in_compute(s) and p for p, s in zip(present, states)):
            self.ensure_weights(unit)  # a second gradient: the first one moves to the fp32 accumulator
        unit.last_task = task_id
        overwrite = [self.ledger.begin_d2h(unit.index, i, direct[i]) if p else False for i, p in enumerate(present)]
        # Overlap with backward: the optimizer may plan the update of these entries now (their last
        # micro-batch).
        plan = opt.plan_eager(unit, present) if self.eager_updates else None
        if plan is not None:
            for i, p in enumerate(present):
                if p:
                    self.ledger.mark_eager(unit.index, i)
            self.invalidate([unit])
        if self.disk is not None:  # read-ahead of the state the coming updates need
            self.disk.on_grads(unit, eager=self.eager_updates and getattr(opt, "max_grad_norm", None) is None,
                               accum_read=any(p and not d and not o for p, d, o in zip(present, direct, overwrite)))
        # Squared norms of direct gradients: for clipping, and for the finite check before any update.
        need_norm = any(direct) and (getattr(opt, "max_grad_norm", None) is not None or
                                     getattr(opt, "nonfinite", None) is not None)
        staged = [p and not d for p, d in zip(present, direct)]
        own_staging = staging is None and any(staged)
        if own_staging:
            staging = self._staging_buffer()
        elif callable(staging):  # a caller's buffer, allocated only when a gradient is staged
            staging = staging() if any(staged) else None
        compute = self.section(unit, "compute") if any(direct) else None
        norm_idx = [i for i, d in enumerate(direct) if d]
        if need_norm:
            with torch.no_grad():
                dev_norms = grad_norms([grads[i] for i in norm_idx], self.fused_grad_norms)
        norms, ev = self.copy_grads_d2h(unit, grads, direct, compute, staging, norm_idx,
                                        dev_norms if need_norm else None)

        direct_grads = [(i, norms, k) for k, i in enumerate(norm_idx)]
        tier = {}
        if unit.disk is not None:  # summed into the accumulator on disk (by element offset)
            staged_grads = []
            tier = dict(staged_tier=[(i, e.state_offset, staging[e.offset:e.offset + e.numel], overwrite[i])
                                     for i, e in enumerate(unit.entries) if staged[i]])
            if tier["staged_tier"]:
                tier.update(accum_tier=self.disk.accum, accum_unit=unit.disk)
        else:
            staged_grads = [(i, self.entry_view(unit, i, "grad_accum").view(-1), staging[e.offset:e.offset + e.numel],
                             overwrite[i]) for i, e in enumerate(unit.entries) if staged[i]]
        handle, outcome = self._worker.submit_accumulate(self.ledger, unit.index, direct_grads, staged_grads, ready=ev,
                                                         **tier)
        unit.grad_task = handle
        with self._settle_lock:
            self._grad_outcomes.append((handle, outcome, staging if own_staging else None, unit.index))
        if plan is not None:
            items, scale = plan
            self._submit_adam(unit, items, scale, after=handle, entries=[i for i, p in enumerate(present) if p],
                              finite_from=outcome if getattr(opt, "nonfinite", None) is not None else None)
        return handle

