"""Device-state layers: the whole training state of chosen decoder layers kept on the compute device.

``megatrain.wrap(model, device_state_layers=K)`` keeps, for decoder layers ``0 .. K-1``, every
persistent tensor on the device, in flat buffers laid out exactly like the layer's host-store
sections (same per-entry offsets):

* ``compute`` — the compute-dtype weights (2 B/param in bf16, 4 in fp32): the layer's permanent
  device slot. ``acquire()`` returns it (no H2D copy, never released to another layer, never a
  prefetch target); the weights never stream.
* ``master``, ``exp_avg``, ``exp_avg_sq`` — fp32 (12 B/param).
* ``grad`` — the fp32 gradient accumulator (4 B/param), allocated only when gradients are summed
  (a second gradient before ``step()``; ``CPUAdamW(gradient_accumulation_steps > 1)`` allocates it
  at once): the layer's weight gradients are summed here on the device (no D2H). Without
  accumulation a decoder layer's gradient is written into its own ``compute`` buffer instead
  (*direct*, as the host-stored layers' gradient D2H into their compute section): the update reads
  it there and rewrites the compute copy from the new master; whatever needs the weights before
  that (the layer runs again, the host store reads the compute copy, ``zero_grad``, a skipped
  step) rebuilds them from the master first (``DeviceUnit.take_weights``). The resident unit's
  compute buffer is its parameters' storage: it keeps its ``grad`` from the start. The squared L2
  norm of each gradient is reduced on the device and read by the CPU worker (8 bytes per parameter
  tensor), so clipping (the global norm) and the non-finite check see these layers exactly as the
  host-stored ones.

14 B/param in all (12 of fp32 state + 2 for the bf16 compute copy) on the device, 18 with the
accumulator (the resident unit: 16 beside its existing compute copy); the host
store keeps its sections for these layers too (they are the checkpoint / state_dict surface),
except for an *exclusive* layer (``DeviceUnit.exclusive``: chosen at wrap when the host store of
every unit would not fit the host budget, :func:`~.disk_plan.plan_offload`): the host store then holds
nothing of it (a frozen entry's compute copy only), its state lives on the device alone (the compute buffer
cast from the device master), and readers stream it through the device tier (:mod:`.device_tier`).

The update runs on the device in ``optimizer.step()`` (with clipping after the global norm is known;
without it, with the fused kernel, enqueued before ``step()`` waits for the gradients, the
non-finite check made on the device), with the group's ``lr`` / ``betas`` / ``eps`` /
``weight_decay`` of that moment, the per-parameter step counts, and the clip coefficient, exactly as
``torch.optim.AdamW`` (:mod:`.device_adamw`); then the compute copy is rewritten from the new master.
Layer 0 .. K-1 (and the resident unit) are what the next forward needs first: their update takes a
few milliseconds of GPU time, and the next forward runs on them while the CPU worker updates layers
K and deeper.

Host-visible state: :meth:`DeviceState.to_host` copies master / exp_avg / exp_avg_sq / compute of
the device-state layers into their host-store sections (only when they changed since the last
copy) and :meth:`DeviceState.from_host` copies them back after the host store was written.
Callers use the engine's ``sync_host()`` (before reading the host store) and ``host_written()``
(after writing it); checkpoint, state_dict, export and the optimizer's state do. A read of
``optimizer.state[p]`` hands out the host sections writable (``sync_host(for_write=True)``): the
unit's next update first copies them back to the device, so an in-place write there takes effect
as in ``torch.optim.AdamW``. :meth:`DeviceState.masters_to_host` copies the master section alone:
``optimizer.step()`` calls it (through the engine's ``refresh_state_dict_views()``) for the units
whose ``model.state_dict()`` tensors are held, so those read the current weights as torch's do.

On the CPU backend the "device" is the CPU: the buffers are ordinary CPU tensors outside the host
store and every step of the logic is the same, so CPU parity tests cover it.

The ``device_state_layers`` argument (default, check) and how many layers fit: :mod:`.device_state_plan`.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch

from .device_adamw import device_adamw
from .device_unit import DeviceSlot, DeviceUnit, runs_without  # noqa: F401 - DeviceSlot: public here too
from ..engine.grads import grad_norms


class DeviceState:
    """The device-state layers of an engine (see the module docstring).

    Args:
        eng: the :class:`~megatrain.runtime.engine.core.Engine` (its store already filled, unless ``exclusive``).
        units: the layer units to keep on the device (layers ``0 .. K-1``).
        exclusive: ``units`` hold their fp32 state on the device only (the engine's store has no fp32
            section for them); made before the store is filled, which writes them through the device
            tier; their compute copy is taken from the host store by a later :meth:`add` of them.

    Raises:
        torch.cuda.OutOfMemoryError: the buffers do not fit (raised while wrapping).
    """

    def __init__(self, eng, units: List, exclusive: bool = False):
        self.eng = eng
        self.units = []
        impl = eng.options.device_adam
        if impl not in ("", "fused", "foreach"):
            raise ValueError(f"MEGATRAIN_DEVICE_ADAM must be 'fused' or 'foreach', got {impl!r}")
        # torch._fused_adamw_ on CUDA (what torch.optim.AdamW(fused=True) runs); the foreach
        # formulation of torch.optim.AdamW elsewhere. Both are torch's own AdamW math.
        self.impl = impl or ("fused" if eng.cuda else "foreach")
        self.add(units, exclusive=exclusive)

    @torch.no_grad()
    def add(self, units: List, exclusive: bool = False) -> None:
        """Put the training state of ``units`` (units whose state is in the host store) on the device too,
        copied from the host store; units already here (exclusive ones) take their compute copy from it.
        ``exclusive``: new units whose fp32 state has no host section (zeros; nothing copied)."""
        eng = self.eng
        for u in units:
            if getattr(u, "device_state", None) is not None:
                continue
            buf = eng.resident_buf if u.kind == "resident" else None  # the resident unit's existing compute copy
            u.device_state = DeviceUnit(u, eng.device, eng.compute_dtype, eng.cuda, compute=buf, exclusive=exclusive)
            self.units.append(u)
        if not exclusive:
            self.from_host(units)

    @torch.no_grad()
    def remove(self, units: List) -> None:
        """Give the training state of ``units`` back to the host store (copied there first) and free
        their device buffers. Only between steps: no gradient of theirs may be accumulated or pending.

        Raises:
            RuntimeError: one of ``units`` is exclusive (its fp32 state has no place in the host store).
        """
        for u in units:
            if u.device_state.exclusive:
                raise RuntimeError(f"megatrain: unit {u.index} keeps its fp32 state on the device only (the host "
                                   "store has no room for it): it cannot leave the device")
        for u in units:
            if u.device_state.host_dirty:  # optimizer.state[p] was handed out: the host sections are the newer
                u.device_state.host_stale = u.device_state.host_master_stale = False
        self.to_host(units)
        for u in units:
            du = u.device_state
            self.eng.wait_task(du.grad_task)
            u.device_state = None
            self.units.remove(u)

    @property
    def layers(self) -> List:
        """The decoder-layer units among :attr:`units` (the resident unit may be there too, first)."""
        return [u for u in self.units if u.kind == "layer"]

    @property
    def resident(self) -> bool:
        """Whether the resident unit's training state is on the device."""
        return any(u.kind == "resident" for u in self.units)

    @property
    def exclusive(self) -> List:
        """The units among :attr:`units` whose fp32 state is on the device only."""
        return [u for u in self.units if u.device_state.exclusive]

    @property
    def nbytes(self) -> int:
        """Device bytes held by all device-state layers."""
        return sum(u.device_state.nbytes for u in self.units)

    # ------------------------------------------------------------------ host store
    def _select(self, units):
        if units is None:
            return self.units
        return [u for u in units if getattr(u, "device_state", None) is not None]

    @torch.no_grad()
    def to_host(self, units=None) -> None:
        """Copy master / exp_avg / exp_avg_sq / compute of ``units`` (default all) into the host store.

        Only units whose device state changed since the last copy, and the master only when it
        changed since :meth:`masters_to_host` copied it (the host master may have been written
        since, through a ``model.state_dict()`` tensor: that write is kept for the caller to take);
        of the compute copy, the trainable entries only (a frozen entry's host copy is never older
        than the device's, and may have been written the same way), an entry whose device slice holds
        its direct gradient rebuilt from the master. Blocks until the copies are done.
        """
        eng = self.eng
        for u in self._select(units):
            du = u.device_state
            if not du.host_stale:
                continue
            for name in ("master", "exp_avg", "exp_avg_sq"):
                if u.state_numel and not du.exclusive and (name != "master" or du.host_master_stale):
                    eng.store.section(u.index, name).copy_(getattr(du, name))
            if not u.compute_absent:  # (absent: the weights are the master's, rounded; nothing to copy)
                host = eng.store.section(u.index, "compute")
                if du.trained_runs is None:
                    host.copy_(du.compute)
                else:
                    for a, b in du.trained_runs:
                        host[a:b].copy_(du.compute[a:b])
                for i in du.grad_in_compute:  # a direct gradient there: the weights are the master's, rounded
                    e = u.entries[i]
                    host[e.offset:e.offset + e.numel].copy_(du.fp32("master", i))
            du.host_stale = du.host_master_stale = False

    @torch.no_grad()
    def masters_to_host(self, units=None) -> None:
        """Copy the fp32 master weights of ``units`` (default all) into the host store's master section.

        Only units whose master changed since it was last copied; exp_avg / exp_avg_sq / compute stay
        as they are in the host store (:meth:`to_host` copies them when they are read). Blocks until
        the copies are done (on CUDA: after the units' updates enqueued on the compute stream).
        """
        eng = self.eng
        for u in self._select(units):
            du = u.device_state
            if not du.host_master_stale:
                continue
            if u.state_numel and not du.exclusive:
                eng.store.section(u.index, "master").copy_(du.master)
            du.host_master_stale = False

    @torch.no_grad()
    def from_host(self, units=None) -> None:
        """Copy master / exp_avg / exp_avg_sq / compute of ``units`` (default all) from the host store
        (the writes into the optimizer's handed-out moment tensors until now are taken); the compute
        slice of an entry holding its direct gradient keeps it (its weights come from the master)."""
        eng = self.eng
        opt = eng.optimizer
        for u in self._select(units):
            if opt is not None and hasattr(opt, "moments_written"):
                opt.moments_written(u)
            du = u.device_state
            for name in ("master", "exp_avg", "exp_avg_sq"):
                if u.state_numel and not du.exclusive:  # an exclusive unit's are written through the device tier
                    getattr(du, name).copy_(eng.store.section(u.index, name))
            # no host compute section (master-streamed, exclusive): the weights are the master's, rounded
            host = eng.store.section(u.index, "compute") if not u.compute_absent else \
                du.master if du.exclusive else eng.store.section(u.index, "master")
            if not du.grad_in_compute:
                du.compute.copy_(host)
            else:  # a direct gradient's slice keeps it: its weights are rebuilt from the (new) master
                for a, b in runs_without(u, du.grad_in_compute):
                    du.compute[a:b].copy_(host[a:b])
            du.host_stale = du.host_master_stale = False
            du.host_dirty = False

    def mark_host_dirty(self, units=None) -> None:
        """The host sections of ``units`` (default all) were handed out writable (``optimizer.state[p]``):
        the next update of such a unit first copies them back to the device (:meth:`from_host`). An
        exclusive unit hands out its device buffers themselves: nothing to copy back."""
        for u in self._select(units):
            u.device_state.host_dirty = not u.device_state.exclusive

    # ------------------------------------------------------------------ gradients
    def enable_accumulator(self) -> None:
        """Allocate every unit's fp32 gradient accumulator now (``CPUAdamW(gradient_accumulation_steps > 1)``;
        the optimizer port runs :meth:`check_accumulator` first, before any accumulator is allocated).

        Raises:
            torch.cuda.OutOfMemoryError: they do not fit on the device.
        """
        for u in self.units:
            u.device_state.ensure_grad()

    def check_accumulator(self) -> None:
        """Refuse in one line, before anything is allocated, fp32 accumulators (4 B/param) that do not fit in the
        free device memory when the layers are exclusive (on the device because host memory is short) and the
        wrap planned them without accumulation (not ``grad_accumulator=True``)."""
        from ...byte_units import format_bytes

        plan = getattr(self.eng, "offload_plan", None)
        need = sum(4 * int(u.state_numel) for u in self.units if u.device_state.grad is None)
        if not need or not self.exclusive or plan is None or plan.with_accumulator:
            return
        free = self.eng.free_device_bytes()
        if need > free:
            raise RuntimeError(f"megatrain: gradient accumulation needs the fp32 accumulators of {len(self.units)} "
                               f"device-state layers ({format_bytes(need)}) but {format_bytes(free)} of device memory "
                               "is free (they hold their state there because host memory is short); wrap with "
                               "grad_accumulator=True so the planner counts them (fewer layers exclusive, the rest "
                               "on disk with offload_dir), or train with gradient_accumulation_steps=1")

    def drop_grads(self) -> None:
        """``zero_grad``: the direct gradients are forgotten, their compute slices rewritten from the masters."""
        for u in self.units:
            u.device_state.take_weights(keep_grads=False)

    @torch.no_grad()
    def submit_grads(self, unit, grads: List[Optional[torch.Tensor]], task_id) -> None:
        """Hand ``grads`` (device tensors, one per entry or None) of ``unit`` over, on the device.

        An entry's first gradient since the last step / ``zero_grad`` with ``gradient_accumulation_steps``
        1 goes into its slice of the unit's compute buffer (direct; a decoder layer's), any other into
        the fp32 accumulator (allocated then; the first gradient overwrites it, later ones are summed).
        The squared norms go to the engine's ledger (``record_norm``) in a task of the CPU worker,
        ordered with the host-stored units' gradient tasks and ``zero_grad``.
        """
        eng = self.eng
        du = unit.device_state
        idx = []
        states = unit.grad_states()
        opt = eng.optimizer
        if opt is not None and opt.max_grad_norm is None and eng.eager_updates:
            # as for the host-stored units, whose update is queued at their last micro-batch: one more raises
            ga = opt.gradient_accumulation_steps
            if any(g is not None and not unit.entries[i].frozen and states[i].micro_batches >= ga
                   for i, g in enumerate(grads)):
                opt.raise_extra_backward(same_backward=task_id is not None and task_id == unit.last_task)
        direct = du.direct_grads and getattr(opt, "gradient_accumulation_steps", 1) == 1
        for i, g in enumerate(grads):
            if g is None or unit.entries[i].frozen:
                continue
            if direct and states[i].micro_batches == 0:
                du.weights(i).copy_(g.reshape(-1))
                du.grad_in_compute.add(i)
            else:
                du.take_weights()  # (a gradient still in compute moves to the accumulator; acquire() did it)
                du.ensure_grad()
                acc = du.fp32("grad", i)
                if states[i].micro_batches == 0:
                    acc.copy_(g.reshape(-1))
                else:
                    acc.add_(g.reshape(-1))
            eng.ledger.on_device(unit.index, i)
            idx.append(i)
        unit.last_task = task_id
        if not idx:
            return
        norms = grad_norms([du.grad_of(i) for i in idx], eng.fused_grad_norms)
        ev = None
        if eng.cuda:
            eng.wait_task(du.grad_task)  # the previous task read the row; almost always long done
            row = du.norm_row[:len(idx)]
            row.copy_(norms, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(eng.compute_stream())
        else:
            row = norms
        ledger = eng.ledger

        def task():
            if ev is not None:
                ev.synchronize()
            vals = row.tolist()
            for k, i in enumerate(idx):
                ledger.record_norm(unit.index, i, float(vals[k]) ** 2)

        du.grad_task = unit.grad_task = eng.submit_grad_task(task, ready=ev)

    # ------------------------------------------------------------------ update
    @property
    def checks_on_device(self) -> bool:
        """Whether :meth:`update` can skip a non-finite gradient's update on the device
        (``finite_on_device``: the fused kernel's ``found_inf``), without the host knowing the norm yet."""
        return self.impl == "fused"

    @torch.no_grad()
    def update(self, unit, items, scale: float, entries: Optional[List[int]] = None, zero_grads=(),
               finite_on_device: bool = False) -> None:
        """AdamW of ``unit``'s ``items`` on the device, now (enqueued on the compute stream).

        Args:
            items: ``(entry_index, lr, beta1, beta2, eps, weight_decay, step)`` per entry (the
                optimizer has bumped the step counts).
            scale: the clip coefficient (1.0 without clipping).
            entries: the entries this update covers (default: all).
            zero_grads: entries updated with an all-zero gradient (``zero_grad(set_to_none=False)``).
            finite_on_device: without clipping, decide the non-finite skip on the device (the
                gradients' float64 norms, as the host's, feed ``torch._fused_adamw_``'s ``found_inf``:
                every group of the unit is skipped when one of its gradients is non-finite) instead
                of reading the norms on the host, which waits for the end of backward. The caller
                then undoes the step counts from the host's norms (:meth:`skip_if_nonfinite`).
                Only where :attr:`checks_on_device`.

        Without clipping each layer's update is skipped when its gradient is non-finite (the
        optimizer's step counts are put back and the skip is reported, as for the host-stored
        layers); with clipping the optimizer has checked the global norm already.
        """
        opt = self.eng.optimizer
        du = unit.device_state
        if du.host_dirty:  # optimizer.state[p] of this unit was handed out: take what was written there
            self.from_host([unit])
        zero = set(zero_grads)
        found_inf = None
        if finite_on_device:
            if not self.checks_on_device:
                raise RuntimeError("megatrain: finite_on_device needs the fused device AdamW")
            checked = [du.grad_of(i) for i, *_ in items if i not in zero]
            if checked:  # float64 norms: finite exactly when every element is (as the host's grad_sq)
                norms = grad_norms(checked, self.eng.fused_grad_norms)
                found_inf = (~torch.isfinite(norms)).any().to(torch.float32)
        elif opt is not None and opt.max_grad_norm is None and items and self.skip_if_nonfinite(unit, items, zero):
            return
        device_adamw(du, items, scale, zero, fused=self.impl == "fused", found_inf=found_inf)
        du.grad_in_compute.difference_update(i for i, *_ in items)  # their compute copy is the new master's
        du.host_stale = du.host_master_stale = True

    def skip_if_nonfinite(self, unit, items, zero=()) -> bool:
        """Without clipping: when the host's norms of ``unit``'s ``items`` (``grad_sq``, known once its
        gradient task ran) are not all finite, put the optimizer's step counts back and record the
        skip with the optimizer (``skip_unit_update``: its non-finite warning). Returns whether it was skipped (the update then did not run, or
        ran with ``found_inf`` set, which left every state unchanged)."""
        sq = unit.grad_sq
        if all(math.isfinite(sq[i]) for i, *_ in items if i not in zero):
            return False
        opt = self.eng.optimizer
        opt.skip_unit_update(unit, items, opt.steps_called + 1)
        return True

