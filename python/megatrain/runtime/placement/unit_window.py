"""``OneUnitWindow``: the main-thread window of a tier that holds units' fp32 state outside the host store.

The disk tier (:class:`~.disk_tier.DiskOffload`) and the device tier (:class:`~.device_tier.DeviceTier`)
hand readers and writers (checkpoints, ``state_dict``, the export, the fill) one unit's fp32 state
at a time, in a buffer valid until another unit is viewed or the window ends. This base owns the
window's bookkeeping (nesting, the writing flag, the release callback); each tier says how a held
unit is released (:meth:`OneUnitWindow._release_held`) and what must happen before a window opens.
"""

from __future__ import annotations

import contextlib


class OneUnitWindow:
    """Window bookkeeping shared by the tiers (see the module docstring).

    A subclass calls :meth:`_init_window` in its constructor, implements :meth:`_release_held`
    (write back the unit it holds when the window writes, after ``_on_release(unit)`` where
    ``run_callback``) and may override :meth:`_before_window`.
    """

    tier_name = "tier"

    def _init_window(self) -> None:
        self._window_write = None  # None: no window open; else whether it writes
        self._on_release = None

    def _before_window(self) -> None:
        """Called before an outermost window opens (the disk tier drains the CPU worker)."""

    def _release_held(self, run_callback: bool = True) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def window(self, write: bool, on_release=None):
        """Within: views reach one unit's fp32 state at a time (``write``: written back on release).

        ``on_release(unit)``: called (writing windows) while a unit is still held, just before it is
        released (the fill rebuilds its compute copy from the masters there). Nested windows: the
        outer one decides.

        Raises:
            RuntimeError: a writing window inside a reading one.
        """
        if self._window_write is not None:
            if write and not self._window_write:
                raise RuntimeError(f"megatrain: a writing {self.tier_name} window inside a reading one")
            yield self
            return
        self._before_window()
        self._window_write, self._on_release = bool(write), on_release
        ok = False
        try:
            yield self
            ok = True
        finally:
            try:
                self._release_held(run_callback=ok)
            finally:
                self._window_write = None
                self._on_release = None
