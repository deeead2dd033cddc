"""One device-state layer's device buffers (:class:`DeviceUnit`) and its permanent slot (:class:`DeviceSlot`).

The buffers have the host store's layout (same per-entry offsets): ``compute`` (the compute copy),
fp32 ``master`` / ``exp_avg`` / ``exp_avg_sq`` and the fp32 gradient accumulator ``grad``. What
they are for and who copies them: :mod:`.device_state`.

A decoder layer's ``grad`` is allocated only when gradients are summed (a second gradient before
the step, ``gradient_accumulation_steps > 1``): its first gradient of a step is written into its
``compute`` buffer itself (*direct*, as the host-stored layers' D2H into their compute section), whose
weights the update then rewrites from the fp32 master. ``take_weights()`` rebuilds them from the
master first wherever they are needed before the update (the layer runs again; the host store
reads its compute copy), moving a gradient that still counts into ``grad``.
"""

from __future__ import annotations

from typing import List, Optional

import torch


class DeviceSlot:
    """The permanent device slot of a device-state layer (the interface of :class:`~..engine.slots.Slot`)."""

    permanent = True

    def __init__(self, unit, buf: torch.Tensor):
        self.buf = buf
        self.unit = unit
        self.version = 0
        self.in_use = 0
        self.last_use = 0
        self.weights_ready = None
        self.buffer_free = None
        self.free_recorded = False


class DeviceUnit:
    """One device-state layer: its device buffers and bookkeeping."""

    def __init__(self, unit, device: torch.device, compute_dtype: torch.dtype, cuda: bool,
                 compute: Optional[torch.Tensor] = None, exclusive: bool = False):
        """``compute``: the resident unit's existing device buffer (its parameters' storage, read outside
        ``acquire()``: that unit keeps its fp32 ``grad`` from the start and never takes a direct gradient)."""
        self.unit = unit
        # the fp32 state is here only (no host-store section): it starts as zeros, written by the fill
        self.exclusive = exclusive
        # the resident unit's compute copy is the device buffer its parameters view (``compute``)
        self.owns_compute = compute is None
        self.compute = torch.empty(unit.numel, dtype=compute_dtype, device=device) if compute is None else compute
        n = unit.state_numel
        alloc = torch.zeros if exclusive else torch.empty
        self.master = alloc(n, dtype=torch.float32, device=device)
        self.exp_avg = alloc(n, dtype=torch.float32, device=device)
        self.exp_avg_sq = alloc(n, dtype=torch.float32, device=device)
        # the direct gradient needs the compute copy to be the layer's slot (rebuilt in acquire())
        self.direct_grads = compute is None
        self.grad: Optional[torch.Tensor] = None  # fp32 accumulator: allocated when first needed (ensure_grad)
        if not self.direct_grads:
            self.ensure_grad()
        self.grad_in_compute: set = set()  # entries whose slice of ``compute`` holds their gradient, not weights
        self.slot = DeviceSlot(unit, self.compute)
        self.host_stale = False  # the device state changed since the last to_host()
        self.host_master_stale = False  # the device master changed since it was last copied to the host store
        self.host_dirty = False  # the host sections may have been written (optimizer.state): from_host() first
        self.norm_row = None  # pinned readback of the squared-norm inputs (CUDA)
        if cuda:
            self.norm_row = torch.empty(max(1, len(unit.entries)), dtype=torch.float64, pin_memory=True)
        self.grad_task = None  # handle of the last gradient task (it reads norm_row)
        # Runs [start, end) of the compute layout holding the trainable entries (None: no frozen entry):
        # what to_host() copies. A frozen entry's device copy changes only by from_host(), so the host
        # store's is never older, and may be newer (written through model.state_dict(), to be taken).
        self.trained_runs = _trained_runs(unit)

    def fp32(self, name: str, i: int) -> torch.Tensor:
        e = self.unit.entries[i]
        return getattr(self, name)[e.state_offset:e.state_offset + e.numel]

    def weights(self, i: int) -> torch.Tensor:
        e = self.unit.entries[i]
        return self.compute[e.offset:e.offset + e.numel]

    def grad_of(self, i: int) -> torch.Tensor:
        """Flat gradient of entry i as held: its slice of ``compute`` (compute dtype) after a direct hand-over,
        else its slice of the fp32 ``grad`` buffer."""
        return self.weights(i) if i in self.grad_in_compute else self.fp32("grad", i)

    def ensure_grad(self) -> None:
        """Allocate the fp32 gradient accumulator (4 B per trainable parameter, zeros; no-op when present).

        Raises:
            torch.cuda.OutOfMemoryError: it does not fit on the device.
        """
        if self.grad is None:
            self.grad = torch.zeros(self.unit.state_numel, dtype=torch.float32, device=self.master.device)

    @torch.no_grad()
    def take_weights(self, keep_grads: bool = True) -> None:
        """Make ``compute`` hold the weights again: each direct gradient there is copied into the fp32
        ``grad`` buffer (``keep_grads``; allocated then; bf16 -> fp32 is exact), and its slice rewritten
        from the fp32 master (round to nearest even, as the update does). Enqueued on the current stream."""
        if not self.grad_in_compute:
            return
        if keep_grads:
            self.ensure_grad()
        for i in sorted(self.grad_in_compute):
            if keep_grads:
                self.fp32("grad", i).copy_(self.weights(i))
            self.weights(i).copy_(self.fp32("master", i))
        self.grad_in_compute.clear()

    @property
    def nbytes(self) -> int:
        """Device bytes this unit's state added (the resident unit's compute buffer existed before); the fp32
        ``grad`` counts once allocated."""
        own = (self.compute,) if self.owns_compute else ()
        grad = (self.grad,) if self.grad is not None else ()
        return sum(t.numel() * t.element_size() for t in own + (self.master, self.exp_avg, self.exp_avg_sq) + grad)


def runs_without(unit, skip) -> List[tuple]:
    """``[(start, end)]`` element runs of ``unit``'s compute layout outside the entries ``skip`` (indices)."""
    runs, start = [], 0
    for e in sorted((unit.entries[i] for i in skip), key=lambda e: e.offset):
        if e.offset > start:
            runs.append((start, e.offset))
        start = e.offset + e.numel
    if start < int(unit.numel):
        runs.append((start, int(unit.numel)))
    return runs


def _trained_runs(unit) -> Optional[List[tuple]]:
    """``[(start, end)]`` element runs of ``unit``'s compute layout that hold its trainable entries (with the
    padding between them), or None when no entry is frozen."""
    entries = sorted(unit.entries, key=lambda e: e.offset)
    if not any(e.frozen for e in entries):
        return None
    runs, start = [], None
    for e in entries:
        if e.frozen:
            if start is not None:
                runs.append((start, e.offset))
                start = None
        elif start is None:
            start = e.offset
    if start is not None:
        runs.append((start, int(unit.numel)))
    return runs
