"""``DataParallelEngine``: the engine's gradient, update and wait methods for a data parallel run.

:func:`attach` turns a built engine (``Engine.dp`` set) into its data parallel form: the class
gets :class:`DataParallelEngine` mixed in before it, the units :class:`DataParallelUnit`, and the
CPU worker a counter of update tasks per unit (:class:`_CountingWorker`).
"""

from __future__ import annotations

import weakref
from typing import List, Optional

import torch

from .group import DataParallel


class _CountingWorker:
    """The engine's worker, counting each update task per unit and bumping this rank's shared counter after it.

    Every update task (``submit_adam``: an AdamW of this rank's pieces, or the weights back of
    ``zero_grad``) is followed by a small task gated on it that bumps the rank's counter of the unit
    (:meth:`DataParallel.bump`); the peers' loads of the unit wait for it (:meth:`DataParallel.wait_peers`).
    """

    def __init__(self, inner, dp: DataParallel):
        self._inner = inner
        self._dp = dp

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def submit_adam(self, ledger, unit: int, items, grad_scale, restore, ledger_entries, finite_from,
                    restore_on_skip, klass, key, ready=None):
        handle, outcome = self._inner.submit_adam(ledger, unit, items, grad_scale, restore, ledger_entries,
                                                  finite_from, restore_on_skip, klass, key, ready)
        dp = self._dp
        dp.gen[unit] += 1
        self._inner.submit(lambda: dp.bump(unit), klass, key, ready=handle)
        return handle, outcome


def engine_class(cls: type) -> type:
    """The data parallel form of engine class ``cls`` (:class:`DataParallelEngine` placed before it)."""
    return type(f"DataParallel{cls.__name__}", (DataParallelEngine, cls), {"__module__": cls.__module__})


def unit_class(cls: type) -> type:
    """The data parallel form of unit class ``cls``: ``grad_sq`` is the global one after the last all-reduce."""
    return type(f"DataParallel{cls.__name__}", (DataParallelUnit, cls), {"__module__": cls.__module__})


class DataParallelUnit:
    """``grad_sq``: the per-entry squared norms over every rank's piece (set by ``wait_grads``'s all-reduce)."""

    _dp_sq: Optional[list] = None

    @property
    def local_grad_sq(self) -> List[float]:
        """Squared norms of this rank's pieces (the ledger's)."""
        return super().grad_sq

    @property
    def grad_sq(self) -> List[float]:
        return list(self._dp_sq) if self._dp_sq is not None else self.local_grad_sq


def attach(eng) -> None:
    """Make engine ``eng`` (built with ``eng.dp``) data parallel: its class, its units' class, its worker."""
    eng.dp.init_control(len(eng.units))
    eng.eager_updates = False
    eng.__class__ = engine_class(type(eng))
    for u in eng.units:
        u.__class__ = unit_class(type(u))
    eng._worker = _CountingWorker(eng._worker, eng.dp)
    ref = weakref.ref(eng)
    eng.dp.steps = lambda: getattr(getattr(ref(), "optimizer", None), "steps_called", None)  # for error messages


