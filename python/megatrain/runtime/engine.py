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

Source: MegaTrain (arXiv 2604.05091) sections 3-4; this repo's ``DESIGN.md`` sections 2-4.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import math
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

from .._loader import load_extension
from .host_memory import check_host_budget, checked_in_python

_C = load_extension()


def _debug_races() -> bool:
    return os.environ.get("MEGATRAIN_DEBUG_RACES", "0") not in ("", "0")


@dataclass
class Entry:
    """One parameter of a unit: where it lives in the store and on which module it is bound.

    Attributes:
        name: fully qualified parameter name in the wrapped model (``model.layers.3.mlp.up_proj.weight``).
        shape: parameter shape.
        numel: number of elements.
        offset: element offset inside the unit's flat sections (same in every section).
        owners: ``(module, attribute)`` pairs that hold this parameter (more than one when tied).
        param: the user-visible ``nn.Parameter`` (a meta placeholder for streamed layers, a real
            device parameter for the resident unit).
        frozen: ``requires_grad=False`` when the model was wrapped: the store holds only its
            compute copy (no master, exp_avg, exp_avg_sq or accumulator).
        state_offset: element offset inside the unit's fp32 sections (-1 when frozen).
    """

    name: str
    shape: tuple
    numel: int
    offset: int
    owners: list
    param: torch.nn.Parameter
    frozen: bool = False
    state_offset: int = 0


@dataclass
class Unit:
    """A group of parameters streamed and updated together (one decoder layer or the resident unit)."""

    index: int
    kind: str  # "layer" or "resident"
    entries: List[Entry]
    numel: int
    template: tuple
    module: Optional[torch.nn.Module] = None
    state_numel: int = 0  # padded length of the unit's fp32 sections (frozen entries have none)
    version: int = 0
    update_done: threading.Event = field(default_factory=threading.Event)
    # Written only on the worker thread: entry i received a gradient since the last step/zero_grad.
    has_grad: List[bool] = field(default_factory=list)
    grad_sq: List[float] = field(default_factory=list)
    # Main thread only, per entry: backward passes that delivered it a gradient since the last
    # step, and whether its update was already queued (eager mode; layers queue all their
    # entries at once, the resident unit each entry as its gradient arrives).
    batches: List[int] = field(default_factory=list)
    eager: List[bool] = field(default_factory=list)
    last_task: Optional[int] = None  # autograd graph task of the last gradient handed over
    grad_task_done: threading.Event = field(default_factory=threading.Event)  # set: the last gradient task ran
    # Main thread only: entry i's slice of the store's compute section holds its gradient (the
    # first of this step, D2H'd there directly) instead of its weights, until the update.
    direct: List[bool] = field(default_factory=list)
    # A device-state layer (``wrap(device_state_layers=K)``): its ``DeviceUnit`` (device buffers of
    # the whole training state), else None. See ``megatrain.runtime.device_state``.
    device_state: Optional[object] = None

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

    @property
    def update_key(self) -> int:
        """Position in the next forward (resident unit first): the worker's update priority."""
        return 0 if self.kind == "resident" else 1 + self.index

    def __post_init__(self):
        self.update_done.set()
        self.grad_task_done.set()
        self._lock = threading.Lock()
        self._in_flight = 0
        n = len(self.entries)
        self.has_grad = [False] * n
        self.grad_sq = [0.0] * n
        self.batches = [0] * n
        self.eager = [False] * n
        self.direct = [False] * n


def unit_tables(units: List[Unit]) -> Tuple[list, list]:
    """``(tables, frozen)`` of ``units`` as ``HostStore`` takes them: per unit ``[(name, shape)]`` and frozen flags."""
    tables = [[(e.name, list(e.shape)) for e in u.entries] for u in units]
    frozen = [[bool(e.frozen) for e in u.entries] for u in units]
    return tables, frozen


