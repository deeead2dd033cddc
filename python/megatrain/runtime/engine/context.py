""":class:`EngineContext`: what the parts of an engine share and none of them changes; :func:`forward_to` and
:func:`part_attribute`, the engine's one-line delegations to its parts."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional

import torch

from ..options import Options


@dataclass(frozen=True)
class EngineContext:
    """The settings every part of an :class:`~megatrain.runtime.engine.core.Engine` reads, built once by it.

    Attributes:
        device: the compute device (``cuda:N`` or ``cpu``); cuda: ``device.type == "cuda"``.
        device_index: the CUDA device index (-1 on the CPU).
        compute_dtype: dtype of the compute copy and of the device slots.
        units: the units in forward order (layers first, resident unit last); layers: the layer units.
        options: the run's :class:`~megatrain.runtime.options.Options` (read once, by the engine).
        store: the ``_C.HostStore``; disk: the disk tier (``DiskOffload``) or None.
        sharding: the strategy of the run (:class:`~.sharding.SingleProcess` or data parallel).
    """

    device: torch.device
    cuda: bool
    device_index: int
    compute_dtype: torch.dtype
    units: List
    layers: List
    options: Options
    store: object
    disk: Optional[object]
    sharding: object


def forward_to(part: str, method, name: Optional[str] = None):
    """An engine method that calls ``method`` of its part ``part`` (the part's signature and
    docstring; looked up on the part at each call). ``name``: the engine's name, if another."""
    target = method.__name__

    @functools.wraps(method)
    def forward(self, *args, **kwargs):
        return getattr(getattr(self, part), target)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name or target
    return forward


def part_attribute(part: str, name: str, doc: str) -> property:
    """A read-only engine property: attribute ``name`` of its part ``part``."""
    return property(lambda self: getattr(getattr(self, part), name), doc=doc)
