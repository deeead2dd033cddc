"""``activation_policy="offload"``: saved layer inputs parked in pinned host memory.

As ``recompute``, each layer call keeps only its input and re-runs the layer in backward; the
input is not kept on the device but copied to a pinned host buffer on the engine's D2H stream as
soon as the layer's forward has been queued. In backward the input of a layer is copied back on
the H2D stream; while layer ``i`` runs its backward the input of the layer before it (the next
one backward needs) is already being copied, so the H2D copy overlaps compute. Device memory for
saved inputs: two layer inputs instead of one per layer; host memory: one per layer.

On the CPU the "host buffer" is another CPU tensor and the copies are synchronous: the same code
path, which the CPU parity tests cover.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ..placement.host_memory import host_memory_limits

# A forward refuses to park more than this fraction of the host's available memory.
HOST_FRACTION = 0.8

GiB = 1024 ** 3


class _Parked:
    """One layer call's inputs in host memory; ``device`` once copied back (prefetch)."""

    __slots__ = ("host", "d2h_done", "device", "h2d_done", "prev")

    def __init__(self, host, d2h_done, prev):
        self.host: Optional[Tuple[torch.Tensor, ...]] = host
        self.d2h_done = d2h_done  # CUDA event on the D2H stream (None on the CPU)
        self.device: Optional[Tuple[torch.Tensor, ...]] = None
        self.h2d_done = None
        self.prev: Optional["_Parked"] = prev  # the previous layer call of the same forward


class InputOffload:
    """Parks layer inputs in host memory in forward and brings them back in backward.

    Args:
        engine: the ``WrappedEngine`` (its ``device``, ``cuda``, ``h2d_stream``, ``d2h_stream``,
            ``layers``).
    """

    def __init__(self, engine):
        self.eng = engine
        self._last: Optional[_Parked] = None
        self.parked_bytes = 0  # bytes of inputs now in host memory (all forwards not yet backpropagated)
        self.peak_parked_bytes = 0

    def begin_forward(self) -> None:
        """A new forward: its first layer call has no predecessor to prefetch in backward."""
        self._last = None

    def park(self, inputs: Sequence[torch.Tensor]) -> _Parked:
        """Copy ``inputs`` (device tensors) to host memory (async on the D2H stream on CUDA).

        Raises:
            RuntimeError: the inputs of every layer at this size would exceed 80% of the host's
                available memory (checked at a forward's first layer call); names the policies to use.
        """
        eng = self.eng
        nbytes = sum(x.numel() * x.element_size() for x in inputs)
        if self._last is None:
            avail = host_memory_limits().get("mem_available_bytes")
            need = nbytes * len(eng.layers)
            if avail is not None and need > HOST_FRACTION * avail:
                raise RuntimeError(
                    f"megatrain: activation_policy='offload' would park {need / GiB:.1f} GiB of layer inputs in host "
                    f"memory ({len(eng.layers)} layers x {nbytes / GiB:.2f} GiB), more than {HOST_FRACTION:.0%} of the "
                    f"{avail / GiB:.1f} GiB available; use activation_policy='recompute', 'block:K' or 'auto'")
        if eng.cuda:
            compute = torch.cuda.current_stream(eng.device)
            ready = torch.cuda.Event()
            ready.record(compute)
            host = tuple(torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for x in inputs)
            with torch.cuda.stream(eng.d2h_stream):
                eng.d2h_stream.wait_event(ready)
                if eng.debug:
                    torch.cuda._sleep(2_000_000)  # MEGATRAIN_DEBUG_RACES: make copy races visible
                for h, x in zip(host, inputs):
                    h.copy_(x, non_blocking=True)
                    x.record_stream(eng.d2h_stream)  # x may be freed by the next layer before the copy ran
                done = torch.cuda.Event()
                done.record(eng.d2h_stream)
        else:
            host = tuple(x.detach().clone(memory_format=torch.contiguous_format) for x in inputs)
            done = None
        rec = _Parked(host, done, self._last)
        self._last = rec
        self.parked_bytes += nbytes
        self.peak_parked_bytes = max(self.peak_parked_bytes, self.parked_bytes)
        return rec

    def _bring_back(self, rec: _Parked) -> None:
        """Start the H2D copy of ``rec`` (async on the H2D stream on CUDA); idempotent."""
        if rec.device is not None or rec.host is None:
            return
        eng = self.eng
        if eng.cuda:
            compute = torch.cuda.current_stream(eng.device)
            dev = tuple(torch.empty(h.shape, dtype=h.dtype, device=eng.device) for h in rec.host)
            ready = torch.cuda.Event()
            ready.record(compute)  # the new buffers' memory may still be in use by queued compute work
            with torch.cuda.stream(eng.h2d_stream):
                eng.h2d_stream.wait_event(ready)
                eng.h2d_stream.wait_event(rec.d2h_done)
                if eng.debug:
                    torch.cuda._sleep(2_000_000)
                for d, h in zip(dev, rec.host):
                    d.copy_(h, non_blocking=True)
                done = torch.cuda.Event()
                done.record(eng.h2d_stream)
            rec.h2d_done = done
        else:
            dev = rec.host
        rec.device = dev
        self.parked_bytes -= sum(h.numel() * h.element_size() for h in rec.host)
        rec.host = None  # the caching host allocator reuses the pinned block once the copy is done

    def fetch(self, rec: _Parked) -> Tuple[torch.Tensor, ...]:
        """The inputs of ``rec`` on the device, ready for the compute stream; prefetches the
        previous layer call's inputs. Each record can be fetched once."""
        self._bring_back(rec)
        if rec.h2d_done is not None:
            torch.cuda.current_stream(self.eng.device).wait_event(rec.h2d_done)
        out = rec.device
        rec.device = None
        if rec.prev is not None:
            self._bring_back(rec.prev)  # overlaps this layer's backward
        rec.prev = None
        return out
