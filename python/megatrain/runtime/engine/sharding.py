"""How the ranks of a run share the engine's work: :class:`SingleProcess`, the strategy of one process.

An :class:`~megatrain.runtime.engine.core.Engine` is given one strategy (``Engine.sharding``) and its
parts call the strategy's few hooks at the points where a data parallel run differs
(:class:`megatrain.runtime.data_parallel.strategy.DataParallelStrategy`): the hand-over of a layer's
gradients (reduce-scatter), the views the CPU tasks read (this rank's pieces), the accumulator of
those pieces, the all-reduce of the squared norms after ``wait_grads``, the wait for the peers'
updates after ``wait_update`` / ``flush``, and the worker that counts update tasks. One process does
nothing at any of these points.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

import torch

if TYPE_CHECKING:
    from .units import Unit


class SingleProcess:
    """The strategy of an engine that trains alone: every hook is the identity or a no-op.

    Attributes:
        dp: the ``DataParallel`` group (None: one process).
        reduces_grads: ``submit_grads`` hands the gradients to :meth:`submit_grads` (False: the engine's own path).
        allows_eager_updates: updates may start during backward (``Options.eager_updates``).
        piece_accumulator: the owner of this rank's accumulator pieces (``accumulator_allocated``,
            ``accumulator_bytes()``), or None (the engine's own accumulator).
    """

    dp = None
    reduces_grads = False
    allows_eager_updates = True
    piece_accumulator = None

    def bind(self, engine) -> None:
        """Called once by the engine, after its parts are built."""

    def wrap_worker(self, worker):
        """The CPU worker the engine's parts queue tasks on (``worker`` itself)."""
        return worker

    def check_device_state(self, layers) -> Optional[int]:
        """The number of device-state layers to keep without planning (data parallel: 0 or an error), or None."""
        return None

    def task_view(self, views, unit: Unit, i: int, name: str) -> torch.Tensor:
        """Flat view of entry ``i`` of ``unit`` in section ``name`` that the CPU tasks read and write: the whole entry."""
        return views.entry_view(unit, i, name).view(-1)

    def submit_grads(self, unit: Unit, grads: List[Optional[torch.Tensor]], opt):
        """Hand over ``unit``'s gradients (only when ``reduces_grads``)."""
        raise NotImplementedError

    def after_wait_grads(self, units: List[Unit]) -> None:
        """After ``wait_grads``: every rank's squared norms known (data parallel: all-reduced)."""

    def after_zero_grad(self, units: List[Unit]) -> None:
        """After ``zero_grad``: the norms of the window are forgotten."""

    def after_wait_update(self, unit: Unit) -> None:
        """After ``wait_update(unit)``: the peers' updates of ``unit`` are done too."""

    def after_flush(self, units: List[Unit]) -> None:
        """After ``flush``: the peers' updates of every unit are done too."""
