"""``StateAccess``: what reading and writing training state (``megatrain.state``) may ask of an engine.

Checkpoints, exports, ``save_pretrained`` and the loaders that fill a new store go through this one
narrow interface instead of the engine's attributes. It is built only from :class:`~.core.Engine`'s
public methods and attributes: the units and their entries, a zero-copy view of one entry's
section, the disk tier's window, and the synchronisation before a read and after a write.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

from .core import locate


def grads_pending(engine) -> bool:
    """Whether a backward since the last ``step()`` / ``zero_grad()`` left gradients in ``engine``'s units
    that no update has applied yet."""
    return any(any(u.has_grad) or any(u.batches) for u in engine.units)


class StateAccess:
    """The state-reading and state-writing view of one engine (see the module docstring).

    Args:
        engine: the :class:`~.core.Engine` of a wrapped model (``model.megatrain``).
    """

    def __init__(self, engine):
        self.engine = engine

    @classmethod
    def of_model(cls, model, where: str) -> "StateAccess":
        """The access of ``model.megatrain``.

        Raises:
            ValueError: ``"{where}: the model is not wrapped by megatrain.wrap"``.
        """
        eng = getattr(model, "megatrain", None)
        if eng is None:
            raise ValueError(f"{where}: the model is not wrapped by megatrain.wrap")
        return cls(eng)

    # ------------------------------------------------------------------ layout
    @property
    def units(self) -> list:
        """The units in forward order; each has ``index``, ``kind``, ``numel`` and ``entries`` (``name``,
        ``shape``, ``frozen``, ``param``)."""
        return self.engine.units

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of the compute copies (``torch.bfloat16`` or ``torch.float32``)."""
        return self.engine.compute_dtype

    @property
    def data_parallel(self):
        """The data-parallel group of the engine (``collective``, ``on_rank0``, ``on_local0``), or None."""
        return getattr(self.engine, "dp", None)

    @property
    def user_cache_flags(self) -> Optional[dict]:
        """The model config's ``use_cache`` flags as the user set them before ``wrap`` (None: not recorded)."""
        return getattr(self.engine, "user_cache_flags", None)

    def is_engine_of(self, optimizer) -> bool:
        """Whether ``optimizer`` (a ``CPUAdamW``) steps this engine."""
        return getattr(optimizer, "engine", None) is self.engine

    def on_disk(self, unit) -> bool:
        """Whether ``unit``'s fp32 state (master, exp_avg, exp_avg_sq) is outside the host store: in the disk
        tier, or on the device only (an exclusive device-state layer); :meth:`view` of it needs a :meth:`window`."""
        return self.engine.state_tier(unit) is not None

    @staticmethod
    def param_name(param: torch.Tensor) -> str:
        """The host-store entry name of a parameter of the wrapped model (tied parameters: the first name)."""
        _, unit, i = locate(param)
        return unit.entries[i].name

    def updates_running(self) -> bool:
        """Whether some unit's update was already queued during backward (no clipping, before ``step()``)."""
        return any(u.eager_queued for u in self.engine.units)

    def grads_pending(self) -> bool:
        """Whether a backward since the last ``step()`` / ``zero_grad()`` left gradients not yet applied."""
        return grads_pending(self.engine)

    # ------------------------------------------------------------------ reading and writing
    def view(self, unit, i: int, section: str) -> torch.Tensor:
        """Zero-copy view (CPU, the entry's shape) of entry ``i`` of ``unit`` in ``section`` (``"compute"``,
        ``"master"``, ``"exp_avg"``, ``"exp_avg_sq"``). A disk (exclusive device-state) unit's fp32 section:
        valid inside :meth:`window` until another unit of its tier is viewed."""
        return self.engine.entry_view(unit, i, section)

    def view_later(self, unit, i: int, section: str) -> Callable[[], torch.Tensor]:
        """A function returning :meth:`view` of the entry, called when its bytes are needed."""
        return lambda: self.engine.entry_view(unit, i, section)

    def window(self, write: bool = False):
        """Context in which :meth:`view` reaches the fp32 state of the disk units and the exclusive
        device-state units, one unit's buffer per tier at a time (``write``: what is viewed is written back)."""
        return self.engine.state_window(write=write)

    def check_failed(self) -> None:
        """Raise the sticky error of the CPU worker or the disk tier, if one failed."""
        self.engine.check_failed()

    def sync_before_read(self) -> None:
        """Queued updates done, device-state layers copied to the host store: the store is current."""
        self.engine.sync_host()

    def zero_grad(self) -> None:
        """Drop the gradients accumulated so far (they belong to the weights about to be replaced)."""
        self.engine.zero_grad()

    def reload(self, units: Optional[List] = None) -> None:
        """Device slots / the resident buffer of ``units`` (default all) reload from the host compute copy."""
        self.engine.invalidate(self.engine.units if units is None else units)

    def mark_written(self) -> None:
        """The host store was written (a load): the device-state layers take the new state."""
        self.engine.host_written()
