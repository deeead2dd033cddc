"""The disk tier at run time: :class:`DiskOffload` (``Engine.disk``), the owner of a wrapped model's
``_C.DiskTier`` s.

Which layers keep their fp32 state on disk is chosen before anything is allocated
(:func:`~.disk_plan.plan_offload`); this module opens the tiers that plan names and gives the
worker's tasks and the main thread their access to them (see :mod:`.disk_plan` and
docs/disk_tier.md). ``STATE_SECTIONS`` and ``ACCUM_DIR`` are the tiers' layout: the sections of a
unit's state file, and the accumulators' directory under ``offload_dir``.
"""

from __future__ import annotations

import atexit
import os
import weakref
from typing import Dict

import torch

from ..._loader import load_extension
from .host_memory import check_host_budget
from .offload_plan import OffloadPlan
from .unit_window import OneUnitWindow

_C = load_extension()

STATE_SECTIONS = ("master", "exp_avg", "exp_avg_sq")
ACCUM_DIR = "grad_accum"


_LIVE: "weakref.WeakSet[DiskOffload]" = weakref.WeakSet()


@atexit.register
def _close_tiers() -> None:
    # The interpreter does not promise to finalize the engines at exit: close the tiers (their
    # destructors remove the working files) once the workers have run what was queued.
    for d in list(_LIVE):
        try:
            d.eng.worker.close()
            d.close()
        except Exception:  # noqa: BLE001 - at exit: a failed tier leaves its files (the next run removes them)
            pass


