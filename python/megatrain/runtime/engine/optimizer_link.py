"""What the engine asks of the optimizer attached to it, and the lookup from a parameter to its engine.

:class:`EngineOptimizer` is the optimizer's side of ``Engine.attach_optimizer``; :func:`locate` finds
the engine, unit and entry of a wrapped model's parameter (``Engine.register_param`` records it);
:func:`install_step_guard` installs, once, the torch.optim step pre-hook that refuses another
optimizer's ``step()`` over those parameters.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, List, Optional, Protocol, Tuple

import torch

if TYPE_CHECKING:
    from .units import Unit


class EngineOptimizer(Protocol):
    """What the engine reads and calls on the optimizer attached to it (``Engine.attach_optimizer``).

    :class:`megatrain.optim.CPUAdamW` implements it. The engine calls these on the thread running
    backward (``plan_eager``, ``raise_extra_backward``) or at its sync points, for an update the
    worker skipped (``skip_unit_update``).

    Attributes:
        gradient_accumulation_steps: backward passes per ``step()`` (1: a layer's first gradient
            goes straight into the compute section, see ``submit_grads``).
        max_grad_norm: the clip norm, or None (no clipping: updates may start during backward).
        nonfinite: what a non-finite gradient does (None: nothing is checked; squared norms are
            computed for the check otherwise).
        steps_called: ``step()`` calls that returned (the update being queued belongs to number + 1).
    """

    gradient_accumulation_steps: int
    max_grad_norm: Optional[float]
    nonfinite: Optional[str]
    steps_called: int

    def plan_eager(self, unit: Unit, present: List[bool]) -> Optional[Tuple[list, float]]:
        """``(items, scale)`` when the update of ``unit``'s entries with ``present[i]`` may start now, else None.

        ``items``: ``(entry_index, lr, beta1, beta2, eps, weight_decay, step)`` per entry (the fused AdamW's
        arguments, see ``_C.Worker.submit_adam``).
        """

    def raise_extra_backward(self, same_backward: bool = False) -> None:
        """Raise the error for a gradient that arrives after its unit's update was already queued."""

    def skip_unit_update(self, unit: Unit, items: list, step_number: int) -> None:
        """``unit``'s update (``items``) was skipped for a non-finite gradient in step ``step_number`` (called
        on the main thread at the engine's next sync point after the worker skipped it)."""


_STEP_GUARD = None  # the handle of the global torch.optim step pre-hook (installed once, by the first engine)
_STEP_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> group sizes checked


def _refuse_foreign_step(optimizer, args, kwargs) -> None:
    """torch.optim step pre-hook: an optimizer other than megatrain's over a wrapped model's parameters raises.

    Such an optimizer would see only placeholders (meta layers, or resident copies that the host
    store overwrites) and train nothing while the model's gradients go to its CPUAdamW. Each
    optimizer's parameters are checked once per change of its param groups (a ``_megatrain``
    attribute lookup per parameter).
    """
    if getattr(optimizer, "megatrain_optimizer", False):
        return
    key = tuple(len(g["params"]) for g in optimizer.param_groups)
    if _STEP_CHECKED.get(optimizer) == key:
        return
    for g in optimizer.param_groups:
        for p in g["params"]:
            if locate(p) is not None:
                raise RuntimeError(
                    f"megatrain: {type(optimizer).__module__}.{type(optimizer).__qualname__}.step() over a wrapped "
                    "model's parameters would train nothing (megatrain keeps them in its host store); use "
                    "megatrain.optim.CPUAdamW(model.parameters(), ...) instead")
    _STEP_CHECKED[optimizer] = key


def install_step_guard() -> None:
    """Install the step pre-hook of :func:`_refuse_foreign_step` (once per process)."""
    global _STEP_GUARD
    if _STEP_GUARD is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_GUARD = register_optimizer_step_pre_hook(_refuse_foreign_step)


def locate(param: torch.Tensor) -> Optional[Tuple[object, Unit, int]]:
    """``(engine, unit, entry_index)`` of a parameter of a wrapped model, or None for any other tensor.

    The one lookup from a user-visible parameter (``model.parameters()``) to where megatrain keeps
    it; ``Engine.register_param`` records it.
    """
    return getattr(param, "_megatrain", None)
