"""The stream engine: host store, device slots, copy streams and the CPU worker.

The engine owns every persistent training state of a wrapped model in a ``HostStore`` (host
memory) and moves bytes between it and the compute device:

* **H2D** — the compute copy of a unit (one decoder layer, or the resident unit that holds the
  embedding / final norm / LM head) is copied into a *device slot* on the H2D stream; the slot's
  ``weights_ready`` event gates the compute stream. Forward prefetches layer ``i+1`` while ``i``
  computes, backward prefetches ``i-1``. A slot is reused only after its ``buffer_free`` event
  (recorded on the compute stream when the layer is done with it).
* **D2H** — weight gradients produced by a layer's backward are copied on the D2H stream into a
  bounded pool of pinned staging buffers (``backward_done`` event gates the copy).
* **CPU worker** — one thread that waits for each D2H copy, accumulates the gradient into the
  store's fp32 ``grad_accum`` section (overwrite on the first micro-batch after a step), and runs
  the fused CPU AdamW of each unit when the optimizer steps; the update also writes the new
  compute copy. The next forward's load of unit ``i`` waits only for unit ``i``'s update.

On a machine without a GPU the same engine runs with device slots in host memory and synchronous
copies (the "CPU backend"), so every path is exercised by CPU tests.

:class:`Engine` is the one interface the other parts of megatrain use. Its methods come from:

* this module: construction (budget check, store), host-store views, ``sync_host`` /
  ``host_written``, ``take_state_dict_writes`` / ``refresh_state_dict_views`` (the optimizer's
  step and the held ``model.state_dict()`` tensors), the attached optimizer and ``locate``;
* :mod:`.memory` (:class:`~.memory.EngineMemory`): the fp32 accumulator
  (``enable_accumulator``), ``finish_fill``, device-state layers (``init_device_state``,
  ``resize_device_state``), ``free_device_bytes``;
* :mod:`.waits` (:class:`~.waits.EngineWaits`): waiting for the worker (``flush``,
  ``wait_grads``, ``wait_task``, ``wait_event``);
* :mod:`.slots` (:class:`~.slots.SlotPool`, over the C++ ``_C.SlotPool``): ``acquire`` /
  ``prefetch`` / ``release``, ``copy_h2d``, ``wait_update``, ``bind`` / ``unbind``, ``drop_slots``;
* :mod:`.grads` (:class:`~.grads.GradLedger`): ``submit_grads`` (hand-over + accumulation), ``settle``;
* :mod:`.grad_copies` (:class:`~.grad_copies.GradCopies`): ``copy_grads_d2h`` (the gradient D2H);
* :mod:`.updates` (:class:`~.updates.UpdateQueue`): ``submit_update``, ``ensure_weights``, ``zero_grad``;
* :mod:`.stats` (:class:`~.stats.EngineStats`): ``stats()``; :mod:`.timeline`: ``worker_timeline()``.

The units and entries it streams are :mod:`.units`'s; the CPU thread is :mod:`.worker`'s.

Source: MegaTrain (arXiv 2604.05091) sections 3-4; this repo's ``DESIGN.md`` sections 2-4.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import List, Optional, Tuple

import torch

from ..._loader import load_extension
from .. import data_parallel
from .grad_copies import GradCopies
from ..placement.disk_plan import DiskOffload, check_offload_args, plan_offload
from .memory import EngineMemory
from .optimizer_port import EngineOptimizer
from .waits import EngineWaits
from .grads import GradLedger
from ..placement.host_memory import check_host_budget
from ..options import Options, options
from .slots import SlotPool
from .stats import EngineStats
from .units import Unit, unit_tables
from .updates import UpdateQueue
from .worker import _Worker

_C = load_extension()


_STEP_GUARD = None  # the handle of the global torch.optim step pre-hook (installed once, by the first engine)
_STEP_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> group sizes checked


def _refuse_foreign_step(optimizer, args, kwargs) -> None:
    """torch.optim step pre-hook: an optimizer other than megatrain's over a wrapped model's parameters raises.

    Such an optimizer would see only placeholders (meta layers, or resident copies that the host
    store overwrites) and train nothing while the model's gradients go to its CPUAdamW. Each
    optimizer's parameters are checked once per change of its param groups (a ``_megatrain``
    attribute lookup per parameter).
    """
    if getattr(optimizer, "megatrain_optimizer", False):
        return
    key = tuple(len(g["params"]) for g in optimizer.param_groups)
    if _STEP_CHECKED.get(optimizer) == key:
        return
    for g in optimizer.param_groups:
        for p in g["params"]:
            if locate(p) is not None:
                raise RuntimeError(
                    f"megatrain: {type(optimizer).__module__}.{type(optimizer).__qualname__}.step() over a wrapped "
                    "model's parameters would train nothing (megatrain keeps them in its host store); use "
                    "megatrain.optim.CPUAdamW(model.parameters(), ...) instead")
    _STEP_CHECKED[optimizer] = key


def _install_step_guard() -> None:
    global _STEP_GUARD
    if _STEP_GUARD is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_GUARD = register_optimizer_step_pre_hook(_refuse_foreign_step)


def locate(param: torch.Tensor) -> Optional[Tuple["Engine", Unit, int]]:
    """``(engine, unit, entry_index)`` of a parameter of a wrapped model, or None for any other tensor.

    The one lookup from a user-visible parameter (``model.parameters()``) to where megatrain keeps
    it; :meth:`Engine.register_param` records it.
    """
    return getattr(param, "_megatrain", None)


class Engine(EngineMemory, EngineWaits, SlotPool, GradLedger, GradCopies, UpdateQueue, EngineStats):
    """Streams units between a ``HostStore`` and a compute device (see module docstring).

    Args:
        units: the units in forward order (layers first, resident unit last).
        device: compute device (``cuda:N`` or ``cpu``).
        compute_dtype: dtype of the compute copy and of the device slots
            (``torch.bfloat16`` or ``torch.float32``).
        num_slots: device slots per distinct layer template (>= 2 for prefetch).
        staging_buffers: pinned staging buffers for layer gradients (bounded pool).
        grad_accumulator: ``True``: the fp32 gradient accumulator is a section of the store
            (4 B/param). ``False``: never; every optimizer step must have exactly one backward
            pass (gradients go straight into the compute section; see ``submit_grads``).
            ``None`` (auto): allocated outside the store, for the trainable entries only, when
            first needed (``CPUAdamW(gradient_accumulation_steps > 1)``, or a second backward
            before ``step()``); see ``enable_accumulator``.
        reclaimable_bytes: host bytes the caller frees while the store is filled (the source
            model's parameters, released layer by layer): counted as available by the budget
            check when the store is page-locked only after the fill (the default).
        offload_dir: a directory on a local disk for the fp32 state of the decoder layers that
            do not fit in host memory (None: everything in host memory); see
            :mod:`megatrain.runtime.placement.disk_plan` and docs/disk_tier.md.
        host_memory_limit: bytes of host memory the engine may use for the store, staging and
            the disk tier's buffers (None: the host budget check's limits alone).
        keep_host_layers: layers ``0 .. keep_host_layers-1`` never go to disk (device-state layers).

    Raises:
        ValueError: a bad ``offload_dir`` / ``host_memory_limit``, or ``offload_dir`` with data parallel.
        HostMemoryError: if the host part does not fit (raised before anything is allocated).
        DiskSpaceError: the disk tier's files do not fit under ``offload_dir`` (nothing written).
    """

    def __init__(self, units: List[Unit], device: torch.device, compute_dtype: torch.dtype,
                 num_slots: int = 2, staging_buffers: int = 4, grad_accumulator: Optional[bool] = True,
                 reclaimable_bytes: int = 0, offload_dir: Optional[str] = None,
                 host_memory_limit: Optional[int] = None, keep_host_layers: int = 0):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        offload_dir = check_offload_args(offload_dir, host_memory_limit)
        if offload_dir is not None and data_parallel.active():
            raise ValueError("megatrain.wrap: offload_dir (the disk tier) is not supported with data parallel yet; "
                             "wrap without offload_dir, or run one process (MEGATRAIN_DATA_PARALLEL=0)")
        self.units = units
        self.num_slots = num_slots
        self.layers = [u for u in units if u.kind == "layer"]
        self.device = device
        self.compute_dtype = compute_dtype
        self.cuda = device.type == "cuda"
        tables, frozen = unit_tables(units)
        self.accumulator_mode = None if grad_accumulator is None else bool(grad_accumulator)
        in_store = self.accumulator_mode is True
        self._accum: Optional[dict] = None  # auto mode: unit index -> flat fp32 accumulator (trainable entries)
        self.options: Options = options()  # read once, here (see megatrain.runtime.options)
        self.pin_after_fill = self.options.pin_after_fill
        credit = int(reclaimable_bytes) if self.pin_after_fill else 0
        # Which layers' fp32 state goes to disk (none without offload_dir), and the host part without it.
        self.offload_plan = plan_offload(
            units, compute_dtype, self.accumulator_mode, staging_buffers, offload_dir=offload_dir,
            host_memory_limit=host_memory_limit, reclaimable_bytes=credit, cuda=self.cuda,
            keep_layers=keep_host_layers, num_buffers=self.options.disk_buffers,
            check=offload_dir is not None or host_memory_limit is not None)
        self.host_plan = self.offload_plan.host_plan
        store_bytes = self.host_plan["store_bytes"]
        staging_bytes = self.host_plan["staging_bytes"]
        check_host_budget(self.offload_plan.host_bytes, store_bytes + staging_bytes if self.cuda else 0,
                          "host store", reclaimable_bytes=credit)
        # Data parallel (an initialised torch.distributed group): one store per node, shared by its ranks.
        self.dp = data_parallel.detect(device)
        # checked above, with the credit of the model's own weights: the store's own check is skipped
        if self.dp is not None:
            self.store = self.dp.create_store(tables, compute_dtype, in_store,
                                              self.cuda and not self.pin_after_fill, frozen, store_bytes)
        else:
            self.store = _C.HostStore(tables, compute_dtype, in_store, self.cuda and not self.pin_after_fill,
                                      frozen=frozen, check_budget=False, offloaded=self.offload_plan.offloaded)
        for u in units:
            state_offs = self.store.state_offsets(u.index)
            for e, (_, _, numel, off), soff in zip(u.entries, self.store.entries(u.index), state_offs):
                assert e.numel == numel, (e.name, e.numel, numel)
                e.offset = off
                e.state_offset = soff
            u.numel = self.store.unit_numel(u.index)
            u.state_numel = self.store.unit_state_numel(u.index)
        # The disk tier (its files are created here, after every check): Unit.disk of its units.
        self.disk: Optional[DiskOffload] = None
        if self.offload_plan.disk_units:
            self.disk = DiskOffload(self, self.offload_plan, io_threads=self.options.disk_io_threads,
                                    fault=self.options.disk_fault)
            if self.accumulator_mode is True:
                self.disk.enable_accumulator()
        self.debug = self.options.debug_races
        self.overlap = self.options.overlap
        self.d2h_overlap = self.options.d2h_overlap
        self.eager_updates = self.options.eager_updates
        self.fused_grad_norms = self.options.fused_grad_norms
        self._init_slots(num_slots)
        self._init_grads(staging_buffers)
        self._worker = _Worker(adam_threads=self.options.adam_threads)
        if self.dp is not None:  # this rank's pieces of the shared store (runtime/data_parallel/)
            data_parallel.attach(self)
        self._init_stats()
        self._optimizer: Optional[EngineOptimizer] = None
        self.device_state = None  # DeviceState of the device-state layers (init_device_state)

    def state_window(self, write: bool = False):
        """Context in which ``entry_view`` / ``section`` reach the disk units' fp32 state (one unit at a
        time: see :meth:`~..placement.disk_plan.DiskOffload.window`); a no-op context without a disk tier.
        ``write``: the units viewed are written back (dirty). Drains the CPU worker first."""
        if self.disk is None:
            return contextlib.nullcontext()
        return self.disk.window(write)

    def sync_host(self, units: Optional[List[Unit]] = None, for_write: bool = False) -> None:
        """Make the host store current before reading it (checkpoint, state_dict, export, optimizer state).

        Waits for the CPU work in flight (``units`` None: ``flush()``; else each unit's update),
        then copies the device-state layers' master / exp_avg / exp_avg_sq / compute copy into
        their host-store sections (only those that changed since the last copy). ``for_write``: the
        caller hands those sections out writable (``optimizer.state[p]``); the device-state units'
        next update copies them back to the device first. The disk units' state is read through
        :meth:`state_window`.
        """
        self.check_resident_params("reading the state")
        if units is None:
            self.flush()
        else:
            for u in units:
                self.wait_update(u)
        if self.device_state is not None:
            self.device_state.to_host(units)
            if for_write:  # handed out writable (optimizer.state[p]): the next update copies them back
                self.device_state.mark_host_dirty(units)

    def host_written(self, units: Optional[List[Unit]] = None) -> None:
        """The host store sections of ``units`` (default all) were written: refresh their device state.

        Call ``sync_host`` before the write (a partial write keeps the other sections' values).
        """
        if self.device_state is not None:
            self.device_state.from_host(units)

    def take_state_dict_writes(self) -> None:
        """Before an optimizer step's updates: in-place writes into ``model.state_dict()`` tensors of the
        device-state units reach their device state now, so the update applies to the written weights
        (as ``torch.optim.AdamW``'s to a parameter written before ``step()``); a frozen entry's, into
        its compute copy, reaches the device copy. The host-stored units' writes are taken at the
        next forward (the CPU update reads the host store itself).

        Without ``max_grad_norm`` a host-stored unit's update ran during backward (eager updates): a
        write into its state_dict tensors since then replaced the updated weights, where torch would
        update the written ones. That is refused here, before this step queues anything.

        Raises:
            RuntimeError: a device-state unit was written through a tensor holding an older master, or
                through a frozen entry's fp32 copy of a bf16 compute copy
                (:meth:`~..model.state_dict_views._Masters.take_writes`); or a host-stored unit after its eager update.
        """
        masters = getattr(self, "masters", None)
        if masters is None:
            return
        flags = {u.index: u.eager for u in self.units if u.device_state is None}  # one ledger read per unit
        eager = [u for u in self.units if any(flags.get(u.index, ()))]
        late = masters.written(eager, only=lambda u, i: flags[u.index][i]) if eager else []  # updated in backward
        if late:
            u, names = late[0]
            raise RuntimeError(
                f"megatrain.optim.CPUAdamW.step: {names[0]} was written through a model.state_dict() tensor after "
                "backward(), but without max_grad_norm its update already ran during backward(): the write replaced "
                "the updated weights (torch would update the written ones). Write before backward() or after step(), "
                "or set max_grad_norm (updates then wait for step())")
        if self.device_state is not None:
            masters.take_writes(self.device_state.units)

    def refresh_state_dict_views(self) -> None:
        """After an optimizer step's updates: the units whose ``model.state_dict()`` tensors are alive
        (held by the caller, or a view of one is) read the step's new weights when ``step()`` returns,
        as torch's state_dict tensors (the parameters) do: a host-stored unit's queued CPU update is
        waited for (it writes the host store those tensors view), a device-state unit copies its new
        master weights there. Nothing is waited for or copied for the other units."""
        masters = getattr(self, "masters", None)
        if masters is None:
            return
        held = masters.held_units(self.units)
        for u in held:
            if u.device_state is None:
                self.wait_update(u)
        on_device = [u for u in held if u.device_state is not None]
        if on_device:
            self.device_state.masters_to_host(on_device)

    def _host_buffer(self, numel: int) -> torch.Tensor:
        if self.cuda:
            # bounded staging, counted in the store's budget check
            return _C.pinned_empty(numel, self.compute_dtype, check_budget=False)
        return torch.empty(numel, dtype=self.compute_dtype)

    def section(self, unit: Unit, name: str) -> torch.Tensor:
        """Flat zero-copy view of one store section of ``unit`` (CPU, pinned when on CUDA).

        A disk unit's fp32 sections: a view of the tier's buffer, inside ``disk.window`` only.
        """
        if unit.disk is not None and name != "compute":
            return self.disk.section(unit, name)
        return self.store.section(unit.index, name)

    def entry_view(self, unit: Unit, i: int, name: str) -> torch.Tensor:
        """Shaped zero-copy view of entry ``i`` of ``unit`` in store section ``name``.

        A disk unit's master / exp_avg / exp_avg_sq: a view of the tier's buffer, valid inside a
        ``disk.window`` until another disk unit is viewed (see :class:`~..placement.disk_plan.DiskOffload`).

        Raises:
            ValueError: a frozen entry has no fp32 sections (only ``compute``); a disk unit's
                accumulator is reached through the worker's tasks only.
            RuntimeError: a disk unit's fp32 state outside a window.
        """
        if unit.disk is not None and name != "compute":
            if name == "grad_accum":
                raise ValueError(f"megatrain: the gradient accumulator of unit {unit.index} is in the disk tier; "
                                 "only the CPU worker's tasks read it")
            return self.disk.view(unit, i, name)
        if name == "grad_accum" and self.accumulator_mode is not True:
            if self._accum is None:
                self.enable_accumulator()
            e = unit.entries[i]
            if e.state_offset < 0:
                raise ValueError(f"megatrain: entry {e.name} is frozen: it has no gradient accumulator")
            return self._accum[unit.index][e.state_offset:e.state_offset + e.numel].view(e.shape)
        return self.store.view(unit.index, i, name)

    # ------------------------------------------------------------------ the other parts
    @property
    def optimizer(self) -> Optional[EngineOptimizer]:
        """The optimizer gradients are routed to (the last one attached), or None."""
        return self._optimizer

    def attach_optimizer(self, optimizer: EngineOptimizer) -> None:
        """Route every gradient of the model to ``optimizer`` (replacing the one attached before).

        The engine reads and calls the :class:`EngineOptimizer` members of ``optimizer``: when a
        gradient is handed over (``submit_grads``: whether its update may start now), and when a
        queued update is skipped.
        """
        self._optimizer = optimizer

    def register_param(self, param: torch.Tensor, unit: Unit, i: int) -> None:
        """Record that ``param`` (user-visible) is entry ``i`` of ``unit``: :func:`locate` finds it."""
        param._megatrain = (self, unit, i)
        _install_step_guard()

    def check_failed(self) -> None:
        """Raise the sticky error of the CPU worker (``RuntimeError``) or of the disk tier (``DiskTierError``)
        if one failed: the host state may be partly updated (restart from the last checkpoint)."""
        self._worker.check()
        if self.disk is not None:
            self.disk.check()

    def close(self) -> None:
        """Run what the CPU worker has queued and stop it; drop the disk tier (its working files are removed)."""
        self._worker.close()
        if self.disk is not None:
            self.disk.close()

    def disk_stats(self) -> Optional[dict]:
        """The disk tier's counters (``DiskOffload.stats``), or None without one."""
        return None if self.disk is None else self.disk.stats()

