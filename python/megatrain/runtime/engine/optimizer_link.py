"""The lookup from a parameter to its engine, and the guard against another optimizer's step.

(What the engine asks of the optimizer attached to it is the ``EngineOptimizer`` protocol of
:mod:`.optimizer_port`, next to what the optimizer asks of the engine.) :func:`locate` finds
the engine, unit and entry of a wrapped model's parameter (``Engine.register_param`` records it);
:func:`install_step_guard` installs, once, the torch.optim step pre-hook that refuses another
optimizer's ``step()`` over those parameters.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Optional, Tuple

import torch

if TYPE_CHECKING:
    from .units import Unit


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