class DataParallelEngine:
    """Overrides of the engine's gradient, update and wait methods for a data parallel run.

    Mixed in before the engine class (:func:`engine_class`) when ``Engine.dp`` is set; every method
    keeps the signature and contract of the one it replaces (see :mod:`.grads`, :mod:`.slots`),
    acting on this rank's pieces of the shared store (the C++ tasks take the pieces as views:
    ``task_view``, which the engine's update, move and weights-back tasks read through).
    """

    dp: DataParallel

    # --------------------------------------------------------------- device-state layers: refused
    def init_device_state(self, layers) -> int:
        if layers in (0, "auto", "boundary", None):
            return 0
        raise ValueError(f"megatrain.wrap: device_state_layers={layers} is not supported with data parallel "
                         "(torch.distributed) yet; use device_state_layers=0")

    # --------------------------------------------------------------- accumulator
    def enable_accumulator(self) -> None:
        if self.accumulator_mode is False:
            super().enable_accumulator()  # raises its error
        # pieces only, allocated at the first gradient that needs summing (DataParallel.accumulator)

    @property
    def accumulator_allocated(self) -> bool:
        return self.accumulator_mode is True or self.dp._acc is not None

    def accumulator_bytes(self) -> int:
        if self.accumulator_mode is True:
            return super().accumulator_bytes()
        return self.dp.accumulator_bytes()

    # --------------------------------------------------------------- piece views
    def task_view(self, unit, i: int, name: str) -> torch.Tensor:
        """This rank's piece of entry ``i`` in section ``name`` (``grad_accum``: its accumulator piece)."""
        if name == "grad_accum":
            return self.dp.accumulator(self, unit, i)
        e = unit.entries[i]
        lo, n = self.dp.piece(e.numel)
        base = e.offset if name == "compute" else e.state_offset
        return self.section(unit, name)[base + lo:base + lo + n]

    # --------------------------------------------------------------- gradients
    def submit_grads(self, unit, grads, staging=None):
        self.settle()
        opt = self.optimizer
        if opt is None:
            return super().submit_grads(unit, grads, staging)  # raises: no CPUAdamW
        from ..engine.grads import _graph_task_id, grad_norms, in_compute

        dp = self.dp
        dp.reclaim()
        task_id = _graph_task_id()
        if unit.kind == "layer":  # every rank hands over the same entries
            idx = [i for i, e in enumerate(unit.entries) if not e.frozen and e.param.requires_grad]
        else:
            idx = [i for i, g in enumerate(grads) if g is not None]
        if not idx:
            return None
        L = dp.local_world
        ref = next(g for g in grads if g is not None)
        dtype, dev = ref.dtype, ref.device
        cols, sizes = [], []
        with torch.no_grad():
            for i in idx:
                e, g = unit.entries[i], grads[i]
                c = -(-e.numel // L)
                sizes.append(c)
                if g is None:
                    cols.append(torch.zeros(L, c, dtype=dtype, device=dev))
                else:
                    flat = g.reshape(-1).to(dtype)
                    if L * c != e.numel:
                        flat = torch.nn.functional.pad(flat, (0, L * c - e.numel))
                    cols.append(flat.view(L, c))
            flags = torch.tensor([[0.0 if grads[i] is None else 1.0 for i in idx]], dtype=dtype, device=dev)
            mat = torch.cat(cols + [flags.expand(L, -1)], dim=1)
            out = dp.reduce_pieces(mat)
            data_len = sum(sizes)
            out[:data_len].mul_(1.0 / dp.world)  # the mean over the global batch, as DDP
            present_of = dict(zip(idx, (out[data_len:] > 0).tolist()))
        present = [present_of.get(i, False) for i in range(len(unit.entries))]
        states = unit.grad_states()
        ga_one = getattr(opt, "gradient_accumulation_steps", 1) == 1
        direct = [p and ga_one and s.micro_batches == 0 for p, s in zip(present, states)]
        staged = [p and not d for p, d in zip(present, direct)]
        if not self.has_accumulator and any(staged):
            raise RuntimeError(
                "megatrain: a second backward pass before optimizer.step() (gradient accumulation), but the model "
                "was wrapped with grad_accumulator=False: call step() after every backward, or wrap with "
                "grad_accumulator=None (the default)")
        if any(in_compute(s) and p for p, s in zip(present, states)):
            self.ensure_weights(unit)  # a second gradient: the first one moves to the fp32 accumulator
        unit.last_task = task_id
        overwrite = [self.ledger.begin_d2h(unit.index, i, direct[i]) if p else False for i, p in enumerate(present)]
        pieces = {}  # entry -> (offset in out, this rank's piece length)
        off = 0
        for i, c in zip(idx, sizes):
            pieces[i] = (off, dp.piece(unit.entries[i].numel)[1])
            off += c
        norm_idx = [i for i in pieces if direct[i]]
        with torch.no_grad():
            dev_norms = (grad_norms([out[pieces[i][0]:pieces[i][0] + pieces[i][1]] for i in norm_idx],
                                    self.fused_grad_norms) if norm_idx else None)
        ev = None
        host = out
        norms = dev_norms
        nbytes = 0
        if self.cuda:
            backward_done = torch.cuda.Event()
            backward_done.record(self.compute_stream())
            with torch.cuda.stream(self.d2h_stream):
                self.d2h_stream.wait_event(backward_done)
                if any(staged):
                    host = dp.pinned(data_len, dtype)
                    host.copy_(out[:data_len], non_blocking=True)
                    nbytes += data_len * out.element_size()
                for i in norm_idx:
                    o, n = pieces[i]
                    if n:
                        self.task_view(unit, i, "compute").copy_(out[o:o + n], non_blocking=True)
                        nbytes += n * out.element_size()
                if dev_norms is not None:
                    norms = torch.empty(dev_norms.shape, dtype=torch.float64, pin_memory=True)
                    norms.copy_(dev_norms, non_blocking=True)
                    dev_norms.record_stream(self.d2h_stream)
                out.record_stream(self.d2h_stream)
            ev = self.d2h_done_torch()
        else:
            for i in norm_idx:
                o, n = pieces[i]
                if n:
                    self.task_view(unit, i, "compute").copy_(out[o:o + n])
                    nbytes += n * out.element_size()
        self._stats["d2h_bytes"] += nbytes
        dp.dirty = True
        direct_grads = [(i, norms, k) for k, i in enumerate(norm_idx)]
        staged_grads = [(i, self.task_view(unit, i, "grad_accum"), host[pieces[i][0]:pieces[i][0] + pieces[i][1]],
                         overwrite[i]) for i in pieces if staged[i]]
        handle, outcome = self._worker.submit_accumulate(self.ledger, unit.index, direct_grads, staged_grads, ready=ev)
        unit.grad_task = handle
        with self._settle_lock:
            self._grad_outcomes.append((handle, outcome, None, unit.index))
        if self.cuda and any(staged):
            dp._in_flight.append((handle, host))
        return handle

    def wait_grads(self) -> None:
        """Wait for this rank's gradients, then all-reduce every entry's squared norm over the node's pieces."""
        super().wait_grads()
        self.settle()
        dp = self.dp
        if not dp.dirty:
            return
        dp.dirty = False
        local = [u.local_grad_sq for u in self.units]
        vec = torch.tensor([x for row in local for x in row] or [0.0], dtype=torch.float64)
        vec = dp.all_reduce_node(vec, "the gradient norm all-reduce").tolist()
        k = 0
        for u, row in zip(self.units, local):
            u._dp_sq = vec[k:k + len(row)]
            k += len(row)

    def zero_grad(self) -> None:
        super().zero_grad()
        for u in self.units:
            u._dp_sq = None

    # --------------------------------------------------------------- waits
    def wait_update(self, unit) -> None:
        super().wait_update(unit)
        self.dp.wait_peers(unit.index)

    def flush(self) -> None:
        super().flush()
        for u in self.units:
            self.dp.wait_peers(u.index)