def plan_host_memory(units: List[Unit], compute_dtype: torch.dtype, grad_accumulator: Optional[bool],
                     staging_buffers: int = 4) -> dict:
    """Host bytes an :class:`Engine` over ``units`` allocates, computed without allocating.

    The engine's budget check and :func:`megatrain.estimate` both use this, and the store part comes
    from ``HostStore.layout_required`` (the C++ planning the store's constructor runs).

    Args:
        units: the units in forward order (``kind`` "layer" / "resident"; ``entries[i].frozen``).
        compute_dtype: ``torch.bfloat16`` or ``torch.float32``.
        grad_accumulator: ``True``: the fp32 accumulator is a store section; ``None`` / ``False``: not.
        staging_buffers: pinned staging buffers for layer gradients.

    Returns:
        dict: ``layout`` (``HostStore.layout_required``'s dict: ``section_bytes``, ``unit_numel``,
        ``unit_state_numel``, ``total_numel``, ``frozen_numel``), ``store_bytes`` (the arena),
        ``staging_bytes`` (``staging_buffers`` buffers of the largest layer plus the resident
        unit's gradient staging, compute dtype), ``accumulator_bytes`` (the fp32 accumulator
        ``enable_accumulator`` allocates outside the store in auto mode: 4 B per element of the
        units' fp32 sections), all in bytes.
    """
    tables, frozen = unit_tables(units)
    if not hasattr(_C.HostStore, "layout_required"):
        raise RuntimeError("megatrain: the compiled extension megatrain._C is older than its Python code (no "
                           "HostStore.layout_required); rebuild it: python setup.py build_ext --inplace")
    layout = _C.HostStore.layout_required(tables, compute_dtype, grad_accumulator is True, frozen)
    elem = torch.tensor([], dtype=compute_dtype).element_size()
    layer_numel = [n for n, u in zip(layout["unit_numel"], units) if u.kind == "layer"]
    resident_numel = sum(n for n, u in zip(layout["unit_numel"], units) if u.kind != "layer")
    staging = elem * ((staging_buffers * max(layer_numel)) if layer_numel else 0) + elem * resident_numel
    return dict(layout=layout, store_bytes=int(layout["total_bytes"]), staging_bytes=int(staging),
                accumulator_bytes=4 * int(sum(layout["unit_state_numel"])))


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


_LIVE_WORKERS: "weakref.WeakSet[_Worker]" = weakref.WeakSet()


@atexit.register
def _stop_workers() -> None:
    # Finish queued work and join the threads before the interpreter tears down: a daemon
    # thread still inside a torch op at finalization aborts the process ("terminate called
    # without an active exception").
    for w in list(_LIVE_WORKERS):
        w.close()


class _Task:
    __slots__ = ("klass", "key", "seq", "fn", "ready")

    def __init__(self, klass, key, seq, fn, ready):
        self.klass, self.key, self.seq, self.fn, self.ready = klass, key, seq, fn, ready

    def is_ready(self) -> bool:
        return self.ready is None or bool(self.ready())


