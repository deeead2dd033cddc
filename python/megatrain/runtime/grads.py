"""The gradient ledger: where each entry's gradient is, D2H hand-over, and update submission.

Per unit and entry (:class:`UnitGrads`, the state a :class:`~megatrain.runtime.units.Unit` carries):
whether a gradient landed since the last step (``has_grad``, worker thread), its squared norm
(``grad_sq``), the backward passes that delivered one (``batches``), whether its update was
already queued during backward (``eager``), whether its gradient sits in the compute section of
the host store (``direct``), and whether an update task of the unit is in flight
(``update_done``). :class:`GradLedger` (mixed into :class:`~megatrain.runtime.engine.Engine`)
moves gradients D2H (``submit_grads``), accumulates them on the CPU worker, and queues the fused
CPU AdamW of each unit (``submit_update``, ``run_adam``).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, List, Optional

import torch

from .._loader import load_extension
from .host_memory import checked_in_python
from .worker import _Worker

if TYPE_CHECKING:
    from .engine import Engine
    from .units import Unit

_C = load_extension()


class UnitGrads:
    """Per-entry gradient and update state of a unit (mixed into :class:`~megatrain.runtime.units.Unit`).

    Attributes:
        has_grad: written only on the worker thread: entry i received a gradient since the last
            step / zero_grad.
        grad_sq: entry i's squared gradient L2 norm (worker thread).
        batches: main thread only: backward passes that delivered entry i a gradient since the
            last step.
        eager: main thread only: entry i's update was already queued (eager mode; layers queue all
            their entries at once, the resident unit each entry as its gradient arrives).
        direct: main thread only: entry i's slice of the store's compute section holds its
            gradient (the first of this step, D2H'd there directly) instead of its weights, until
            the update.
        last_task: autograd graph task of the last gradient handed over.
        grad_task_done: set when the last gradient task ran.
        update_done: set when no update task of the unit is in flight.
    """

    def _init_grad_state(self, n: int) -> None:
        self.update_done = threading.Event()
        self.update_done.set()
        self.grad_task_done = threading.Event()
        self.grad_task_done.set()
        self.last_task: Optional[int] = None
        self._lock = threading.Lock()
        self._in_flight = 0
        self.has_grad: List[bool] = [False] * n
        self.grad_sq: List[float] = [0.0] * n
        self.batches: List[int] = [0] * n
        self.eager: List[bool] = [False] * n
        self.direct: List[bool] = [False] * n

    @property
    def grads_in_compute(self) -> bool:
        return any(self.direct)

    @property
    def eager_queued(self) -> bool:
        """Some entry's update was queued during backward (before ``step()``)."""
        return any(self.eager)

    def begin_update(self) -> None:
        """Main thread: one more update task of this unit is in flight (``update_done`` cleared)."""
        with self._lock:
            self._in_flight += 1
            self.update_done.clear()

    def end_update(self) -> None:
        """Worker: an update task of this unit finished; ``update_done`` is set when none is left."""
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self.update_done.set()



class GradLedger:
    """Gradient hand-over, accumulation and update submission of an :class:`~megatrain.runtime.engine.Engine`."""

    def _init_grads(self, staging_buffers: int) -> None:
        if self.cuda:
            self.d2h_stream = torch.cuda.Stream(self.device)
        # summed (accumulation) pass through staging; at one backward per step they go straight into
        # the compute section and the pool never costs host memory. The budget check counted it.
        self._staging_numel = max((u.numel for u in self.layers), default=0)
        self._staging_max = staging_buffers if self.layers else 0
        self._staging_made = 0
        self._staging_lock = threading.Lock()
        self._staging: "queue.Queue[torch.Tensor]" = queue.Queue()
        # Squared-norm readback of direct gradients: one pinned row per unit, allocated once (the
        # unit's previous gradient task, which reads its row, is waited for before it is rewritten).
        n_units = len(self.units)
        max_entries = max((len(u.entries) for u in self.units), default=0)
        self._norm_rows = None
        if self.cuda:
            with checked_in_python():
                self._norm_rows = _C.pinned_empty(n_units * max_entries, torch.float64).view(n_units, max_entries)

    def submit_grad_task(self, task: Callable[[], None], ready=None):
        """Queue ``task`` on the CPU worker as a gradient task (FIFO, before updates; ``ready``: see ``_Worker.submit``).

        Returns the task's handle."""
        return self._worker.submit(task, ready=ready)

    def _staging_buffer(self) -> torch.Tensor:
        """A gradient staging buffer of the bounded pool (allocated on first use; blocks while all are in flight)."""
        with self._staging_lock:
            if self._staging.empty() and self._staging_made < self._staging_max:
                self._staging_made += 1
                with checked_in_python():
                    return self._host_buffer(self._staging_numel)
        return self._wait_for(self._staging.get)

    def submit_grads(self, unit: Unit, grads: List[Optional[torch.Tensor]], staging: Optional[torch.Tensor] = None,
                     on_done: Optional[Callable[[], None]] = None) -> None:
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

        Raises:
            RuntimeError: no ``CPUAdamW`` was created for the model; a backward pass came after
                this unit's update was already queued; or a second gradient before ``step()``
                on a store without a gradient accumulator (all checked before anything changes).
        """
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
        if any(p and e for p, e in zip(present, unit.eager)):  # before anything is mutated or taken from the pool
            # last_task is the backward that queued the update (later gradients raise here, before it changes)
            opt.raise_extra_backward(same_backward=task_id is not None and task_id == unit.last_task)
        ga_one = getattr(opt, "gradient_accumulation_steps", 1) == 1
        direct = [p and ga_one and unit.batches[i] == 0 for i, p in enumerate(present)]
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
        if any(unit.direct[i] and present[i] for i in range(len(present))):
            self.ensure_weights(unit)  # a second gradient: the first one moves to the fp32 accumulator
        unit.last_task = task_id
        for i, p in enumerate(present):
            if p:
                unit.batches[i] += 1
        # Overlap with backward: the optimizer may plan the update of these entries now (their last
        # micro-batch).
        plan = opt.plan_eager(unit, present) if self.eager_updates else None
        if plan is not None:
            for i, p in enumerate(present):
                unit.eager[i] = unit.eager[i] or p
            self.invalidate([unit])
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
        for i, d in enumerate(direct):
            if d:
                unit.direct[i] = True
        norms = None
        norm_idx = [i for i, d in enumerate(direct) if d]
        if need_norm:
            with torch.no_grad():
                dev_norms = torch.stack([torch.linalg.vector_norm(grads[i], dtype=torch.float64) for i in norm_idx])
        ev = None
        nbytes = 0

        def copies(non_blocking: bool):
            n = 0
            for i, (e, g) in enumerate(zip(unit.entries, grads)):
                if g is not None:
                    dst = compute if direct[i] else staging
                    dst[e.offset:e.offset + e.numel].copy_(g.reshape(-1), non_blocking=non_blocking)
                    n += g.numel() * g.element_size()
            return n

        if self.cuda:
            backward_done = torch.cuda.Event()
            backward_done.record(self.compute_stream())
            with torch.cuda.stream(self.d2h_stream):
                self.d2h_stream.wait_event(backward_done)
                if self.debug:
                    torch.cuda._sleep(2_000_000)
                end = self._timed("d2h", self.d2h_stream)
                nbytes = copies(True)
                for g in grads:
                    if g is not None:
                        g.record_stream(self.d2h_stream)
                if need_norm:
                    self.wait_event(unit.grad_task_done)  # it read this row; almost always long done
                    norms = self._norm_rows[unit.index, :len(norm_idx)]
                    norms.copy_(dev_norms, non_blocking=True)
                    dev_norms.record_stream(self.d2h_stream)
                end.record(self.d2h_stream)
                ev = torch.cuda.Event()
                ev.record(self.d2h_stream)
            if not self.d2h_overlap:
                self.compute_stream().wait_event(ev)
        else:
            nbytes = copies(False)
            if need_norm:
                norms = dev_norms
        self._stats["d2h_bytes"] += nbytes

        grad_done = threading.Event()
        unit.grad_task_done = grad_done
        finite = [True]  # this gradient's squared norms are all finite (set by the gradient task)

        def grad_task():
            try:
                accumulate()
            finally:
                grad_done.set()

        def accumulate():
            if ev is not None:
                ev.synchronize()
            t0 = time.perf_counter()
            if norms is not None:
                for k, i in enumerate(norm_idx):
                    unit.grad_sq[i] = float(norms[k]) ** 2
            for i, e in enumerate(unit.entries):
                if direct[i]:
                    unit.has_grad[i] = True
                elif staged[i]:
                    acc = self.entry_view(unit, i, "grad_accum").view(-1)
                    sq = _C_ops().grad_accumulate_(acc, staging[e.offset:e.offset + e.numel], not unit.has_grad[i])
                    unit.grad_sq[i] = float(sq)
                    unit.has_grad[i] = True
            # Read here, in this task: a later zero_grad() task may reset grad_sq before an eager update runs.
            finite[0] = all(math.isfinite(unit.grad_sq[i]) for i, p in enumerate(present) if p)
            with self._stats_lock:
                self._stats["grad_accum_time_s"] += time.perf_counter() - t0
            if own_staging:
                self._staging.put(staging)
            if on_done is not None:
                on_done()

        grad_handle = self._worker.submit(grad_task, ready=ev)
        if plan is not None:
            items, scale = plan
            self._submit_adam(unit, items, scale, after=grad_handle, entries=[i for i, p in enumerate(present) if p],
                              finite=(lambda: finite[0]) if getattr(opt, "nonfinite", None) is not None else None)

    def _submit_adam(self, unit: Unit, items, scale: float, after=None,
                     entries: Optional[List[int]] = None, zero_grads=(),
                     finite: Optional[Callable[[], bool]] = None) -> None:
        """Queue the fused AdamW of ``unit``'s ``entries`` (default: all; worker, by deadline).

        The unit is "in flight" from when the task is queued (``_submit_updating``) until it ran.
        Each entry's gradient is read from the compute section (``unit.direct``) or the fp32
        accumulator; direct entries that are not updated (not in this optimizer) get their weights
        back. ``after``: the handle of the unit's gradient task (the update is not started before it ran).
        ``finite``: called in the task; False skips the update (a non-finite gradient never reaches
        the masters; the compute copy is rewritten from them and the optimizer undoes the step count).
        Takes over (and clears) ``unit.direct`` of those entries: the compute section holds
        weights after the update. ``zero_grads``: entries updated with an all-zero gradient
        (``zero_grad(set_to_none=False)`` and no backward since).
        """
        entries = list(range(len(unit.entries))) if entries is None else list(entries)
        direct = list(unit.direct)
        for i in entries:
            unit.direct[i] = False
        updated = {it[0] for it in items}
        restore = [i for i in entries if direct[i] and i not in updated]

        zero = set(zero_grads)

        def grad_src(i):
            if i in zero:
                return torch.zeros(unit.entries[i].numel, dtype=torch.float32)
            return self.entry_view(unit, i, "compute" if direct[i] else "grad_accum").view(-1)

        step_number = getattr(self.optimizer, "steps_called", 0) + 1  # the step() this update belongs to

        def task():
            t0 = time.perf_counter()
            try:
                if finite is not None and items and not finite():
                    # A non-finite gradient never reaches the masters: the unit's update is skipped.
                    self._weights_back(unit, [i for i in entries if direct[i]])
                    self.optimizer.skip_unit_update(unit, items, step_number)
                else:
                    run_adam(self, unit, items, scale, grad_src)
                    self._weights_back(unit, restore)
                for i in entries:
                    unit.has_grad[i] = False
                    unit.grad_sq[i] = 0.0
            finally:
                unit.end_update()
                with self._stats_lock:
                    self._stats["adam_time_s"] += time.perf_counter() - t0

        self._submit_updating([unit], task, _Worker.UPDATE if self.overlap else _Worker.GRAD, unit.update_key,
                              ready=after)

    def _weights_back(self, unit: Unit, entries) -> None:
        """Worker: rewrite entries' compute copy from the fp32 masters (gradients held there are dropped)."""
        for i in entries:
            self.entry_view(unit, i, "compute").copy_(self.entry_view(unit, i, "master"))

    def ensure_weights(self, unit: Unit) -> None:
        """Move ``unit``'s direct gradients from the compute section to the fp32 accumulator (waits).

        Needed when an entry gets a second gradient before the optimizer stepped (gradient
        accumulation the optimizer was not told about): the first one still counts, and the
        compute copy is rewritten from the fp32 master weights.
        """
        direct = [i for i, d in enumerate(unit.direct) if d]
        if not direct:
            return
        self.enable_accumulator()
        unit.direct = [False] * len(unit.entries)
        done = threading.Event()

        def task():
            try:
                for i in direct:
                    comp = self.entry_view(unit, i, "compute").view(-1)
                    acc = self.entry_view(unit, i, "grad_accum").view(-1)
                    unit.grad_sq[i] = float(_C_ops().grad_accumulate_(acc, comp, True))
                self._weights_back(unit, direct)
            finally:
                done.set()

        self._worker.submit(task)
        self.wait_event(done)
        self._worker.check()

    def zero_grad(self) -> None:
        """Forget accumulated gradients (the next backward overwrites the accumulators)."""
        restore = [(u, [i for i, d in enumerate(u.direct) if d]) for u in self.units if u.grads_in_compute]
        for u in self.units:
            n = len(u.entries)
            u.batches = [0] * n
            u.eager = [False] * n
            u.direct = [False] * n

        def task():  # gradients D2H'd into the compute section and never used: weights back
            try:
                for u in self.units:
                    u.has_grad = [False] * len(u.entries)
                    u.grad_sq = [0.0] * len(u.entries)
                for u, idx in restore:
                    self._weights_back(u, idx)
            finally:
                for u, _ in restore:
                    u.end_update()
        self._submit_updating([u for u, _ in restore], task)

    def _submit_updating(self, units: List[Unit], task: Callable[[], None], *args, **kwargs) -> None:
        """Queue ``task`` (which ends with ``end_update()`` of each of ``units``) as in flight for them.

        ``begin_update()`` happens here, when the task is queued: if the worker refuses it (an
        earlier failure), nothing would ever end the update and the next load would wait forever.
        """
        for u in units:
            u.begin_update()
        try:
            self._worker.submit(task, *args, **kwargs)
        except BaseException:
            for u in units:
                u.end_update()
            raise

    def submit_update(self, unit: Unit, items, scale: float, entries: Optional[List[int]] = None,
                      zero_grads=()) -> None:
        """Queue the AdamW update of ``unit``'s ``entries`` (default all; worker, by deadline).

        Bumps the unit's version now. The gradient is the fp32 accumulator, or the compute section
        after a direct D2H.
        """
        self.invalidate([unit])  # now, on the main thread: slots holding the old weights are stale
        if unit.device_state is not None:  # on the device, now (enqueued on the compute stream)
            return self.device_state.update(unit, items, scale, entries=entries, zero_grads=zero_grads)
        self._submit_adam(unit, items, scale, entries=entries, zero_grads=zero_grads)

    # ------------------------------------------------------------------ metrics

def _graph_task_id() -> Optional[int]:
    """Id of the autograd graph task (backward pass) running now, or None (unknown / outside one)."""
    f = getattr(torch._C, "_current_graph_task_id", None)
    try:
        i = f() if f is not None else -1
    except RuntimeError:
        return None
    return None if i < 0 else int(i)


def _C_ops():
    return torch.ops.megatrain


def run_adam(eng: "Engine", unit: "Unit", items, scale: float, grad_src=None) -> None:
    """Fused AdamW over ``unit``'s entries (worker thread).

    Args:
        items: ``(entry_index, lr, beta1, beta2, eps, weight_decay, step)`` per entry to update.
        scale: gradient multiplier (the clip coefficient; 1.0 without clipping).
        grad_src: ``entry_index -> flat gradient`` (bf16/fp32 CPU); default: the fp32 ``grad_accum`` section.
    """
    ops = _C_ops()
    for i, lr, b1, b2, eps, wd, step in items:
        grad = grad_src(i) if grad_src is not None else eng.entry_view(unit, i, "grad_accum").view(-1)
        ops.adamw_step_(
            eng.entry_view(unit, i, "master").view(-1),
            eng.entry_view(unit, i, "exp_avg").view(-1),
            eng.entry_view(unit, i, "exp_avg_sq").view(-1),
            grad,
            eng.entry_view(unit, i, "compute").view(-1),
            lr, b1, b2, eps, wd, step, scale)
