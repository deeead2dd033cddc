"""This rank's host buffers: its pieces of the fp32 gradient accumulator and the pinned staging pool (CUDA)."""

from __future__ import annotations

import threading
from typing import Optional

import torch

from ..._loader import load_extension

_C = load_extension()


class PieceBuffers:
    """Mixed into :class:`~.group.DataParallel`: accumulator pieces (4 B per owned element) and staging buffers."""

    def _init_buffers(self) -> None:
        self._acc: Optional[dict] = None  # unit index -> flat fp32 accumulator of this rank's pieces
        self._acc_off: dict = {}  # (unit, entry) -> offset in it
        self._in_flight: list = []  # (gradient task handle, pinned staging buffer) (CUDA)
        self._pinned: dict = {}  # size -> free pinned staging buffers (CUDA)
        self._pinned_lock = threading.Lock()

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

    @property
    def accumulator_allocated(self) -> bool:
        """This rank's accumulator pieces exist (allocated at the first gradient summed)."""
        return self._acc is not None

    def accumulator_bytes(self) -> int:
        """Host bytes of this rank's accumulator pieces."""
        return 0 if self._acc is None else sum(4 * t.numel() for t in self._acc.values())

    def hold_staging(self, handle, buf: torch.Tensor) -> None:
        """``buf`` (a pinned staging buffer) is read by the gradient task ``handle``: back to the pool after it ran."""
        self._in_flight.append((handle, buf))

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