class _Worker:
    """One CPU thread running gradient tasks and Adam updates, by priority and readiness.

    Gradient tasks (D2H waits, accumulation, zero_grad bookkeeping) run in submission order and
    before updates: they free pinned staging buffers and are what ``optimizer.step()`` waits
    for. Update tasks run earliest deadline first: the key is the unit's position in the next
    forward (resident unit first, then layer 0, 1, ...). During backward the gradients arrive
    last layer first; when the CPU Adam falls behind, the lowest-index waiting layer (the one the
    next forward needs soonest) is updated first, and the deep layers' updates overlap the next
    forward instead of delaying its start.

    A task may carry a readiness test (a CUDA event's ``query``, or "this unit's gradient task
    ran"). While the oldest gradient task is still waiting for its D2H copy, a ready update runs
    instead of blocking the thread on that copy (otherwise a main thread that runs ahead of the
    GPU would queue every layer's gradient task first and no update would overlap backward).
    """

    GRAD = 0
    UPDATE = 1

    def __init__(self):
        self._grads: "collections.deque[_Task]" = collections.deque()
        self._updates: List[_Task] = []
        self._seq = itertools.count()
        self._error: Optional[BaseException] = None
        self._closed = False
        self._stop = False
        self._cv = threading.Condition()
        self._grad_pending = 0
        self._unfinished = 0
        self._thread = threading.Thread(target=self._run, name="megatrain-cpu-worker", daemon=True)
        self._thread.start()
        _LIVE_WORKERS.add(self)

    def _pick(self) -> Optional[_Task]:
        """Next task (called with the lock held, some task queued)."""
        if self._grads and self._grads[0].is_ready():
            return self._grads.popleft()
        ready = [t for t in self._updates if t.is_ready()] if self._updates else []
        if ready:
            t = min(ready, key=lambda t: (t.key, t.seq))
            self._updates.remove(t)
            return t
        if self._grads:
            return self._grads.popleft()  # blocks on its copy: no later work can be ready before it
        t = min(self._updates, key=lambda t: (t.key, t.seq))
        self._updates.remove(t)
        return t

    def _run(self):
        # MEGATRAIN_ADAM_THREADS: intra-op threads of this worker's kernels (default: torch's),
        # e.g. cores - 1 so that the thread launching GPU work is never starved by the update.
        n = os.environ.get("MEGATRAIN_ADAM_THREADS", "")
        if n.strip():
            torch.set_num_threads(max(1, int(n)))
        while True:
            with self._cv:
                while not self._grads and not self._updates:
                    if self._stop:
                        return
                    self._cv.wait()
                task = self._pick()
            try:
                if self._error is None:
                    task.fn()
            except BaseException as e:  # re-raised on the main thread at the next sync point
                self._error = e
            finally:
                with self._cv:
                    self._unfinished -= 1
                    if task.klass == self.GRAD:
                        self._grad_pending -= 1
                    self._cv.notify_all()

    def submit(self, task: Callable[[], None], klass: int = GRAD, key: int = 0,
               ready: Optional[Callable[[], bool]] = None) -> None:
        """Queue ``task``: ``klass`` GRAD (FIFO, first) or UPDATE (by ``key``, smallest first).

        ``ready``: a non-blocking test; the task is preferred only once it returns True.
        """
        self.check()
        t = _Task(klass, key, next(self._seq), task, ready)
        with self._cv:
            self._unfinished += 1
            if klass == self.GRAD:
                self._grad_pending += 1
                self._grads.append(t)
            else:
                self._updates.append(t)
            self._cv.notify_all()

    def _wait(self, done: Callable[[], bool]) -> None:
        with self._cv:
            while not done() and self._error is None:
                self._cv.wait(timeout=1.0)
        self.check()

    def wait_grads(self) -> None:
        """Block until every queued gradient task has run (updates may still be queued)."""
        self._wait(lambda: self._grad_pending == 0)

    def drain(self) -> None:
        """Block until every queued task has run."""
        self._wait(lambda: self._unfinished == 0)

    def check(self) -> None:
        """Raise if a task failed. Sticky: the tasks queued after the failed one were skipped (their
        waiters would otherwise wait forever), so every later call raises as well."""
        if self._error is not None:
            err = self._error
            raise RuntimeError(
                f"megatrain CPU worker failed: {err!r}. The tasks queued after it were not run, so the host-memory "
                "training state may be partly updated and this model cannot train on: build it again "
                "(megatrain.wrap) and load the last checkpoint (megatrain.load_checkpoint)") from err

    def close(self) -> None:
        """Run what is queued, then stop the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=60)


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

    Raises:
        HostMemoryError: if the host store does not fit (raised before anything is allocated).
    """

    def __init__(self, units: List[Unit], device: torch.device, compute_dtype: torch.dtype,
                 num_slots: int = 2, staging_buffers: int = 4, grad_accumulator: Optional[bool] = True,
                 reclaimable_bytes: int = 0):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
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
        self.host_plan = plan_host_memory(units, compute_dtype, self.accumulator_mode, staging_buffers)
        store_bytes = self.host_plan["store_bytes"]
        staging_bytes = self.host_plan["staging_bytes"]
        # MEGATRAIN_PIN_AFTER_FILL=0: page-lock the arena when it is mapped (every page faulted in
        # before the fill) instead of after it (benchmarks/bench_load.py measures both).
        self.pin_after_fill = os.environ.get("MEGATRAIN_PIN_AFTER_FILL", "1") != "0"
        credit = int(reclaimable_bytes) if self.pin_after_fill else 0
        check_host_budget(store_bytes + staging_bytes, store_bytes + staging_bytes if self.cuda else 0,
                          "host store", reclaimable_bytes=credit)
        with checked_in_python():
            self.store = _C.HostStore(tables, compute_dtype, in_store, self.cuda and not self.pin_after_fill,
                                      frozen=frozen)
        for u in units:
            state_offs = self.store.state_offsets(u.index)
            for e, (_, _, numel, off), soff in zip(u.entries, self.store.entries(u.index), state_offs):
                assert e.numel == numel, (e.name, e.numel, numel)
                e.offset = off
                e.state_offset = soff
            u.numel = self.store.unit_numel(u.index)
            u.state_numel = self.store.unit_state_numel(u.index)
        self.debug = _debug_races()
        # MEGATRAIN_OVERLAP=0 (benchmarks' "before"): updates in submission order and step()
        # waits for all of them, so no update overlaps the next forward.
        self.overlap = os.environ.get("MEGATRAIN_OVERLAP", "1") != "0"
        # MEGATRAIN_D2H_OVERLAP=0 (benchmarks' "before"): the compute stream waits for each unit's
        # gradient D2H before the next layer's backward, so copies never run under compute.
        self.d2h_overlap = os.environ.get("MEGATRAIN_D2H_OVERLAP", "1") != "0"
        # MEGATRAIN_EAGER_UPDATES=0 (benchmarks' "before"): no update starts during backward; all
        # are queued by step() (as with clipping), so CPU Adam overlaps only the next forward.
        self.eager_updates = os.environ.get("MEGATRAIN_EAGER_UPDATES", "1") != "0"
        # Device slots, per layer template.
        self.slots: dict = {}
        for u in self.layers:
            if u.template not in self.slots:
                self.slots[u.template] = [Slot(u.numel, compute_dtype, device) for _ in range(num_slots)]
        self._use_clock = 0
        if self.cuda:
            self.h2d_stream = torch.cuda.Stream(device)
            self.d2h_stream = torch.cuda.Stream(device)
        # Bounded pool of gradient staging buffers, allocated on first use: only gradients that are
        # summed (accumulation) pass through staging; at one backward per step they go straight into
        # the compute section and the pool never costs host memory. The budget check counted it.
        self._staging_numel = max((u.numel for u in self.layers), default=0)
        self._staging_max = staging_buffers if self.layers else 0
        self._staging_made = 0
        self._staging_lock = threading.Lock()
        self._staging: "queue.Queue[torch.Tensor]" = queue.Queue()
        # Squared-norm readback of direct gradients: one pinned row per unit, allocated once (the
        # unit's previous gradient task, which reads its row, is waited for before it is rewritten).
        max_entries = max((len(u.entries) for u in units), default=0)
        self._norm_rows = None
        if self.cuda:
            with checked_in_python():
                self._norm_rows = _C.pinned_empty(len(units) * max_entries, torch.float64).view(len(units), max_entries)
        self._worker = _Worker()
        self._stats = dict(h2d_bytes=0, d2h_bytes=0, adam_time_s=0.0, adam_exposed_s=0.0,
                           grad_accum_time_s=0.0, grad_wait_s=0.0, h2d_copies=0, slot_hits=0)
        self._timed_copies: list = []  # (kind, start_event, end_event) awaiting readout
        self._h2d_time_s = 0.0
        self._d2h_time_s = 0.0
        self._stats_lock = threading.Lock()
        self.optimizer = None
        self.device_state = None  # DeviceState of the device-state layers (init_device_state)

    # ------------------------------------------------------------------ memory helpers
    def _staging_buffer(self) -> torch.Tensor:
        """A gradient staging buffer of the bounded pool (allocated on first use; blocks while all are in flight)."""
        with self._staging_lock:
            if self._staging.empty() and self._staging_made < self._staging_max:
                self._staging_made += 1
                with checked_in_python():
                    return self._host_buffer(self._staging_numel)
        return self._wait_for(self._staging.get)

    @property
    def has_accumulator(self) -> bool:
        """Whether a second gradient before ``step()`` can be summed (accumulator present or allocatable)."""
        return self.accumulator_mode is not False

    @property
    def accumulator_allocated(self) -> bool:
        return self.accumulator_mode is True or self._accum is not None

    def enable_accumulator(self) -> None:
        """Allocate the fp32 gradient accumulator now (auto mode; no-op when present).

        4 bytes per trainable parameter, outside the store (CPU only: it is never DMA'd), zeroed.

        Raises:
            RuntimeError: the model was wrapped with ``grad_accumulator=False``.
            HostMemoryError: it does not fit in host memory (nothing allocated).
        """
        if self.accumulator_allocated:
            return
        if self.accumulator_mode is False:
            raise RuntimeError("megatrain: the model was wrapped with grad_accumulator=False; gradient accumulation "
                               "needs the fp32 accumulator: wrap with grad_accumulator=None (auto) or True")
        need = self.host_plan["accumulator_bytes"]
        check_host_budget(need, 0, "gradient accumulator")
        self._accum = {u.index: torch.zeros(u.state_numel, dtype=torch.float32) for u in self.units}

    def accumulator_bytes(self) -> int:
        """Host bytes of the fp32 gradient accumulator now allocated (store section or separate)."""
        if self.accumulator_mode is True:
            return int(self.store.section_bytes.get("grad_accum", 0))
        if self._accum is None:
            return 0
        return sum(t.numel() * 4 for t in self._accum.values())

    def finish_fill(self) -> None:
        """The store is filled: page-lock it now (pin-after-fill, the default on CUDA)."""
        if self.cuda and self.pin_after_fill and not self.store.is_pinned:
            self.store.pin()

    def init_device_state(self, layers) -> int:
        """Keep the whole training state of ``layers`` (``int`` K: layers ``0 .. K-1``; ``"auto"``) on the device.

        Called once, after the store is filled. ``"auto"``: as many layers as fit in
        ``AUTO_DEVICE_STATE_FRACTION`` of the free device memory, from the exact buffer sizes
        (compute copy + fp32 master, exp_avg, exp_avg_sq, grad accumulator: 18 B/param in bf16).
        Returns K. See ``megatrain.runtime.device_state``.

        Raises:
            ValueError: ``layers`` is not an int >= 0 or ``"auto"``, or more than the model has.
        """
        from . import device_state as ds

        ds.check_device_state_layers(layers)
        if layers == "auto":
            layers = ds.plan_device_state_layers(self.layers, self.compute_dtype, self._free_device_bytes())
        if layers > len(self.layers):
            raise ValueError(f"megatrain.wrap: device_state_layers={layers}, but the model has {len(self.layers)} "
                             f"decoder layers; use at most {len(self.layers)} (or 'auto')")
        if layers == 0:
            return 0
        chosen = self.layers[:layers]
        self.device_state = ds.DeviceState(self, chosen)
        for template in list(self.slots):  # slots of a layer shape no streamed layer uses any more
            if all(u.device_state is not None for u in self.layers if u.template == template):
                self.slots[template] = []
        return layers

    def _free_device_bytes(self) -> int:
        """Device bytes free for new tensors (CUDA: free + cached by torch; CPU: available host memory)."""
        if self.cuda:
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device))
        from .host_memory import host_memory_limits
        return int(host_memory_limits().get("mem_available_bytes") or 0)

    def sync_host(self, units: Optional[List[Unit]] = None) -> None:
        """Make the host store current before reading it (checkpoint, state_dict, export, optimizer state).

        Waits for the CPU work in flight (``units`` None: ``flush()``; else each unit's update),
        then copies the device-state layers' master / exp_avg / exp_avg_sq / compute copy into
        their host-store sections (only those that changed since the last copy).
        """
        if units is None:
            self.flush()
        else:
            for u in units:
                self.wait_update(u)
        if self.device_state is not None:
            self.device_state.to_host(units)

    def host_written(self, units: Optional[List[Unit]] = None) -> None:
        """The host store sections of ``units`` (default all) were written: refresh their device state.

        Call ``sync_host`` before the write (a partial write keeps the other sections' values).
        """
        if self.device_state is not None:
            self.device_state.from_host(units)

    def _host_buffer(self, numel: int) -> torch.Tensor:
        if self.cuda:
            with checked_in_python():  # bounded staging, counted in the store's budget check
                return _C.pinned_empty(numel, self.compute_dtype)
        return torch.empty(numel, dtype=self.compute_dtype)

    def section(self, unit: Unit, name: str) -> torch.Tensor:
        """Flat zero-copy view of one store section of ``unit`` (CPU, pinned when on CUDA)."""
        return self.store.section(unit.index, name)

    def entry_view(self, unit: Unit, i: int, name: str) -> torch.Tensor:
        """Shaped zero-copy view of entry ``i`` of ``unit`` in store section ``name``.

        Raises:
            ValueError: a frozen entry has no fp32 sections (only ``compute``).
        """
        if name == "grad_accum" and self.accumulator_mode is not True:
            if self._accum is None:
                self.enable_accumulator()
            e = unit.entries[i]
            if e.state_offset < 0:
                raise ValueError(f"megatrain: entry {e.name} is frozen: it has no gradient accumulator")
            return self._accum[unit.index][e.state_offset:e.state_offset + e.numel].view(e.shape)
        return self.store.view(unit.index, i, name)

    # ------------------------------------------------------------------ streams
    def _compute_stream(self):
        return torch.cuda.current_stream(self.device)

    def _timed(self, kind: str, stream):
        if not self.cuda:
            return None
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        if len(self._timed_copies) > 4096:
            self._collect_copy_times()
        self._timed_copies.append((kind, start, end))
        return end

    def wait_update(self, unit: Unit) -> None:
        """Block the calling (main) thread until ``unit``'s pending CPU Adam update is done."""
        if not unit.update_done.is_set():
            t0 = time.perf_counter()
            self.wait_event(unit.update_done)
            with self._stats_lock:
                self._stats["adam_exposed_s"] += time.perf_counter() - t0
        self._worker.check()

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
            for i, d in enumerate(unit.direct):
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
        slot.unit, slot.version = unit, unit.version
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
            self._compute_stream().wait_event(slot.weights_ready)
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
                slot.buffer_free.record(self._compute_stream())
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
            unit.version += 1
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
            backward_done.record(self._compute_stream())
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
                self._compute_stream().wait_event(ev)
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

        self._worker.submit(grad_task, ready=ev.query if ev is not None else None)
        if plan is not None:
            items, scale = plan
            self._submit_adam(unit, items, scale, after=grad_done, entries=[i for i, p in enumerate(present) if p],
                              finite=(lambda: finite[0]) if getattr(opt, "nonfinite", None) is not None else None)

    def _submit_adam(self, unit: Unit, items, scale: float, after: Optional[threading.Event] = None,
                     entries: Optional[List[int]] = None, zero_grads=(),
                     finite: Optional[Callable[[], bool]] = None) -> None:
        """Queue the fused AdamW of ``unit``'s ``entries`` (default: all; worker, by deadline).

        The unit is "in flight" from when the task is queued (``_submit_updating``) until it ran.
        Each entry's gradient is read from the compute section (``unit.direct``) or the fp32
        accumulator; direct entries that are not updated (not in this optimizer) get their weights
        back. ``after``: set when the unit's gradient task ran (the update is not started before).
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

        step_number = getattr(self.optimizer, "_steps_called", 0) + 1  # the step() this update belongs to

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
                              ready=after.is_set if after is not None else None)

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

    def _wait_for(self, get: Callable):
        """Call a blocking ``get(timeout=...)`` until it succeeds, re-raising a CPU worker failure meanwhile."""
        while True:
            try:
                return get(timeout=1.0)
            except queue.Empty:
                self._worker.check()

    def wait_event(self, ev: threading.Event) -> None:
        """Wait for ``ev`` (set by a worker task), re-raising a CPU worker failure instead of hanging."""
        while not ev.wait(timeout=1.0):
            self._worker.check()

    def flush(self) -> None:
        """Wait until every submitted gradient has been accumulated and every update applied."""
        t0 = time.perf_counter()
        self._worker.drain()
        with self._stats_lock:
            self._stats["adam_exposed_s"] += time.perf_counter() - t0

    def wait_grads(self) -> None:
        """Wait until every submitted gradient has landed (D2H done, accumulated, norms known).

        Updates already queued (eager ones) may still be running: loads wait for them per unit.
        """
        if not self.overlap:
            return self.flush()
        t0 = time.perf_counter()
        self._worker.wait_grads()
        with self._stats_lock:  # mostly the GPU finishing backward: not CPU Adam time
            self._stats["grad_wait_s"] += time.perf_counter() - t0

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
        unit.version += 1  # bumped now, on the main thread: slots holding the old weights are stale
        if unit.device_state is not None:  # on the device, now (enqueued on the compute stream)
            return self.device_state.update(unit, items, scale, entries=entries, zero_grads=zero_grads)
        self._submit_adam(unit, items, scale, entries=entries, zero_grads=zero_grads)

    # ------------------------------------------------------------------ metrics
    def stats(self) -> dict:
        """Cumulative counters (bytes, seconds) since the engine was built; diff two calls for a window.

        Keys: ``h2d_bytes``, ``d2h_bytes`` (bytes copied), ``h2d_time_s``, ``d2h_time_s`` (time the
        copies took on their streams), ``adam_time_s`` (CPU Adam), ``grad_accum_time_s``,
        ``adam_exposed_s`` (time the main thread waited for CPU updates), ``grad_wait_s`` (time
        ``step()`` waited for the last gradients to land: mostly the GPU finishing backward), ``slot_hits``,
        ``h2d_copies``, ``host_store_bytes``, ``pinned_bytes``, ``bytes_per_param``, ``num_params``,
        ``streamed_layers`` (layers whose weights stream), ``device_state_layers``,
        ``device_state_bytes`` (device bytes of their training state). Reading the copy times waits for the copies already issued.
        """
        self._collect_copy_times()
        with self._stats_lock:
            out = dict(self._stats)
        out.update(
            h2d_time_s=self._h2d_time_s,
            d2h_time_s=self._d2h_time_s,
            host_store_bytes=int(self.store.total_bytes),
            pinned_bytes=int(self.store.pinned_bytes),
            bytes_per_param=float(self.store.bytes_per_param),
            num_params=int(self.store.total_numel),
            streamed_layers=len(self.layers) - (len(self.device_state.units) if self.device_state else 0),
            device_state_layers=len(self.device_state.units) if self.device_state else 0,
            device_state_bytes=self.device_state.nbytes if self.device_state else 0,
        )
        return out

    def _collect_copy_times(self) -> None:
        for kind, start, end in self._timed_copies:
            end.synchronize()
            ms = start.elapsed_time(end)
            if kind == "h2d":
                self._h2d_time_s += ms / 1e3
            else:
                self._d2h_time_s += ms / 1e3
        self._timed_copies.clear()

    def close(self) -> None:
        self._worker.close()


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


def run_adam(eng: "Engine", unit: Unit, items, scale: float, grad_src=None) -> None:
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
