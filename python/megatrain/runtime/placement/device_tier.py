"""The device tier for readers: the fp32 state of *exclusive* device-state layers, held on the device only.

An exclusive device-state layer (``DeviceUnit.exclusive``, chosen at wrap when the host store of
every unit does not fit the host budget: :func:`~.disk_plan.plan_offload`) keeps its fp32 master,
``exp_avg``, ``exp_avg_sq`` and gradient accumulator in its device buffers alone: the host store has no
fp32 section of it (``HostStore(offloaded=...)``, as for a disk-tier unit) and, unless a frozen entry keeps
its compute copy there, no compute section either (``compute_absent``), so host and device memory together
hold the model.

:class:`DeviceTier` gives the main thread the same calls the disk tier's
:class:`~.disk_tier.DiskOffload` gives it (``window`` / ``section`` / ``view`` / ``read`` /
``write``), so checkpoints, ``state_dict``, the export and the fill stream such a unit's state
through one host scratch buffer at a time (12 B/param of one unit) instead of a second full copy.
The engine's ``state_tier(unit)`` answers which tier (disk, device, or None: the host store) holds a
unit's fp32 state.
"""

from __future__ import annotations

from typing import Dict

import torch

from .unit_window import OneUnitWindow

SECTIONS = ("master", "exp_avg", "exp_avg_sq")


def is_exclusive(unit) -> bool:
    """Whether ``unit``'s fp32 state is on the device only (an exclusive device-state layer)."""
    du = getattr(unit, "device_state", None)
    return du is not None and getattr(du, "exclusive", False)


def scratch_bytes(state_numel: int) -> int:
    """Host bytes of the scratch buffer a window holds for one unit of ``state_numel`` fp32 elements."""
    return 4 * len(SECTIONS) * int(state_numel)


class DeviceTier(OneUnitWindow):
    """Main-thread access to the exclusive device-state units' fp32 state (see the module docstring).

    Inside :meth:`window`, :meth:`section` / :meth:`view` of a unit copy its three fp32 device
    sections into one host scratch buffer (fp32, CPU; ``3 x unit.state_numel``) and return views of
    it, valid until another exclusive unit is viewed or the window ends; in a writing window the
    scratch is copied back to the device buffers then. Copies are made on torch's current stream
    (the one the device updates are enqueued on) and are synchronous for the host.
    """

    tier_name = "device-tier"

    def __init__(self):
        self._init_window()
        self._held = None  # (unit, scratch [3, state_numel] fp32 CPU)

    @torch.no_grad()
    def _release_held(self, run_callback: bool = True) -> None:
        held = self._held
        if held is None:
            return
        unit, scratch = held
        if run_callback and self._window_write and self._on_release is not None:
            self._on_release(unit)
        self._held = None
        if self._window_write:
            du = unit.device_state
            for k, name in enumerate(SECTIONS):
                getattr(du, name).copy_(scratch[k])

    @torch.no_grad()
    def _acquire(self, unit) -> torch.Tensor:
        if self._held is not None and self._held[0] is unit:
            return self._held[1]
        self._release_held()
        du = unit.device_state
        scratch = torch.empty((len(SECTIONS), int(unit.state_numel)), dtype=torch.float32)
        for k, name in enumerate(SECTIONS):
            scratch[k].copy_(getattr(du, name))
        self._held = (unit, scratch)
        return scratch

    def section(self, unit, name: str) -> torch.Tensor:
        """Flat fp32 CPU view of section ``name`` (master / exp_avg / exp_avg_sq) of ``unit`` (in a window).

        Raises:
            RuntimeError: outside a window. ValueError: another section name.
        """
        if self._window_write is None:
            raise RuntimeError(f"megatrain: the {name} of unit {unit.index} is on the device only (an exclusive "
                               "device-state layer); read it through the engine's state accessors (checkpoint, "
                               "state_dict, optimizer.state)")
        if name not in SECTIONS:
            raise ValueError(f"megatrain: the device tier holds {', '.join(SECTIONS)} of unit {unit.index}, not {name}")
        return self._acquire(unit)[SECTIONS.index(name)]

    def view(self, unit, i: int, name: str) -> torch.Tensor:
        """Shaped fp32 CPU view of entry ``i`` of ``unit`` in section ``name`` (in a window)."""
        e = unit.entries[i]
        if e.state_offset < 0:
            raise ValueError(f"megatrain: entry {e.name} is frozen: it has no {name}")
        return self.section(unit, name)[e.state_offset:e.state_offset + e.numel].view(e.shape)

    @torch.no_grad()
    def read(self, unit, i: int, name: str) -> torch.Tensor:
        """A CPU fp32 copy (entry ``i``'s shape) of ``name`` of entry ``i``, straight from the device buffer."""
        e = unit.entries[i]
        if e.state_offset < 0:
            raise ValueError(f"megatrain: entry {e.name} is frozen: it has no {name}")
        return unit.device_state.fp32(name, i).to("cpu", copy=True).view(e.shape)

    @torch.no_grad()
    def write(self, unit, values: Dict[tuple, torch.Tensor]) -> None:
        """Copy ``{(entry index, section name): tensor}`` into ``unit``'s device buffers."""
        du = unit.device_state
        for (i, name), v in values.items():
            du.fp32(name, i).copy_(v.reshape(-1))
