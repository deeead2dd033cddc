"""Engine counters: bytes and seconds of the copies, the CPU Adam and the waits for it.

:class:`EngineCounters` is the part of an :class:`~megatrain.runtime.engine.core.Engine` that owns
the cumulative counters (``Engine.counters``): the other parts add to them (:meth:`~EngineCounters.add`,
:meth:`~EngineCounters.add_locked` where the CPU worker's results are counted) and time their copies
on CUDA (:meth:`~EngineCounters.timed`, :meth:`~EngineCounters.copy_timing`).
:func:`engine_stats` and :func:`placement_report` are ``Engine.stats()`` and ``Engine.placement()``
(the per-step worker timeline is :mod:`.timeline`'s).
"""

from __future__ import annotations

import threading

import torch

from ..._loader import load_extension

_C = load_extension()


class EngineCounters:
    """Cumulative counters of an engine (bytes, seconds, copies) and the timing of its CUDA copies.

    Args:
        cuda: whether the engine computes on CUDA (copies are timed only there).
        device_index: the CUDA device of the timing events (-1 on the CPU).
    """

    def __init__(self, cuda: bool, device_index: int):
        self.cuda = cuda
        self.device_index = device_index
        self._stats = dict(h2d_bytes=0, d2h_bytes=0, adam_time_s=0.0, adam_exposed_s=0.0,
                           grad_accum_time_s=0.0, grad_wait_s=0.0, h2d_copies=0, slot_hits=0)
        self._timed_copies: list = []  # (kind, start_event, end_event) awaiting readout
        self._h2d_time_s = 0.0
        self._d2h_time_s = 0.0
        self._lock = threading.Lock()

    def add(self, key: str, amount) -> None:
        """Add ``amount`` to counter ``key`` (the main thread's counters: no lock)."""
        self._stats[key] += amount

    def add_locked(self, key: str, amount) -> None:
        """Add ``amount`` to counter ``key`` under the counters' lock (time counters)."""
        with self._lock:
            self._stats[key] += amount

    def timed(self, kind: str, stream):
        """Record a timing start on ``stream`` for a copy of ``kind`` (``"h2d"`` / ``"d2h"``); returns the
        end event to record after the copy (``torch.cuda.Event``), or None on the CPU."""
        if not self.cuda:
            return None
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        if len(self._timed_copies) > 4096:
            self.collect_copy_times()
        self._timed_copies.append((kind, start, end))
        return end

    def copy_timing(self, kind: str):
        """``(start, end)``: two timing ``_C.CudaEvent`` for a copy the C++ side records (CUDA only)."""
        start = _C.CudaEvent(True, self.device_index)
        end = _C.CudaEvent(True, self.device_index)
        if len(self._timed_copies) > 4096:
            self.collect_copy_times()
        self._timed_copies.append((kind, start, end))
        return start, end

    def collect_copy_times(self) -> None:
        """Add the times of the copies timed so far to ``h2d_time_s`` / ``d2h_time_s`` (waits for them)."""
        for kind, start, end in self._timed_copies:
            end.synchronize()
            ms = start.elapsed_time(end)
            if kind == "h2d":
                self._h2d_time_s += ms / 1e3
            else:
                self._d2h_time_s += ms / 1e3
        self._timed_copies.clear()

    def totals(self) -> dict:
        """The counters now, then ``h2d_time_s`` and ``d2h_time_s`` (of the copies collected)."""
        with self._lock:
            out = dict(self._stats)
        out.update(h2d_time_s=self._h2d_time_s, d2h_time_s=self._d2h_time_s)
        return out


def placement_report(eng) -> dict:
    """Where the decoder layers' training state and activations live (what the planner chose).

    Returns ``device_state_layers`` (layers ``0 .. K-1`` whose whole training state is on the
    device), ``device_state_resident`` (the resident unit's too: ``device_state_layers="auto"``),
    ``device_state_bytes``, ``exclusive_layers`` (indices of the device-state layers whose fp32 state is
    on the device only: the host store has no fp32 section for them), ``exclusive_share`` (which rule made
    them: ``"auto"``, ``"capacity"`` (beyond the ``"auto"`` share, because the host would not hold the model
    otherwise: :func:`~..placement.device_state_plan.capacity_room`), ``"explicit"``, None: none), ``host_store_bytes`` (the host
    store's arena), ``streamed_layers`` (layers whose weights stream from the
    host store), ``layers``, ``disk_layers`` (indices of the layers whose fp32 state is in the
    disk tier), ``disk_bytes`` (its files), ``offload_dir``, and ``activations``: per input shape seen by ``activation_policy="auto"``,
    ``store_layers`` (layers ``0 .. k-1`` keep their graphs), ``recompute_layers``, ``block_k``
    (one saved input per K layers), ``free_bytes`` (device bytes free when decided) and the measured
    ``bytes_per_layer`` / ``bytes_all_layers`` / ``bytes_per_input``; ``None``
    for the other policies (``activation_policy`` says what every layer does); ``replan``: what
    the planner measured in the first step and chose after it (``megatrain.runtime.placement.replan``), or None;
    ``gpu_memory_limit_bytes``: ``wrap(gpu_memory_limit=)`` in bytes (None: no cap); ``liger_kernel``:
    the Liger-Kernel patch ``wrap`` applied (``megatrain.runtime.model.fused_kernels``), or None;
    ``activation_reserve``: what the capacity share of exclusive device-state layers keeps for activations, and
    why (``"batch 4 x 4096"``: ``wrap(micro_batch_size=4, seq_len=4096)``, the activation estimate of
    ``megatrain.estimate`` for that batch; ``"20% of free memory"``: no batch given) and
    ``activation_reserve_bytes``: the bytes it kept (None: the capacity share was not sized).
    ``master_streamed_layers``: indices of the layers with no compute copy in the host store
    (``wrap(host_compute_copy=)``, :mod:`~..placement.master_streamed`); ``host_bytes_per_param``: the host
    store's bytes per parameter whose fp32 state it holds (about 14 with compute copies, 12 without, at one
    backward per step with a store-less accumulator).
    """
    k = len(eng.device_state.layers) if eng.device_state else 0
    decisions = getattr(eng, "auto_decisions", None) if getattr(eng, "auto_policy", False) else None
    acts = None
    if decisions is not None:
        acts = [{"input_shapes": [list(s) for s in key], **{n: v for n, v in d.items() if n != "store"}}
                for key, d in decisions.items()]
    disk = getattr(eng, "disk", None)
    return dict(layers=len(eng.layers), device_state_layers=k,
                device_state_bytes=eng.device_state.nbytes if eng.device_state else 0,
                device_state_resident=bool(eng.device_state and eng.device_state.resident),
                exclusive_layers=[u.index for u in eng.device_state.exclusive] if eng.device_state else [],
                exclusive_share=getattr(getattr(eng, "offload_plan", None), "exclusive_share", None),
                host_store_bytes=int(eng.store.total_bytes), streamed_layers=len(eng.layers) - k, activation_policy=getattr(eng, "activation_policy", None),
                activations=acts, disk_layers=[u.index for u in disk.units] if disk else [],
                disk_bytes=disk.plan.disk_bytes if disk else 0, offload_dir=disk.dir if disk else None,
                replan=getattr(eng, "replan_info", None),
                gpu_memory_limit_bytes=getattr(eng, "gpu_memory_limit_bytes", None),
                liger_kernel=getattr(eng, "liger_kernel", None),
                master_streamed_layers=[u.index for u in eng.units if u.master_streamed],
                host_bytes_per_param=_host_bytes_per_param(eng), **_reserve_report(eng))