class DiskOffload(OneUnitWindow):
    """The disk tiers of an engine (``Engine.disk``): the fp32 state, and the accumulators, of its disk units.

    Thread use: the CPU worker acquires units inside its tasks (no GIL); the main thread prefetches
    (any time) and opens :meth:`window` s only when the worker has no task touching the unit (the
    window drains the worker first). The tiers' own calls are thread-safe (one lock each,
    ``csrc/megatrain/disk_tier/disk_tier.h``).

    Args:
        eng: the engine (its ``units`` and ``store``).
        plan: :func:`plan_offload`'s result with at least one disk unit.
        io_threads: pread / pwrite threads per tier.
        fault: tests only: ``_C.DiskTier``'s ``_fault`` for both tiers.

    Raises:
        DiskSpaceError, DiskTierError, ValueError: from ``_C.DiskTier`` (a directory in use, stale
            files of another kind, free space gone since the plan); nothing is left behind.
    """

    tier_name = "disk-tier"

    def __init__(self, eng, plan: OffloadPlan, io_threads: int = 4, fault=None):
        self.eng = eng
        self.plan = plan
        self.dir = plan.offload_dir
        self.units = [eng.units[i] for i in plan.disk_units]
        self.num_buffers = max(1, plan.num_buffers)
        self.io_threads = io_threads
        self._fault = fault
        self.tier = self._open(self.dir, plan.state_layouts)
        for k, u in enumerate(self.units):
            u.disk = k
        _LIVE.add(self)
        self.accum = None  # the accumulators' tier (enable_accumulator)
        self._held = None  # the main thread's window: (tier unit, write) of the unit it holds
        self._init_window()
        self._update_seq = 0
        self._queued = set()  # tier units whose update was queued since the last forward started

    def _open(self, path: str, layouts) -> "_C.DiskTier":
        # The engine counted the pool in its own budget check: the tier's check gets its size as the limit.
        kw = dict(num_buffers=self.num_buffers, io_threads=self.io_threads,
                  memory_limit_bytes=_C.DiskTier.pool_bytes(layouts, self.num_buffers), _fault=self._fault)
        try:
            return _C.DiskTier(path, layouts, **kw)
        except _C.DiskTierError as e:
            if "in use" not in str(e):
                raise
            import gc

            gc.collect()  # a model wrapped earlier in this process and dropped may still hold the directory
            try:
                return _C.DiskTier(path, layouts, **kw)
            except _C.DiskTierError as again:
                if "in use" not in str(again):
                    raise
                raise _C.DiskTierError(f"{again} (A model wrapped in this process with this offload_dir is still "
                                       "alive: call its model.megatrain.close() first.)") from None

    # ------------------------------------------------------------------ accumulator
    def enable_accumulator(self) -> None:
        """Create the accumulators' tier (``offload_dir/grad_accum``; no-op when it exists).

        Raises:
            DiskSpaceError / HostMemoryError: no room for its files / its RAM pool (nothing created).
        """
        if self.accum is not None:
            return
        path = os.path.join(self.dir, ACCUM_DIR)
        if not self.plan.with_accumulator:  # not counted by the plan at wrap time: check its pool now
            check_host_budget(_C.DiskTier.pool_bytes(self.plan.accum_layouts, self.num_buffers), 0,
                              "disk tier accumulator buffers")
        self.accum = self._open(path, self.plan.accum_layouts)

    # ------------------------------------------------------------------ worker-task arguments
    def adam_args(self, unit, items, entries, zero, direct, compute_view) -> tuple:
        """``(tier_items, restore_tier, restore_on_skip_tier, kwargs)`` of ``_C.Worker.submit_adam`` for
        disk unit ``unit``: what ``UpdateQueue.submit_adam`` builds from store views for a host unit,
        by element offset into the tier unit (``compute_view(i)``: entry i's flat compute slice)."""
        updated = {it[0] for it in items}
        tier_items, accum = [], False
        for i, lr, b1, b2, eps, wd, step in items:
            e = unit.entries[i]
            if i in zero:
                grad = torch.zeros(e.numel, dtype=torch.float32)
            elif direct[i]:
                grad = compute_view(i)
            else:
                grad, accum = None, True  # the accumulator on disk
            tier_items.append((i, e.state_offset, grad, compute_view(i), lr, b1, b2, eps, wd, step))
        restore = [(unit.entries[i].state_offset, compute_view(i)) for i in entries if direct[i] and i not in updated]
        on_skip = [(unit.entries[i].state_offset, compute_view(i)) for i in entries if direct[i]]
        if accum and self.accum is None:
            raise RuntimeError(f"megatrain: unit {unit.index} has an accumulated gradient but no accumulator tier")
        return tier_items, restore, on_skip, self.state_args(unit, accum=accum)

    def state_args(self, unit, accum: bool = False) -> dict:
        """Keyword arguments of ``_C.Worker.submit_*`` naming ``unit``'s state (and accumulator) on disk."""
        kw = dict(state_tier=self.tier, state_unit=unit.disk)
        if accum:
            kw.update(accum_tier=self.accum, accum_unit=unit.disk)
        return kw

    def update_key(self, unit) -> int:
        """Worker key of a disk unit's update: after every host-stored unit's, in submission order among the
        disk units (so their reads, issued ahead in that order, are the ones the worker waits for next)."""
        self._update_seq += 1
        self._queued.add(unit.disk)
        return len(self.eng.units) + self._update_seq

    # ------------------------------------------------------------------ read-ahead
    def prefetch(self, units, accum: bool = False) -> None:
        """Start reading the disk units among ``units`` (in this order) into the pool (non-blocking hints).

        At most ``num_buffers`` are issued: more would only queue behind the reads the worker waits for.
        """
        tier = self.accum if accum else self.tier
        if tier is None:
            return
        n = 0
        for u in units:
            if u is None or u.disk is None:
                continue
            try:
                tier.prefetch(u.disk)
            except _C.DiskTierError:
                return  # sticky: the next task's acquire (or check()) raises it where it is handled
            n += 1
            if n >= self.num_buffers:
                break

    def below(self, unit, n: int) -> list:
        """``unit`` (if on disk) and the disk units below it, deepest first, at most ``n``."""
        return [u for u in reversed(self.units) if u.index <= unit.index][:n]

    def updates_pending(self) -> bool:
        """Some disk unit's update task has not run yet (main thread's view)."""
        return any(not h.done for u in self.units for h in u.update_tasks)

    def on_grads(self, unit, eager: bool, accum_read: bool) -> None:
        """Read-ahead when backward hands over ``unit``'s gradients (thread running backward).

        ``eager``: updates start during backward (no clipping), one per layer as backward goes
        down: the state of ``unit`` and of the disk units below it is read. Otherwise the updates
        wait for ``step()``, which queues them in forward order: the lowest disk units are read.
        ``accum_read``: a gradient of a disk unit is summed into an accumulator it must read.

        Never reads a unit whose update this step already queued (since the last forward started):
        the resident unit's last hand-over (the embedding's, after every layer's) would otherwise read
        the deepest units again, for the next step, while this step's last updates still wait for
        the disk (a second read of them in the step, still in flight when its updates are done).
        The next step's first reads are :meth:`on_forward`'s.
        """
        ahead = self.below(unit, len(self.units)) if eager else self.units
        self.prefetch([u for u in ahead if u.disk not in self._queued][:self.num_buffers])
        if accum_read and unit.disk is not None:
            self.prefetch([unit], accum=True)

    def on_forward(self, eager: bool) -> None:
        """A forward starts or reaches a disk layer: with eager updates, read the deepest disk units (the
        first updated in the coming backward) unless updates of the last step still wait for the disk.
        A new step's updates start after this: :meth:`on_grads` may read every unit ahead again."""
        self._queued.clear()
        if eager and not self.updates_pending():
            self.prefetch(list(reversed(self.units)))

    # ------------------------------------------------------------------ main-thread access
    def _before_window(self) -> None:
        """No task may hold a unit the main thread acquires: the CPU worker is drained before a window
        (:meth:`~.unit_window.OneUnitWindow.window`; a :meth:`view` of another unit releases the one
        held, dirty when the window writes).

        Raises:
            RuntimeError: the tier was closed (:meth:`close`): its units' state is gone."""
        if self.tier is None:
            raise RuntimeError("megatrain: this model was closed (model.megatrain.close()): the state of its disk-tier "
                               "layers is gone; load the last checkpoint into a newly wrapped model")
        self.eng.worker.drain()

    def _release_held(self, run_callback: bool = True) -> None:
        held = self._held
        if held is None:
            return
        if run_callback and held[1] and self._on_release is not None:
            self._on_release(self.units[held[0]])
        self._held = None
        self.tier.release(held[0], held[1])

    def _acquire(self, unit) -> None:
        if self._held is not None and self._held[0] == unit.disk:
            return
        self._release_held()
        self.tier.acquire(unit.disk)
        self._held = (unit.disk, bool(self._window_write))

    def section(self, unit, name: str) -> torch.Tensor:
        """Flat fp32 view of section ``name`` (master / exp_avg / exp_avg_sq) of disk unit ``unit`` (in a window)."""
        if self._window_write is None:
            raise RuntimeError(f"megatrain: the {name} of unit {unit.index} is in the disk tier (offload_dir); read it "
                               "through the engine's state accessors (checkpoint, state_dict, optimizer.state)")
        if name not in STATE_SECTIONS:
            raise ValueError(f"megatrain: the disk tier holds {', '.join(STATE_SECTIONS)} of unit {unit.index}, not {name}")
        self._acquire(unit)
        return self.tier.section_tensor(unit.disk, STATE_SECTIONS.index(name))[:unit.state_numel]

    def view(self, unit, i: int, name: str) -> torch.Tensor:
        """Shaped fp32 view of entry ``i`` of disk unit ``unit`` in section ``name`` (in a window)."""
        e = unit.entries[i]
        if e.state_offset < 0:
            raise ValueError(f"megatrain: entry {e.name} is frozen: it has no {name}")
        return self.section(unit, name)[e.state_offset:e.state_offset + e.numel].view(e.shape)

    def read(self, unit, i: int, name: str) -> torch.Tensor:
        """A CPU copy of entry ``i`` of disk unit ``unit`` in ``name`` (waits for the worker)."""
        with self.window(write=False):
            return self.view(unit, i, name).clone()

    def write(self, unit, values: Dict[tuple, torch.Tensor]) -> None:
        """Copy ``{(entry index, section name): tensor}`` into disk unit ``unit`` (one acquire, released dirty)."""
        with self.window(write=True):
            for (i, name), v in values.items():
                self.view(unit, i, name).copy_(v)

    # ------------------------------------------------------------------ counters
    def stats(self) -> dict:
        """The tiers' counters summed (``_C.DiskTier.stats()``): bytes, units, seconds; ``disk_units``, ``direct_io``."""
        out: Dict[str, float] = {}
        for t in (self.tier, self.accum):
            if t is None:
                continue
            for k, v in t.stats().items():
                out[k] = out.get(k, 0) + v
        out["disk_units"] = len(self.units)
        out["direct_io"] = bool(self.tier.direct_io) if self.tier is not None else None
        return out

    def close(self) -> None:
        """Drop the tiers (their files are removed once nothing holds them). Call after the worker is closed:
        the engine cannot train afterwards (its disk units' state is gone; the checkpoint is what lasts)."""
        self.tier = None
        self.accum = None

    def check(self) -> None:
        """Raise the tiers' sticky ``DiskTierError`` if an I/O failed (a write behind included); never blocks."""
        for t in (self.tier, self.accum):
            if t is not None:
                t.check()

    def flush(self) -> None:
        """Wait for the tiers' writes (fdatasync); raises the tier's sticky error if one failed."""
        for t in (self.tier, self.accum):
            if t is not None:
                t.flush()
