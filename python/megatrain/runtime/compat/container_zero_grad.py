"""``nn.Module.zero_grad`` of a module holding a wrapped model also drops that model's host-store gradients
(installed at the first ``megatrain.wrap``, :mod:`.torch_patches`).

A wrapped model's decoder-layer gradients never reach ``p.grad``: they live in the host store, and the
wrapped model's own ``zero_grad`` (installed on it at ``wrap``) drops them with its optimizer's. Torch's
``zero_grad`` on a module around it (the user's own module holding the wrapped model, a PEFT model made
after ``wrap``) only clears ``.grad`` of the parameters it finds, so gradients of a backward it meant to
discard were applied by the next ``step()``. This ``zero_grad`` runs torch's, then the ``zero_grad`` of
every wrapped model among the module's submodules (once each, with the same ``set_to_none``).
"""

from __future__ import annotations

from torch import nn

_torch_zero_grad = nn.Module.zero_grad


def zero_grad(self: nn.Module, set_to_none: bool = True) -> None:
    """``torch.nn.Module.zero_grad``, then each wrapped submodule's own ``zero_grad`` (see module docstring)."""
    _torch_zero_grad(self, set_to_none)
    for m in self.modules():
        if m is not self and "megatrain" in m.__dict__:  # a model wrapped by megatrain.wrap (its engine attribute)
            m.zero_grad(set_to_none=set_to_none)


def install_container_zero_grad() -> None:
    """Route ``torch.nn.Module.zero_grad`` through :func:`zero_grad` (idempotent)."""
    if nn.Module.zero_grad is _torch_zero_grad:
        nn.Module.zero_grad = zero_grad