def _reserve_report(eng) -> dict:
    """``activation_reserve`` (its source, in words) and ``activation_reserve_bytes`` of :func:`placement_report`."""
    from ..placement.device_state_plan import CAPACITY_ACTIVATION_RESERVE_FRACTION

    capacity = getattr(getattr(eng, "offload_plan", None), "capacity", None)
    batch = getattr(eng, "batch", None)
    by_batch = capacity["reserve"] == "batch" if capacity else batch is not None
    words = f"batch {batch[0]} x {batch[1]}" if by_batch and batch else (
        f"{CAPACITY_ACTIVATION_RESERVE_FRACTION:.0%} of free memory")
    return dict(activation_reserve=words, activation_reserve_bytes=capacity["reserve_bytes"] if capacity else None)


def _host_bytes_per_param(eng) -> float:
    """The host store's bytes over the parameters whose fp32 state it holds (0.0 without any)."""
    plan = getattr(eng, "offload_plan", None)
    off = plan.offloaded if plan is not None and plan.offloaded else [False] * len(eng.units)
    n = sum(e.numel for u in eng.units if not off[u.index] for e in u.entries)
    return float(eng.store.total_bytes) / n if n else 0.0


def engine_stats(eng) -> dict:
    """Cumulative counters (bytes, seconds) since the engine was built; diff two calls for a window.

    Keys: ``h2d_bytes``, ``d2h_bytes`` (bytes copied), ``h2d_time_s``, ``d2h_time_s`` (time the
    copies took on their streams), ``adam_time_s`` (CPU Adam), ``grad_accum_time_s``,
    ``adam_exposed_s`` (time the main thread waited for CPU updates), ``grad_wait_s`` (time
    ``step()`` waited for the last gradients to land: mostly the GPU finishing backward), ``slot_hits``,
    ``h2d_copies``, ``host_store_bytes``, ``pinned_bytes``, ``bytes_per_param``, ``num_params``,
    ``streamed_layers`` (layers whose weights stream), ``device_state_layers``,
    ``device_state_bytes`` (device bytes of their training state); with a disk tier ``disk_layers``
    and its counters ``disk_bytes_read``, ``disk_bytes_written``, ``disk_unit_reads``,
    ``disk_unit_writes``, ``disk_cache_hits``, ``disk_read_seconds``, ``disk_write_seconds``,
    ``disk_acquire_wait_seconds`` (time the worker waited for the disk), ``disk_direct_io``;
    ``attention_kept_calls`` / ``attention_reused_calls`` (``megatrain.runtime.activations.attention_reuse``).
    Reading the copy times waits for the copies already issued.
    """
    eng.counters.collect_copy_times()
    eng.settle()
    out = eng.counters.totals()
    out.update(
        host_store_bytes=int(eng.store.total_bytes),
        pinned_bytes=int(eng.store.pinned_bytes),
        bytes_per_param=float(eng.store.bytes_per_param),
        num_params=int(eng.store.total_numel),
        streamed_layers=len(eng.layers) - (len(eng.device_state.layers) if eng.device_state else 0),
        device_state_layers=len(eng.device_state.layers) if eng.device_state else 0,
        device_state_resident=bool(eng.device_state and eng.device_state.resident),
        device_state_bytes=eng.device_state.nbytes if eng.device_state else 0,
    )
    reuse = getattr(eng, "attention_reuse", None)
    if reuse is not None:  # block:K: attention outputs kept by block re-runs (runtime/activations/attention_reuse.py)
        out.update(attention_kept_calls=reuse.kept_calls, attention_reused_calls=reuse.reused_calls)
    disk = getattr(eng, "disk", None)
    if disk is not None:  # the disk tier's counters, cumulative (bytes, units, seconds)
        out.update({f"disk_{k}": v for k, v in disk.stats().items() if k not in ("disk_units",)})
        out["disk_layers"] = len(disk.units)
    return out
