"""Data parallel training over ``torch.distributed``: one shared host store per node, sharded updates.

Launch N ranks (``torchrun --nproc-per-node N``, one GPU each; on CPU N processes with the gloo
backend) and initialise the default process group before ``megatrain.wrap`` / ``from_pretrained``
/ ``from_config``: the engine then becomes data parallel (``MEGATRAIN_DATA_PARALLEL=0`` opts out).

* **One host store per node.** Local rank 0 creates the arena as a ``memfd`` (anonymous shared
  memory, freed when the last process unmaps it: a dead job leaks nothing), the other local ranks
  open it through ``/proc/<pid>/fd/<n>`` and map the same pages (``MAP_SHARED``; on CUDA each rank
  page-locks its mapping). Host memory does not grow with the number of ranks; the compute copy
  one rank's update writes is what every rank streams next (no gather).
* **Sharded gradients and updates.** Each entry (parameter) of a unit is split into
  ``LOCAL_WORLD_SIZE`` contiguous pieces; local rank ``l`` owns piece ``l`` of every entry. After a
  layer's backward its gradients are reduce-scattered (``torch.distributed.reduce_scatter``: NCCL
  on the device, gloo on the CPU; across nodes a reduce-scatter within the node, then an
  all-reduce of the piece between the ranks of the same local index) and averaged over the world
  (the gradient of the mean loss over the global batch, as DDP); each rank copies only its piece
  D2H, accumulates it, and runs the fused CPU AdamW on only its piece of the shared store.
* **Clipping and the non-finite check.** ``wait_grads()`` (``optimizer.step()``,
  ``clip_grad_norm_``) all-reduces each entry's squared norm over the node's pieces, so every rank
  sees the global per-entry norms: the clip coefficient, the skip decision and the step counts are
  the same on every rank.
* **Who waits for what.** Each rank counts the update tasks it queued per unit; its CPU worker
  bumps the rank's counter of the unit in a small shared control block once the task ran. A load
  of a unit waits until every local rank's counter reached its own count (polling, with a
  liveness check of the peers' processes and a timeout, ``MEGATRAIN_DP_TIMEOUT`` seconds, default
  300), so a dead peer never hangs anyone.

Not supported with data parallel (refused): ``device_state_layers`` > 0. Updates never start
during backward (as with clipping): each layer's update is queued by ``step()``.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from typing import List, Optional

import torch

from .._loader import load_extension
from .options import ENV, options

_C = load_extension()

ENV_TIMEOUT = ENV["dp_timeout_s"]  # named in the timeout's error message


class DataParallelError(RuntimeError):
    """A collective or a wait between data parallel ranks failed (a rank died or timed out)."""


def _dist():
    import torch.distributed as dist

    return dist


def active() -> bool:
    """Whether a wrap now would be data parallel (an initialised process group of > 1 ranks, not switched off)."""
    if not options().data_parallel:
        return False
    dist = _dist()
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def detect(device: torch.device) -> Optional["DataParallel"]:
    """A :class:`DataParallel` for the default process group, or None (no group, one rank, or switched off)."""
    return DataParallel(device) if active() else None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class DataParallel:
    """Ranks, pieces, collectives and the shared control block of a data parallel engine.

    Args:
        device: the engine's compute device (collectives run on it: NCCL needs CUDA tensors).

    Raises:
        ValueError: the ranks are not laid out node by node (``RANK // LOCAL_WORLD_SIZE`` is the
            node), or the backend does not fit the device (CUDA needs NCCL, CPU needs gloo).
    """

    def __init__(self, device: torch.device):
        dist = _dist()
        self.device = device
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank % self.local_world))
        if self.local_world < 1 or self.world % self.local_world or self.rank % self.local_world != self.local_rank:
            raise ValueError(f"megatrain data parallel: RANK={self.rank}, WORLD_SIZE={self.world}, LOCAL_RANK="
                             f"{self.local_rank}, LOCAL_WORLD_SIZE={self.local_world}: expected the same number of "
                             "ranks on every node, numbered node by node (as torchrun does)")
        self.node = self.rank // self.local_world
        self.nodes = self.world // self.local_world
        backend = str(dist.get_backend()).lower()
        if device.type == "cuda" and "nccl" not in backend:
            raise ValueError(f"megatrain data parallel: the process group's backend is {backend!r} but the model "
                             "trains on CUDA; init_process_group('nccl')")
        if device.type == "cpu" and "gloo" not in backend:
            raise ValueError(f"megatrain data parallel: the process group's backend is {backend!r} but the model "
                             "trains on the CPU; init_process_group('gloo')")
        self.timeout_s = options().dp_timeout_s
        self.node_group = None  # None: the default group (one node)
        self.cross_group = None
        if self.nodes > 1:  # every rank creates every group, in the same order
            for n in range(self.nodes):
                g = dist.new_group(list(range(n * self.local_world, (n + 1) * self.local_world)))
                if n == self.node:
                    self.node_group = g
            for l in range(self.local_world):
                g = dist.new_group(list(range(l, self.world, self.local_world)))
                if l == self.local_rank:
                    self.cross_group = g
        self.gen: List[int] = []  # update tasks this rank queued, per unit
        self.dirty = False  # a gradient was handed over since the last norm all-reduce
        self._ctl = None
        self._acc: Optional[dict] = None  # unit index -> flat fp32 accumulator of this rank's pieces
        self._acc_off: dict = {}  # (unit, entry) -> offset in it
        self._in_flight: list = []  # (gradient task handle, pinned staging buffer) (CUDA)
        self._pinned: dict = {}  # size -> free pinned staging buffers (CUDA)
        self._pinned_lock = threading.Lock()

    # ------------------------------------------------------------------ pieces
    def piece(self, numel: int):
        """``(lo, n)``: this rank's elements ``[lo, lo + n)`` of an entry of ``numel`` elements."""
        c = -(-numel // self.local_world)
        lo = min(self.local_rank * c, numel)
        return lo, min(lo + c, numel) - lo

    @property
    def fills_store(self) -> bool:
        """Local rank 0 writes the store's initial contents (the others map the same pages)."""
        return self.local_rank == 0

    # ------------------------------------------------------------------ collectives
    def _fail(self, what: str, err: BaseException) -> DataParallelError:
        return DataParallelError(
            f"megatrain data parallel (rank {self.rank} of {self.world}): {what} failed ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); another rank probably died or timed out. The job "
            "cannot continue: restart it from the last checkpoint")

    def barrier(self, what: str = "barrier") -> None:
        dist = _dist()
        try:
            if self.device.type == "cuda":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()
        except Exception as e:  # noqa: BLE001 - any backend error means the job is broken
            raise self._fail(what, e) from e

    def all_gather_object(self, obj, what: str):
        dist = _dist()
        out = [None] * self.world
        try:
            dist.all_gather_object(out, obj)
        except Exception as e:  # noqa: BLE001
            raise self._fail(what, e) from e
        return out

    def reduce_pieces(self, mat: torch.Tensor) -> torch.Tensor:
        """Sum row ``local_rank`` of ``mat`` (``(LOCAL_WORLD_SIZE, C)``, on the device) over every rank.

        Returns the ``(C,)`` sum (a reduce-scatter within the node, then an all-reduce across nodes).
        """
        dist = _dist()
        out = torch.empty(mat.shape[1], dtype=mat.dtype, device=mat.device)
        try:
            dist.reduce_scatter(out, list(mat.unbind(0)), group=self.node_group)
            if self.cross_group is not None:
                dist.all_reduce(out, group=self.cross_group)
        except Exception as e:  # noqa: BLE001
            raise self._fail("the gradient reduce-scatter", e) from e
        return out

    def all_reduce_node(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Sum ``t`` over the ranks of this node (in place; moved to the device for NCCL)."""
        dist = _dist()
        dev = t.to(self.device)
        try:
            dist.all_reduce(dev, group=self.node_group)
        except Exception as e:  # noqa: BLE001
            raise self._fail(what, e) from e
        return dev.cpu()

    # ------------------------------------------------------------------ shared memory
    def _share(self, nbytes: int, name: str) -> int:
        """A file descriptor of one ``nbytes`` memfd shared by the node's ranks (local rank 0 creates it)."""
        fd = -1
        err = None
        if self.local_rank == 0:
            try:
                fd = os.memfd_create(name, os.MFD_CLOEXEC)
                os.ftruncate(fd, nbytes)
            except OSError as e:
                err = f"local rank 0 could not create {nbytes} bytes of shared memory: {e}"
        where = self.all_gather_object((os.getpid(), fd, err), f"sharing the {name}")
        node0 = self.node * self.local_world
        pid, fd0, err0 = where[node0]
        if err0:
            raise DataParallelError(f"megatrain data parallel: {err0}")
        if self.local_rank != 0:
            try:
                fd = os.open(f"/proc/{pid}/fd/{fd0}", os.O_RDWR | os.O_CLOEXEC)
            except OSError as e:
                err = (f"rank {self.rank} could not open local rank 0's shared {name} (/proc/{pid}/fd/{fd0}: {e}); "
                       "every rank of a node must run as the same user in the same container")
        errs = [e for _, _, e in self.all_gather_object((os.getpid(), fd, err), f"attaching the {name}") if e]
        if errs:
            if fd >= 0:
                os.close(fd)
            raise DataParallelError("megatrain data parallel: " + errs[0])
        return fd

    def create_store(self, tables, compute_dtype, with_grad_accum: bool, pin: bool, frozen, total_bytes: int):
        """The node's shared ``HostStore`` (every local rank maps the same pages); collective."""
        page = mmap.PAGESIZE
        fd = self._share(max(page, -(-int(total_bytes) // page) * page), "megatrain host store")
        try:
            # the engine checked the budget (with its credit) before any rank got here
            store = _C.HostStore(tables, compute_dtype, with_grad_accum, pin, frozen=frozen, shared_fd=fd,
                                 check_budget=False)
        finally:
            os.close(fd)
        self.barrier("mapping the shared host store")  # local rank 0's descriptor was open until every rank mapped
        return store

    def init_control(self, n_units: int) -> None:
        """The shared control block: per local rank its pid and one update counter per unit; collective."""
        n = self.local_world * (1 + n_units)
        fd = self._share(8 * n, "megatrain control block")
        try:
            self._ctl_map = mmap.mmap(fd, 8 * n)
        finally:
            os.close(fd)
        ctl = torch.frombuffer(self._ctl_map, dtype=torch.int64).view(self.local_world, 1 + n_units)
        self._ctl = ctl
        self.pids = ctl[:, 0]
        self.counters = ctl[:, 1:]
        self.pids[self.local_rank] = os.getpid()
        self.gen = [0] * n_units
        self.barrier("starting data parallel")

    def bump(self, unit_index: int) -> None:
        """Worker: one more update task of ``unit_index`` ran on this rank."""
        self.counters[self.local_rank, unit_index] += 1

    def wait_peers(self, unit_index: int) -> None:
        """Block until every local rank ran as many update tasks of ``unit_index`` as this rank queued.

        Raises:
            DataParallelError: a peer's process is gone, or ``MEGATRAIN_DP_TIMEOUT`` seconds passed.
        """
        want = self.gen[unit_index]
        col = self.counters[:, unit_index]
        others = [r for r in range(self.local_world) if r != self.local_rank]
        if all(int(col[r]) >= want for r in others):
            return
        t0 = time.monotonic()
        last_check = t0
        delay = 1e-5
        while True:
            late = [r for r in others if int(col[r]) < want]
            if not late:
                return
            now = time.monotonic()
            if now - last_check > 0.5:
                last_check = now
                dead = [r for r in late if not _alive(int(self.pids[r]))]
                if dead:
                    raise DataParallelError(
                        f"megatrain data parallel (rank {self.rank}): local rank {dead[0]} (pid {int(self.pids[dead[0]])}) "
                        f"exited before finishing its update of unit {unit_index}; the job cannot continue: restart "
                        "it from the last checkpoint")
                if now - t0 > self.timeout_s:
                    raise DataParallelError(
                        f"megatrain data parallel (rank {self.rank}): local rank {late[0]} did not finish its update "
                        f"of unit {unit_index} within {ENV_TIMEOUT}={self.timeout_s:g} s; the job cannot continue")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    # ------------------------------------------------------------------ host buffers
    def accumulator(self, eng, unit, i: int) -> torch.Tensor:
        """This rank's piece of entry ``i``'s fp32 gradient accumulator (allocated at first use: pieces only)."""
        if eng.accumulator_mode is True:
            lo, n = self.piece(unit.entries[i].numel)
            return eng.store.view(unit.index, i, "grad_accum").view(-1)[lo:lo + n]
        if self._acc is None:
            self._acc = {}
            for u in eng.units:
                off = 0
                for k, e in enumerate(u.entries):
                    if not e.frozen:
                        self._acc_off[(u.index, k)] = off
                        off += self.piece(e.numel)[1]
                self._acc[u.index] = torch.zeros(off, dtype=torch.float32)
        off = self._acc_off[(unit.index, i)]
        return self._acc[unit.index][off:off + self.piece(unit.entries[i].numel)[1]]

    def accumulator_bytes(self) -> int:
        return 0 if self._acc is None else sum(4 * t.numel() for t in self._acc.values())

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._pinned_lock:
            free = self._pinned.get((numel, dtype))
            if free:
                return free.pop()
        return _C.pinned_empty(numel, dtype, check_budget=False)  # staging: counted in the store's check

    def give_back(self, buf: torch.Tensor) -> None:
        with self._pinned_lock:
            self._pinned.setdefault((buf.numel(), buf.dtype), []).append(buf)

    def reclaim(self) -> None:
        """Staging buffers of finished gradient tasks back to the pool (main thread)."""
        left = []
        for h, buf in self._in_flight:
            if h.done:
                self.give_back(buf)
            else:
                left.append((h, buf))
        self._in_flight = left

    # ------------------------------------------------------------------ one rank acts, all agree
    def _agree(self, err: Optional[BaseException], what: str) -> None:
        msg = None if err is None else f"{type(err).__name__}: {err}"
        outcomes = self.all_gather_object(msg, what)
        if err is not None:
            raise err
        for r, m in enumerate(outcomes):
            if m is not None:
                raise DataParallelError(f"megatrain data parallel: {what} failed on rank {r}: {m}")

    def on_rank0(self, fn, what: str, others_result=None):
        """Run ``fn`` on global rank 0 while the others wait; its error is raised on every rank; collective."""
        err, out = None, others_result
        if self.rank == 0:
            try:
                out = fn()
            except Exception as e:  # noqa: BLE001 - re-raised below, after the others heard of it
                err = e
        self._agree(err, f"megatrain.{what}")
        return out

    def on_local0(self, fn, what: str) -> None:
        """Run ``fn`` on each node's local rank 0 (it writes the node's shared store); collective."""
        err = None
        if self.fills_store:
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                err = e
        self._agree(err, f"megatrain.{what}")

    # ------------------------------------------------------------------ wrap
    def check_same_weights(self, units) -> None:
        """Raise on every rank if the ranks' models differ (per-entry float64 sums compared); collective."""
        sums = []
        with torch.no_grad():
            for u in units:
                for e in u.entries:
                    p = e.param
                    sums.append(None if p.device.type == "meta" else float(p.detach().double().sum()))
        allsums = self.all_gather_object(sums, "comparing the ranks' models")
        for r, s in enumerate(allsums):
            if s != allsums[0]:
                raise ValueError(f"megatrain data parallel: rank {r}'s model weights differ from rank 0's; build the "
                                 "model the same way on every rank (torch.manual_seed before constructing it, or "
                                 "megatrain.from_pretrained)")


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
        if layers in (0, "auto", None):
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
        from .grads import _graph_task_id, in_compute

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
            dev_norms = (torch.stack([torch.linalg.vector_norm(out[pieces[i][0]:pieces[i][0] + pieces[i][1]],
                                                               dtype=torch.float64) for i in norm_idx])
                         if norm_idx else None)
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
                ev = torch.cuda.Event()
                ev.record(self.d2h_stream)
            if not self.d2h_overlap:
                self.compute_stream().wait_event(ev)
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
            self._grad_outcomes.append((handle, outcome, None))
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
