"""One device-state layer's device buffers (:class:`DeviceUnit`) and its permanent slot (:class:`DeviceSlot`).

The buffers have the host store's layout (same per-entry offsets): ``compute`` (the compute copy),
fp32 ``master`` / ``exp_avg`` / ``exp_avg_sq`` and the fp32 gradient accumulator ``grad``. What
they are for and who copies them: :mod:`.device_state`.
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
        self.grad = torch.zeros(n, dtype=torch.float32, device=device)
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

    @property
    def nbytes(self) -> int:
        """Device bytes this unit's state added (the resident unit's compute buffer existed before)."""
        own = (self.compute,) if self.owns_compute else ()
        return sum(t.numel() * t.element_size() for t in own + (self.master, self.exp_avg, self.exp_avg_sq, self.grad))


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
