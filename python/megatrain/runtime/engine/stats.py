"""Engine counters: bytes and seconds of the copies, the CPU Adam and the waits for it (and, from
:mod:`.timeline`, the per-step timeline of the CPU worker's tasks)."""

from __future__ import annotations

import threading

import torch

from ..._loader import load_extension
from .timeline import EngineTimeline

_C = load_extension()


class EngineStats(EngineTimeline):
    """Cumulative counters of an :class:`~megatrain.runtime.engine.core.Engine` (``stats()``) and its per-step
    worker timeline (``worker_timeline()``, :mod:`.timeline`)."""

    def _init_stats(self) -> None:
        self._stats = dict(h2d_bytes=0, d2h_bytes=0, adam_time_s=0.0, adam_exposed_s=0.0,
                           grad_accum_time_s=0.0, grad_wait_s=0.0, h2d_copies=0, slot_hits=0)
        self._timed_copies: list = []  # (kind, start_event, end_event) awaiting readout
        self._h2d_time_s = 0.0
        self._d2h_time_s = 0.0
        self._stats_lock = threading.Lock()
        self._init_timeline()

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

    def _copy_timing(self, kind: str):
        """``(start, end)``: two timing ``_C.CudaEvent`` for a copy the C++ side records (CUDA only)."""
        start = _C.CudaEvent(True, self._device_index)
        end = _C.CudaEvent(True, self._device_index)
        if len(self._timed_copies) > 4096:
            self._collect_copy_times()
        self._timed_copies.append((kind, start, end))
        return start, end

    def placement(self) -> dict:
        """Where the decoder layers' training state and activations live (what the planner chose).

        Returns ``device_state_layers`` (layers ``0 .. K-1`` whose whole training state is on the
        device), ``device_state_resident`` (the resident unit's too: ``device_state_layers="auto"``),
        ``device_state_bytes``, ``streamed_layers`` (layers whose weights stream from the
        host store), ``layers``, ``disk_layers`` (indices of the layers whose fp32 state is in the
        disk tier), ``disk_bytes`` (its files), ``offload_dir``, and ``activations``: per input shape seen by ``activation_policy="auto"``,
        ``store_layers`` (layers ``0 .. k-1`` keep their graphs), ``recompute_layers``, ``block_k``
        (one saved input per K layers), ``free_bytes`` (device bytes free when decided) and the measured
        ``bytes_per_layer`` / ``bytes_all_layers`` / ``bytes_per_input``; ``None``
        for the other policies (``activation_policy`` says what every layer does); ``replan``: what
        the planner measured in the first step and chose after it (``megatrain.runtime.placement.replan``), or None;
        ``gpu_memory_limit_bytes``: ``wrap(gpu_memory_limit=)`` in bytes (None: no cap); ``liger_kernel``:
        the Liger-Kernel patch ``wrap`` applied (``megatrain.runtime.model.fused_kernels``), or None.
        """
        k = len(self.device_state.layers) if self.device_state else 0
        decisions = getattr(self, "auto_decisions", None) if getattr(self, "auto_policy", False) else None
        acts = None
        if decisions is not None:
            acts = [{"input_shapes": [list(s) for s in key], **{n: v for n, v in d.items() if n != "store"}}
                    for key, d in decisions.items()]
        disk = getattr(self, "disk", None)
        return dict(layers=len(self.layers), device_state_layers=k,
                    device_state_bytes=self.device_state.nbytes if self.device_state else 0,
                    device_state_resident=bool(self.device_state and self.device_state.resident),
                    streamed_layers=len(self.layers) - k, activation_policy=getattr(self, "activation_policy", None),
                    activations=acts, disk_layers=[u.index for u in disk.units] if disk else [],
                    disk_bytes=disk.plan.disk_bytes if disk else 0, offload_dir=disk.dir if disk else None,
                    replan=getattr(self, "replan_info", None),
                    gpu_memory_limit_bytes=getattr(self, "gpu_memory_limit_bytes", None),
                    liger_kernel=getattr(self, "liger_kernel", None))

    def stats(self) -> dict:
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
        self._collect_copy_times()
        self.settle()
        with self._stats_lock:
            out = dict(self._stats)
        out.update(
            h2d_time_s=self._h2d_time_s,
            d2h_time_s=self._d2h_time_s,
            host_store_bytes=int(self.store.total_bytes),
            pinned_bytes=int(self.store.pinned_bytes),
            bytes_per_param=float(self.store.bytes_per_param),
            num_params=int(self.store.total_numel),
            streamed_layers=len(self.layers) - (len(self.device_state.layers) if self.device_state else 0),
            device_state_layers=len(self.device_state.layers) if self.device_state else 0,
            device_state_resident=bool(self.device_state and self.device_state.resident),
            device_state_bytes=self.device_state.nbytes if self.device_state else 0,
        )
        reuse = getattr(self, "attention_reuse", None)
        if reuse is not None:  # block:K: attention outputs kept by block re-runs (runtime/activations/attention_reuse.py)
            out.update(attention_kept_calls=reuse.kept_calls, attention_reused_calls=reuse.reused_calls)
        disk = getattr(self, "disk", None)
        if disk is not None:  # the disk tier's counters, cumulative (bytes, units, seconds)
            out.update({f"disk_{k}": v for k, v in disk.stats().items() if k not in ("disk_units",)})
            out["disk_layers"] = len(disk.units)
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

