"""The stream engine: host store, device slots, copy streams and the CPU worker.

The engine owns every persistent training state of a wrapped model in a ``HostStore`` (host
memory) and moves bytes between it and the compute device:

* **H2D**: a unit's compute copy (a decoder layer, or the resident unit: embedding, final norm, LM
  head) is copied into a *device slot* on the H2D stream, gated by the slot's ``buffer_free`` event;
  its ``weights_ready`` event gates the compute stream. Forward prefetches layer ``i+1``, backward ``i-1``.
* **D2H**: a layer's weight gradients are copied on the D2H stream after its backward.
* **CPU worker**: one thread accumulates each gradient that needs it into fp32 and runs each unit's fused CPU
  AdamW (which also writes the new compute copy); the next load of unit ``i`` waits only for unit ``i``'s update.
  Without a GPU the same engine runs with slots in host memory and synchronous copies (the "CPU backend").

:class:`Engine` is the one interface the other parts of megatrain use. It builds the store (budget
check, disk tier) and owns these parts, each with its own state, built and connected in
``Engine._build_parts`` (the settings they share: :class:`~.context.EngineContext`); they call each
other's public methods only:

* ``counters`` (:class:`~.stats.EngineCounters`): bytes and seconds of the copies, the CPU Adam and the waits;
  ``stats()`` / ``placement()`` report them (:func:`~.stats.engine_stats`);
* ``timeline`` (:class:`~.timeline.WorkerTimeline`): the per-step timeline of the worker's tasks
  (``worker_timeline()``, ``set_worker_timeline``, ``timeline_step_end``);
* ``accumulator`` (:class:`~.memory.Accumulator`): the fp32 accumulator outside the store
  (``enable_accumulator``, ``accumulator_bytes``, ``has_accumulator``);
* ``views`` (:class:`~.views.StoreViews`): ``section``, ``entry_view``, ``task_view``, ``state_window``, ``state_tier``;
* ``slot_pool`` (:class:`~.slots.SlotPool`, over the C++ ``_C.SlotPool``): the device slots and the H2D stream:
  ``acquire`` / ``prefetch`` / ``release``, ``copy_h2d``, ``bind`` / ``unbind``, ``add_slots`` / ``drop_slots``,
  ``invalidate``, ``compute_stream`` (``slots``, ``h2d_stream``);
* ``grads`` (:class:`~.grads.GradLedger`): the ledger, the optimizer attached, the staging pool:
  ``submit_grads`` (hand-over + accumulation), ``settle``, ``submit_grad_task``;
* ``copies`` (:class:`~.grad_copies.GradCopies`): the gradient D2H and the D2H stream (``copy_grads_d2h``);
* ``updates`` (:class:`~.updates.UpdateQueue`): ``submit_update``, ``ensure_weights``, ``zero_grad``;
* ``waits`` (:class:`~.waits.Waits`): ``flush``, ``wait_grads``, ``wait_update``, ``wait_task``, ``wait_event``;
* ``device_layers`` (:class:`~.memory.DeviceStateLayers`): ``init_device_state``, ``resize_device_state``;
* ``worker`` (:class:`~.worker._Worker`): the CPU thread;
* ``sharding`` (:class:`~.sharding.SingleProcess`, or data parallel's :class:`~megatrain.runtime.data_parallel.
  strategy.DataParallelStrategy`): the hooks the parts call where ranks share the work (``dp``: its group, or None).

The engine's own methods: host-store state (``sync_host`` / ``host_written``, ``take_state_dict_writes`` /
``refresh_state_dict_views``), the attached optimizer (``attach_optimizer``, ``register_param``, :func:`locate`:
:mod:`.optimizer_link`), ``free_device_bytes``, ``check_failed``, ``close``; the rest delegate (``forward_to``).

Source: MegaTrain (arXiv 2604.05091) sections 3-4; docs/architecture.md.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..._loader import load_extension
from .. import data_parallel
from ..placement.disk_plan import DiskOffload, check_host_memory_limit, check_offload_args, plan_offload
from ..placement.host_memory import check_host_budget
from ..placement.master_streamed import master_streamable
from ..options import Options, options
from .context import EngineContext, forward_to, part_attribute
from .grad_copies import GradCopies
from .grads import GradLedger
from .memory import Accumulator, DeviceStateLayers, free_device_bytes
from .optimizer_link import install_step_guard, locate  # noqa: F401 - locate: public here too
from .optimizer_port import EngineOptimizer
from .sharding import SingleProcess
from .slots import SlotPool
from .stats import EngineCounters, engine_stats, placement_report
from .timeline import WorkerTimeline
from .units import Unit, unit_tables
from .updates import UpdateQueue
from .views import StoreViews
from .waits import Waits
from .worker import _Worker

_C = load_extension()


class Engine:
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
        keep_host_layers: ``wrap``'s ``device_state_layers`` (int K: layers ``0 .. K-1`` never go to disk); when the
            host store does not fit, the fewest leading ones needed (of K, or under ``"auto"`` / ``"boundary"`` of those
            the ``"auto"`` rule or the capacity share, less ``activation_reserve_of(free)`` when set, places in
            ``free_device_bytes``) hold their fp32 state on the device only (exclusive).
        host_compute_copy: ``wrap``'s ``"auto"`` / True / False (:mod:`~..placement.master_streamed`).

    Raises:
        ValueError: a bad ``offload_dir`` / ``host_memory_limit``, or ``offload_dir`` with data parallel.
        HostMemoryError: if the host part does not fit (raised before anything is allocated).
        DiskSpaceError: the disk tier's files do not fit under ``offload_dir`` (nothing written).
    """

    def __init__(self, units: List[Unit], device: torch.device, compute_dtype: torch.dtype,
                 num_slots: int = 2, staging_buffers: int = 4, grad_accumulator: Optional[bool] = True,
                 reclaimable_bytes: int = 0, offload_dir: Optional[str] = None,
                 host_memory_limit: Optional[int] = None, keep_host_layers=0, host_compute_copy="auto"):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        offload_dir, host_memory_limit = check_offload_args(offload_dir, None), check_host_memory_limit(host_memory_limit)
        if offload_dir is not None and data_parallel.active():
            raise ValueError("megatrain.wrap: offload_dir (the disk tier) is not supported with data parallel yet; "
                             "wrap without offload_dir, or run one process (MEGATRAIN_DATA_PARALLEL=0)")
        self.units, self.num_slots, self.device, self.compute_dtype = units, num_slots, device, compute_dtype
        self.layers, self.cuda = [u for u in units if u.kind == "layer"], device.type == "cuda"
        tables, frozen = unit_tables(units)
        self._accumulator_mode = None if grad_accumulator is None else bool(grad_accumulator)
        in_store = self._accumulator_mode is True
        self.options: Options = options()  # read once, here (see megatrain.runtime.options)
        self.pin_after_fill = self.options.pin_after_fill
        credit = int(reclaimable_bytes) if self.pin_after_fill else 0
        explicit = isinstance(keep_host_layers, int)  # which layers' fp32 state is on the device only / on disk:
        self.planned_device_free = None if explicit else self.free_device_bytes()  # read before any reservation
        reserve = self.activation_reserve_of(self.planned_device_free) if self.activation_reserve_of else None
        self.offload_plan = plan_offload(
            units, compute_dtype, self._accumulator_mode, staging_buffers, offload_dir=offload_dir,
            host_memory_limit=host_memory_limit, reclaimable_bytes=credit, cuda=self.cuda, num_slots=num_slots,
            keep_layers=keep_host_layers if explicit else 0, num_buffers=self.options.disk_buffers,
            exclusive_ok=not data_parallel.active() and (self.cuda or bool(keep_host_layers)),  # CPU: "device" = host
            auto_placement=keep_host_layers == "auto", device_free=self.planned_device_free, activation_reserve=reserve,
            compute_copy=host_compute_copy, streamable=master_streamable(units, data_parallel.active()),
            check=offload_dir is not None or host_memory_limit is not None or not explicit or keep_host_layers > 0)
        self.host_plan = self.offload_plan.host_plan
        store_bytes, staging_bytes = self.host_plan["store_bytes"], self.host_plan["staging_bytes"]
        check_host_budget(self.offload_plan.host_bytes, store_bytes + staging_bytes if self.cuda else 0,
                          "host store", reclaimable_bytes=credit, new_store=True)
        # Data parallel (an initialised torch.distributed group): one store per node, shared by its ranks.
        self.dp = data_parallel.detect(device)
        self.sharding = SingleProcess() if self.dp is None else data_parallel.DataParallelStrategy(self.dp)
        # checked above, with the credit of the model's own weights: the store's own check is skipped
        if self.dp is not None:
            self.store = self.dp.create_store(tables, compute_dtype, in_store,
                                              self.cuda and not self.pin_after_fill, frozen, store_bytes)
        else:
            self.store = _C.HostStore(tables, compute_dtype, in_store, self.cuda and not self.pin_after_fill,
                                      frozen=frozen, check_budget=False, offloaded=self.offload_plan.offloaded,
                                      compute_absent=self.offload_plan.compute_absent)
        for u in units:
            u.master_streamed, u.compute_absent = u.index in self.offload_plan.master_streamed, self.store.compute_absent(u.index)
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
            if self._accumulator_mode is True:
                self.disk.enable_accumulator()
        o = self.options
        self.debug, self.overlap, self.d2h_overlap, self.fused_grad_norms = o.debug_races, o.overlap, o.d2h_overlap, \
            o.fused_grad_norms
        self.eager_updates = o.eager_updates and self.sharding.allows_eager_updates
        self._build_parts(num_slots, staging_buffers)
        self.device_layers.reserve_exclusive([units[k] for k in self.offload_plan.exclusive_units])  # fp32 on device only

    def _build_parts(self, num_slots: int, staging_buffers: int) -> None:
        """Build the parts (see the module docstring) and connect them: the one place that does."""
        device_index = self.device.index if self.cuda and self.device.index is not None else (
            torch.cuda.current_device() if self.cuda else -1)
        ctx = EngineContext(device=self.device, cuda=self.cuda, device_index=device_index,
                            compute_dtype=self.compute_dtype, units=self.units, layers=self.layers,
                            options=self.options, store=self.store, disk=self.disk, sharding=self.sharding)
        self.counters = EngineCounters(self.cuda, device_index)
        self.timeline = WorkerTimeline(getattr(self.options, "worker_timeline", False))
        self.accumulator = Accumulator(self._accumulator_mode, self.units, self.store, self.disk, self.offload_plan,
                                       self.sharding)
        self.views = StoreViews(ctx, self.accumulator)
        self.slot_pool = SlotPool(ctx, num_slots, self.debug, self.counters, self.views)
        self.grads = GradLedger(ctx, staging_buffers, self.eager_updates, self.fused_grad_norms)
        self.waits = Waits(self.units, self.overlap, self.sharding, self.disk)
        self.copies = GradCopies(ctx, self.debug, self.d2h_overlap, self.counters, self.slot_pool, self.waits)
        self.updates = UpdateQueue(ctx, self.overlap)
        self.device_layers = DeviceStateLayers(self, self.slot_pool, self.waits, self.sharding)
        # the CPU thread (data parallel: counting each unit's update tasks for the peers)
        self.worker = self.sharding.wrap_worker(_Worker(adam_threads=self.options.adam_threads))
        self.timeline.connect(self.grads)
        self.slot_pool.connect(self.waits)
        self.waits.connect(self.worker, self.counters, self.timeline, self.grads)
        self.grads.connect(self.worker, self.counters, self.timeline, self.views, self.accumulator, self.copies,
                           self.updates, self.waits, self.slot_pool, self.device_layers)
        self.updates.connect(self.worker, self.grads, self.views, self.accumulator, self.waits, self.slot_pool,
                             self.device_layers)
        self.sharding.bind(self)  # data parallel: this rank's pieces of the shared store (runtime/data_parallel/)

    def sync_host(self, units: Optional[List[Unit]] = None, for_write: bool = False) -> None:
        """Make the host store current before reading it (checkpoint, state_dict, export, optimizer state).

        Waits for the CPU work in flight (``units`` None: ``flush()``; else each unit's update),
        then copies the device-state layers' master / exp_avg / exp_avg_sq / compute copy into
        their host-store sections (only those that changed since the last copy; of an exclusive layer only a
        compute section a frozen entry keeps: it has no other). ``for_write``: the caller hands those sections out writable (``optimizer.state[p]``);
        the device-state units' next update copies them back to the device first. The disk units' and
        exclusive layers' fp32 state is read through :meth:`state_window`."""
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

    # ------------------------------------------------------------------ the parts' interface
    acquire = forward_to("slot_pool", SlotPool.acquire)
    prefetch = forward_to("slot_pool", SlotPool.prefetch)
    release = forward_to("slot_pool", SlotPool.release)
    copy_h2d = forward_to("slot_pool", SlotPool.copy_h2d)
    bind = forward_to("slot_pool", SlotPool.bind)
    unbind = forward_to("slot_pool", SlotPool.unbind)
    add_slots = forward_to("slot_pool", SlotPool.add_slots)
    drop_slots = forward_to("slot_pool", SlotPool.drop_slots)
    invalidate = forward_to("slot_pool", SlotPool.invalidate)
    compute_stream = forward_to("slot_pool", SlotPool.compute_stream)
    slots = part_attribute("slot_pool", "slots", "Layer template -> its device slots.")
    h2d_stream = part_attribute("slot_pool", "h2d_stream", "The H2D copy stream (CUDA only).")
    cpp_slots = part_attribute("slot_pool", "cpp_slots", "Whether the slots and copies are the C++ scheduler's.")
    flush = forward_to("waits", Waits.flush)
    wait_grads = forward_to("waits", Waits.wait_grads)
    wait_update = forward_to("waits", Waits.wait_update)
    wait_task = forward_to("waits", Waits.wait_task)
    wait_event = forward_to("waits", Waits.wait_event)
    submit_grads = forward_to("grads", GradLedger.submit_grads)
    submit_grad_task = forward_to("grads", GradLedger.submit_grad_task)
    settle = forward_to("grads", GradLedger.settle)
    ledger = part_attribute("grads", "ledger", "The ``_C.Ledger`` of every entry's gradient and update state.")
    copy_grads_d2h = forward_to("copies", GradCopies.copy_grads_d2h)
    d2h_done_torch = forward_to("copies", GradCopies.d2h_done_torch)
    d2h_stream = part_attribute("copies", "d2h_stream", "The D2H copy stream (CUDA only).")
    submit_update = forward_to("updates", UpdateQueue.submit_update)
    ensure_weights = forward_to("updates", UpdateQueue.ensure_weights)
    zero_grad = forward_to("updates", UpdateQueue.zero_grad)
    section = forward_to("views", StoreViews.section)
    entry_view = forward_to("views", StoreViews.entry_view)
    task_view = forward_to("views", StoreViews.task_view)
    state_window = forward_to("views", StoreViews.state_window)
    state_tier = forward_to("views", StoreViews.state_tier)
    _host_buffer = forward_to("views", StoreViews.host_buffer, "_host_buffer")
    enable_accumulator = forward_to("accumulator", Accumulator.enable, "enable_accumulator")
    accumulator_bytes = forward_to("accumulator", Accumulator.nbytes, "accumulator_bytes")
    accumulator_mode = part_attribute("accumulator", "mode", "``grad_accumulator`` as wrapped (True / None auto / False).")
    has_accumulator = part_attribute("accumulator", "has_accumulator", "A second gradient before ``step()`` can be summed.")
    accumulator_allocated = part_attribute("accumulator", "allocated", "The fp32 accumulator exists.")
    init_device_state = forward_to("device_layers", DeviceStateLayers.init, "init_device_state")
    resize_device_state = forward_to("device_layers", DeviceStateLayers.resize, "resize_device_state")
    device_state = part_attribute("device_layers", "device_state", "The ``DeviceState`` of the device-state layers, or None.")
    worker_timeline = forward_to("timeline", WorkerTimeline.events, "worker_timeline")
    set_worker_timeline = forward_to("timeline", WorkerTimeline.set_on, "set_worker_timeline")
    timeline_step_end = forward_to("timeline", WorkerTimeline.step_end, "timeline_step_end")
    _timeline_step_begin = forward_to("timeline", WorkerTimeline.step_begin, "_timeline_step_begin")
    _timeline_backward = forward_to("timeline", WorkerTimeline.backward, "_timeline_backward")

    def stats(self) -> dict:
        """Cumulative counters since the engine was built (:func:`~.stats.engine_stats`)."""
        return engine_stats(self)

    def placement(self) -> dict:
        """Where the layers' training state and activations live (:func:`~.stats.placement_report`)."""
        return placement_report(self)

    def finish_fill(self) -> None:
        """The store is filled: page-lock it now (pin-after-fill, the default on CUDA)."""
        if self.cuda and self.pin_after_fill and not self.store.is_pinned:
            self.store.pin()

    gpu_memory_limit_bytes: Optional[int] = None  # wrap(gpu_memory_limit=) in bytes (None: the whole device)
    activation_reserve_of = None  # wrap's batch: free device bytes -> the capacity share's activation reserve

    def free_device_bytes(self) -> int:
        """Device bytes free for new tensors, at most ``gpu_memory_limit_bytes`` (:func:`~.memory.free_device_bytes`)."""
        return free_device_bytes(self.device, self.gpu_memory_limit_bytes)

    def check_resident_params(self, where: str, overwritten=()) -> None:
        """Raise if a parameter outside the store's control was written in place (:class:`~..model.wrapped_engine.WrappedEngine`)."""
    def note_resident_params(self) -> None:
        """Record the state :meth:`check_resident_params` compares against (:class:`~..model.wrapped_engine.WrappedEngine`)."""
    def device_state_resident(self) -> Optional[Unit]:
        """The resident unit ``device_state_layers="auto"`` may keep on the device with the layers
        (its compute copy must already be a device buffer: :class:`~..model.wrapped_engine.WrappedEngine`), or None."""
        return None

    @property
    def optimizer(self) -> Optional[EngineOptimizer]:
        """The optimizer gradients are routed to (the last one attached), or None."""
        return self.grads.optimizer

    def attach_optimizer(self, optimizer: EngineOptimizer) -> None:
        """Route every gradient of the model to ``optimizer`` (replacing the one attached before).

        The engine reads and calls the :class:`EngineOptimizer` members of ``optimizer``: when a
        gradient is handed over (``submit_grads``: whether its update may start now), and when a
        queued update is skipped.
        """
        self.grads.attach_optimizer(optimizer)

    def register_param(self, param: torch.Tensor, unit: Unit, i: int) -> None:
        """Record that ``param`` (user-visible) is entry ``i`` of ``unit``: :func:`locate` finds it."""
        param._megatrain = (self, unit, i)
        install_step_guard()

    def check_failed(self) -> None:
        """Raise the sticky error of the CPU worker (``RuntimeError``) or of the disk tier (``DiskTierError``)
        if one failed: the host state may be partly updated (restart from the last checkpoint)."""
        self.worker.check()
        if self.disk is not None:
            self.disk.check()

    def close(self) -> None:
        """Run what the CPU worker has queued (and master-streamed layers' deferred updates) and stop it; drop the disk tier."""
        if not self.worker.failed:
            self.grads.held.pump(everything=True)
        self.worker.close()
        if self.disk is not None:
            self.disk.close()

    def disk_stats(self) -> Optional[dict]:
        """The disk tier's counters (``DiskOffload.stats``), or None without one."""
        return None if self.disk is None else self.disk.stats()
