"""``DataParallelStrategy``: the engine's sharding strategy for a data parallel run.

An :class:`~megatrain.runtime.engine.core.Engine` built while a ``torch.distributed`` group is
initialised (``Engine.dp`` set) is given a :class:`DataParallelStrategy` instead of
:class:`~megatrain.runtime.engine.sharding.SingleProcess`; the engine's parts call its hooks: the
gradients of a layer are reduce-scattered and this rank's pieces handed over (``submit_grads``), the
CPU tasks read and write those pieces (``task_view``, the accumulator pieces), ``wait_grads``
all-reduces the per-entry squared norms, ``wait_update`` / ``flush`` also wait for the peers' updates,
and the CPU worker counts each unit's update tasks (:class:`_CountingWorker`).
"""

from __future__ import annotations

import weakref
from typing import List, Optional

import torch

from ..engine.grads import _graph_task_id, grad_norms, in_compute
from ..engine.sharding import SingleProcess
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


class DataParallelStrategy(SingleProcess):
    """The hooks of a data parallel engine, acting on this rank's pieces of the shared store.

    Every hook keeps the contract of the engine method it serves (see :mod:`..engine.grads`,
    :mod:`..engine.waits`); the C++ tasks take the pieces as views (``task_view``, which the engine's
    update, move and weights-back tasks read through). Updates never start during backward, and
    device-state layers are refused.

    Args:
        dp: the :class:`DataParallel` group of this rank.
    """

    reduces_grads = True
    allows_eager_updates = False

    def __init__(self, dp: DataParallel):
        self.dp = dp
        self.piece_accumulator = dp
        self.eng = None

    def bind(self, engine) -> None:
        """The engine is built: its control block, and the step count for error messages."""
        self.eng = engine
        self.dp.init_control(len(engine.units))
        ref = weakref.ref(engine)
        self.dp.steps = lambda: getattr(getattr(ref(), "optimizer", None), "steps_called", None)  # for error messages

    def wrap_worker(self, worker):
        """The worker, counting each unit's update tasks (:class:`_CountingWorker`)."""
        return _CountingWorker(worker, self.dp)

    def check_device_state(self, layers) -> Optional[int]:
        """0 for no device-state layers (``"auto"`` / ``"boundary"`` choose none).

        Raises:
            ValueError: ``layers`` > 0.
        """
        if layers in (0, "auto", "boundary", None):
            return 0
        raise ValueError(f"megatrain.wrap: device_state_layers={layers} is not supported with data parallel "
                         "(torch.distributed) yet; use device_state_layers=0")

    def task_view(self, views, unit, i: int, name: str) -> torch.Tensor:
        """This rank's piece of entry ``i`` in section ``name`` (``grad_accum``: its accumulator piece)."""
        if name == "grad_accum":
            return self.dp.accumulator(self.eng, unit, i)
        e = unit.entries[i]
        lo, n = self.dp.piece(e.numel)
        base = e.offset if name == "compute" else e.state_offset
        return views.section(unit, name)[base + lo:base + lo + n]

    # --------------------------------------------------------------- gradients
    def submit_grads(self, unit, grads, opt):
        """Reduce-scatter ``unit``'s gradients over the ranks, then hand this rank's pieces to D2H + the worker.

        Every rank hands over the same entries of a layer (zeros where it has no gradient). Returns
        the gradient task's handle, or None when no entry has a gradient.
        """
        eng = self.eng
        self.dp.reclaim()
        task_id = _graph_task_id()
        if unit.kind == "layer":  # every rank hands over the same entries
            idx = [i for i, e in enumerate(unit.entries) if not e.frozen and e.param.requires_grad]
        else:
            idx = [i for i, g in enumerate(grads) if g is not None]
        if not idx:
            return None
        out, sizes, present = self._reduce(unit, grads, idx)
        direct, staged = self._where_pieces_land(unit, present, opt)
        unit.last_task = task_id
        overwrite = [eng.ledger.begin_d2h(unit.index, i, direct[i]) if p else False for i, p in enumerate(present)]
        pieces = {}  # entry -> (offset in out, this rank's piece length)
        off = 0
        for i, c in zip(idx, sizes):
            pieces[i] = (off, self.dp.piece(unit.entries[i].numel)[1])
            off += c
        norm_idx = [i for i in pieces if direct[i]]
        with torch.no_grad():
            dev_norms = (grad_norms([out[pieces[i][0]:pieces[i][0] + pieces[i][1]] for i in norm_idx],
                                    eng.fused_grad_norms) if norm_idx else None)
        host, norms, ev = self._copy_pieces(unit, out, sum(sizes), pieces, norm_idx, dev_norms, any(staged))
        direct_grads = [(i, norms, k) for k, i in enumerate(norm_idx)]
        staged_grads = [(i, eng.task_view(unit, i, "grad_accum"), host[pieces[i][0]:pieces[i][0] + pieces[i][1]],
                         overwrite[i]) for i in pieces if staged[i]]
        handle, outcome = eng.worker.submit_accumulate(eng.ledger, unit.index, direct_grads, staged_grads, ready=ev)
        unit.grad_task = handle
        eng.grads.record_grad(handle, outcome, None, unit.index)
        if eng.cuda and any(staged):
            self.dp.hold_staging(handle, host)
        return handle

    def _reduce(self, unit, grads, idx: List[int]):
        """``(out, sizes, present)``: the reduce-scatter of the entries ``idx`` (this rank's pieces, then one
        flag per entry: whether any rank had a gradient), averaged over the world; each entry's padded
        piece length; per entry of ``unit``, whether it got a gradient."""
        dp = self.dp
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
        return out, sizes, present

    def _where_pieces_land(self, unit, present: List[bool], opt):
        """``(direct, staged)`` per entry (as the engine's own hand-over); raises before anything changes
        without an accumulator for a staged piece."""
        eng = self.eng
        states = unit.grad_states()
        ga_one = getattr(opt, "gradient_accumulation_steps", 1) == 1
        direct = [p and ga_one and s.micro_batches == 0 for p, s in zip(present, states)]
        staged = [p and not d for p, d in zip(present, direct)]
        if not eng.has_accumulator and any(staged):
            raise RuntimeError(
                "megatrain: a second backward pass before optimizer.step() (gradient accumulation), but the model "
                "was wrapped with grad_accumulator=False: call step() after every backward, or wrap with "
                "grad_accumulator=None (the default)")
        if any(in_compute(s) and p for p, s in zip(present, states)):
            eng.ensure_weights(unit)  # a second gradient: the first one moves to the fp32 accumulator
        return direct, staged

    def _copy_pieces(self, unit, out, data_len: int, pieces: dict, norm_idx: List[int], dev_norms, any_staged: bool):
        """``(host, norms, ready)``: this rank's pieces copied D2H (direct ones into the compute section, staged
        ones into ``host``, a pinned buffer on CUDA), the norms on the host, and the copies' done event."""
        eng, dp = self.eng, self.dp
        ev = None
        host = out
        norms = dev_norms
        nbytes = 0
        if eng.cuda:
            d2h_stream = eng.d2h_stream
            backward_done = torch.cuda.Event()
            backward_done.record(eng.compute_stream())
            with torch.cuda.stream(d2h_stream):
                d2h_stream.wait_event(backward_done)
                if any_staged:
                    host = dp.pinned(data_len, out.dtype)
                    host.copy_(out[:data_len], non_blocking=True)
                    nbytes += data_len * out.element_size()
                for i in norm_idx:
                    o, n = pieces[i]
                    if n:
                        eng.task_view(unit, i, "compute").copy_(out[o:o + n], non_blocking=True)
                        nbytes += n * out.element_size()
                if dev_norms is not None:
                    norms = torch.empty(dev_norms.shape, dtype=torch.float64, pin_memory=True)
                    norms.copy_(dev_norms, non_blocking=True)
                    dev_norms.record_stream(d2h_stream)
                out.record_stream(d2h_stream)
            ev = eng.d2h_done_torch()
        else:
            for i in norm_idx:
                o, n = pieces[i]
                if n:
                    eng.task_view(unit, i, "compute").copy_(out[o:o + n])
                    nbytes += n * out.element_size()
        eng.counters.add("d2h_bytes", nbytes)
        dp.dirty = True
        return host, norms, ev

    # --------------------------------------------------------------- norms and waits
    def after_wait_grads(self, units) -> None:
        """All-reduce every entry's squared norm over the node's pieces (once per window of gradients)."""
        self.eng.settle()
        dp = self.dp
        if not dp.dirty:
            return
        dp.dirty = False
        local = [u.local_grad_sq for u in units]
        vec = torch.tensor([x for row in local for x in row] or [0.0], dtype=torch.float64)
        vec = dp.all_reduce_node(vec, "the gradient norm all-reduce").tolist()
        k = 0
        for u, row in zip(units, local):
            u.set_reduced_grad_sq(vec[k:k + len(row)])
            k += len(row)

    def after_zero_grad(self, units) -> None:
        """Forget the all-reduced norms."""
        for u in units:
            u.set_reduced_grad_sq(None)

    def after_wait_update(self, unit) -> None:
        """Wait for the peers' updates of ``unit`` too."""
        self.dp.wait_peers(unit.index)

    def after_flush(self, units) -> None:
        """Wait for the peers' updates of every unit too."""
        for u in units:
            self.dp.wait_peers(u.index)
